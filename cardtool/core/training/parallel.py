"""Data parallelism for the shared trainer under torchrun, chosen by the recipe's `train.parallel`:

- `ddp` (the default): DistributedDataParallel (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating
  Data Parallel Training") over the step — the task's loss as one module holding every trainable module — so
  whatever a method calls its networks through (a LoRA's weights inside the frozen DiT's forward, a critic inside a
  guided velocity), every trainable gradient is averaged across the ranks, in buckets that overlap the backward.
- `fsdp`: FSDP2's `fully_shard` (Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data
  Parallel") on each trainable module and on each of its blocks: parameters, gradients, optimizer state and EMA
  sharded across the ranks, a block's weights gathered for its forward and backward and freed after (for methods
  whose ranks run their networks unevenly, kept from the first forward to the backward) — for a model that does
  not fit on one device.

Either way the gradients are the average over ranks, each rank's loss being the mean of its M micro-batches', so P
processes × M micro-batches compute what one process with P·M does. Checkpoints hold full tensors in the one-process
layout, whatever the mode, so a run resumes under any mode and (where the method allows) any number of processes.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import torch
from torch import nn

from cardtool.core.distributed import Ranks
from cardtool.errors import BadInput

__all__ = ["Parallel", "whole"]


class _Step(nn.Module):
    """A task's loss as one module whose parameters are all its trainable modules': DDP arms its gradient
    reduction in this module's forward, however the task reaches its networks."""

    def __init__(self, task, modules: dict[str, nn.Module]):
        super().__init__()
        self.task = task
        self.trained = nn.ModuleDict(modules)

    def forward(self, indices, generator):
        return self.task.loss(indices, generator)


class Parallel:
    """The trainable modules of one run and how its ranks share them; in one process, the modules as they are."""

    def __init__(self, mode: str, ranks: Ranks, task, modules: dict[str, nn.Module], device: str):
        self.mode = mode if ranks.world > 1 else "none"  # `mode`: the recipe's train.parallel, ddp or fsdp
        self.task, self.modules, self._ddp, self._skeletons = task, modules, None, {}
        if self.mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            # a method whose modules take turns (DMD2's generator every k-th step) leaves some parameters out of a
            # step's graph: DDP must look for them, and leaves their gradients None, as one process would
            self._ddp = DistributedDataParallel(_Step(task, modules),
                                                device_ids=[ranks.local] if device == "cuda" else None,
                                                find_unused_parameters=task.modules_take_turns)
        elif self.mode == "fsdp":
            if task.unshardable:
                raise BadInput(f"train.parallel fsdp cannot shard this run: {task.unshardable}; use train.parallel "
                               "ddp")
            task.sharded = True
            for name, module in modules.items():
                self._skeletons[name] = _copy(module).to("meta")
                _shard(module, task.even_forwards)

    @property
    def sharded(self) -> bool:
        """Whether full tensors are gathered from every rank's shards (a collective each rank must join)."""
        return self.mode == "fsdp"

    def shard_copy(self, name: str) -> nn.Module:
        """A copy of module `name` (an EMA) sharded as the module is, so their local shards pair up."""
        module = self.modules[name]
        if self.mode != "fsdp":
            return _copy(module)
        twin = copy.deepcopy(self._skeletons[name]).to_empty(device=_device(module))
        _shard(twin, True)
        twin.load_state_dict(module.state_dict())
        return twin

    def loss(self, indices, generator, *, sync: bool):
        """The task's loss on `indices`; with `sync` False the backward to come only accumulates this rank's
        gradients (a micro-batch before the rank's last)."""
        if self.mode == "ddp":
            with contextlib.nullcontext() if sync else self._ddp.no_sync():
                return self._ddp(indices, generator)
        if self.mode == "fsdp":
            for module in self.modules.values():
                module.set_requires_gradient_sync(sync)
        return self.task.loss(indices, generator)

    def end_step(self) -> None:
        """Shard again whatever stayed whole through the step (a module the step ran without a backward), so the
        weights the optimizer updated are gathered afresh and the EMA pairs shard with shard."""
        if self.mode == "fsdp":
            from torch.distributed.fsdp import FSDPModule

            for module in self.modules.values():
                for unit in module.modules():
                    if isinstance(unit, FSDPModule):
                        unit.reshard()

    def full_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """`module`'s state with full tensors (gathered from the ranks' shards under fsdp: every rank must call)."""
        return {k: whole(v).detach().clone() for k, v in module.state_dict().items()}

    def load_full(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors into `module`, each rank keeping its own shard under fsdp."""
        if self.mode == "fsdp":
            own = module.state_dict()
            state = {k: _like(v, own[k]) if k in own else v for k, v in state.items()}
        module.load_state_dict(state)

    def full_optimizer(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: whole(v) for k, v in tensors.items()}

    def local_optimizer(self, tensors: dict[str, torch.Tensor], optimizer) -> dict[str, torch.Tensor]:
        """Full optimizer-state tensors (`optim.INDEX.NAME`) as this rank's shards of the parameters they belong to."""
        if self.mode != "fsdp":
            return tensors
        params = [p for group in optimizer.param_groups for p in group["params"]]
        out = {}
        for key, value in tensors.items():
            prefix, _, rest = key.partition(".")
            param = params[int(rest.split(".")[0])] if prefix == "optim" else None
            out[key] = _like(value, param) if param is not None and value.shape == param.shape and value.dim() \
                else value
        return out

    def plain(self, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
        """Unsharded copies of `modules` (the trained weights, or their EMA) on every rank, for what follows
        training — the card, its evaluation — which runs without the other ranks."""
        if self.mode != "fsdp":
            return modules
        out = {}
        for name, module in modules.items():
            plain = copy.deepcopy(self._skeletons[name]).to_empty(device=_device(module))
            plain.load_state_dict(self.full_state(module))
            out[name] = plain
        return out


def _copy(module: nn.Module) -> nn.Module:
    """A deep copy without forward hooks: a hook is often a method of the task (DMD2 keeps the critic's features),
    and copying it would copy the task with every module it holds."""
    hooks = [(m, m._forward_hooks) for m in module.modules()]
    for m, _ in hooks:
        m._forward_hooks = type(m._forward_hooks)()
    try:
        return copy.deepcopy(module)
    finally:
        for m, kept in hooks:
            m._forward_hooks = kept


def _shard(module: nn.Module, reshard: bool) -> None:
    """fully_shard each block of a block list (a DiT's), then the module: one block's weights whole at a time.

    A sharded unit's weights are gathered by its forward: when ranks run a module a different number of times
    (`reshard` False), each unit's stay whole from its first forward to its backward, so every rank gathers once.
    The sampler's text-context shortcut reads block weights outside their forwards, so a sharded module hides it
    (the sampler then hands the text to each forward)."""
    from torch.distributed.fsdp import fully_shard

    for child in module.children():
        if isinstance(child, nn.ModuleList):
            for block in child:
                if any(p.requires_grad for p in block.parameters()):
                    fully_shard(block, reshard_after_forward=reshard)
    fully_shard(module, reshard_after_forward=reshard)
    module.text_context = None


def whole(value):
    """A tensor whole: gathered from the ranks' shards if FSDP sharded it (every rank must call), else itself."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # not imported: nothing is sharded (one process pays nothing)
    return value.full_tensor() if dtensor is not None and isinstance(value, dtensor.DTensor) else value


def _like(full: torch.Tensor, reference):
    """`full` sharded as the DTensor `reference` is (every rank holds `full`: no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(reference, DTensor):
        return full
    return distribute_tensor(full.to(reference.dtype), reference.device_mesh, reference.placements, src_data_rank=None)


def _device(module: nn.Module):
    return next(iter(module.parameters())).device
