"""LoRA on the DiT's linear layers (Hu et al. 2021, arXiv 2106.09685): `h = W0·x + (α/r)·B·A·x`.

Files use the PEFT / diffusers layout — `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight` (out, r),
module names as in the model's state dict, rank and alpha in the safetensors header metadata — so a LoRA made
here loads with diffusers' `load_lora_adapter` and one written with PEFT loads here.

A batch whose requests carry different adapter stacks runs the base matmul once and adds every row's own
delta in one gathered call (Punica's BGMV, the platform's `lora_bgmv`): each distinct stack is one slot whose A
and B concatenate its LoRAs along the rank, the scales folded into B, so a composed stack is a single
low-rank product equal to the sum of its scaled deltas.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cardtool.backends.lora_targets import matching

__all__ = ["LoraWeights", "LoraPlan", "LoraWrapped", "TrainableLora", "fused", "merge", "linear_names", "lora_file",
           "lora_parts", "lora_weights", "read_lora", "write_lora"]


def linear_names(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's linear layers by state-dict module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@dataclass(frozen=True, eq=False)
class LoraWeights:
    """One loaded version of a LoRA: A (r, in) and B (out, r) per module, and its α/r."""

    version: str  # the file's sha256
    rank: int
    alpha: float
    a: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def delta(self, module: str, scale: float) -> torch.Tensor:
        """scale·(α/r)·B·A, the change this LoRA makes to the module's weight."""
        return (scale * self.scaling) * (self.b[module] @ self.a[module])


def read_lora(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A LoRA file's tensors and header metadata (safetensors only)."""
    from safetensors import safe_open

    from cardtool.paths import opened_by_utf8_name

    with opened_by_utf8_name(path) as name, safe_open(name, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def lora_parts(tensors: dict[str, torch.Tensor], **to) -> tuple[dict, dict]:
    """A checked LoRA file's A and B by module, each `.to(**to)`; names relative to the model (diffusers'
    `transformer.` pipeline prefix removed)."""
    from cardtool.backends.lora_targets import module_key, uses_prefix

    a, b, prefixed = {}, {}, uses_prefix(tensors)
    for key, value in tensors.items():
        module, part = module_key(key, prefixed).rsplit(".lora_", 1)
        (a if part.startswith("A") else b)[module] = value.to(**to)
    return a, b


def lora_weights(tensors: dict[str, torch.Tensor], version: str, rank: int, alpha: float, model: nn.Module,
                 precision: str) -> LoraWeights:
    """A checked LoRA file's tensors as LoraWeights on the model's device, at the precision's weight dtype; numpy
    arrays at the numpy reference DiT's dtype for that one."""
    from cardtool.backends.precision import weights_dtype

    if not isinstance(model, nn.Module):  # the numpy reference's DiT
        dtype = next(iter(model.state_dict().values())).dtype
        parts = lora_parts(tensors, dtype=torch.float64)
        return LoraWeights(version, rank, alpha, *({k: v.numpy().astype(dtype) for k, v in part.items()}
                                                   for part in parts))
    device, dtype = next(model.parameters()).device, getattr(torch, weights_dtype(precision))
    return LoraWeights(version, rank, alpha, *lora_parts(tensors, device=device, dtype=dtype))


def lora_file(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rank: int,
              alpha: float) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and header metadata of a LoRA file in the PEFT layout: rank and alpha as plain fields and as
    diffusers' `lora_adapter_metadata` (its LoraConfig fields)."""
    tensors = {}
    for module in sorted(a):
        tensors[f"{module}.lora_A.weight"] = a[module].detach().float().contiguous().cpu()
        tensors[f"{module}.lora_B.weight"] = b[module].detach().float().contiguous().cpu()
    config = {"r": rank, "lora_alpha": alpha, "target_modules": sorted(a)}
    return tensors, {"format": "pt", "rank": str(rank), "alpha": repr(float(alpha)),
                     "lora_adapter_metadata": json.dumps(config)}


def write_lora(path: Path, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rank: int, alpha: float) -> None:
    """Write a LoRA file (`lora_file`) atomically."""
    from cardtool.atomic import atomic_path, save_tensors

    tensors, metadata = lora_file(a, b, rank, alpha)
    with atomic_path(path, durable=True) as tmp:
        save_tensors(tmp, tensors, metadata)


class LoraPlan:
    """One batch's LoRA work: for each module any stack touches, every row's A (N, r, in) and B (N, out, r) — its
    slot's; zero for a row without one.

    `stacks` is one entry per distinct stack: a tuple of (LoraWeights, scale); `rows` the slot of every row (−1:
    none). The slots are gathered per row once, when the plan is made, not in each of the many calls a batch's
    denoising makes (the plan lives as long as its batch); the slots themselves are built once per set of stacks
    (`slot_weights`), not once per plan — a guided sampling run alone makes two plans (its guided and unguided
    steps batch different rows). Rows in equally long runs of one slot (`equal_runs`: `sample` orders a batch by
    stack) take one product per run instead of one per row: 8 runs of 16 images, not 128 products of one. Each slot's
    rank is zero-padded to a multiple of RANK_STEP, never to another slot's: padding a rank-2 stack to a batch-mate's
    5 is the same sum but not the same rounding (BLAS blocks a sum by its length), and a row gets the bits it gets
    alone (C2). Slots of different padded ranks on a module take one call each: one for the usual mix of ranks ≤ 8."""

    def __init__(self, stacks: list[tuple], rows: list[int], kernel, device, dtype=torch.float32):
        self.kernel = kernel
        slots = slot_weights(stacks, device, dtype)
        self.runs = equal_runs(rows)
        # the kernel's rows: the runs, each a (run length · tokens) block, or the batch's rows themselves
        units = self.runs[2] if self.runs is not None else rows
        self.units, self.whole = len(units), self.runs is None or self.runs[:2] == (0, len(rows))
        # A and B are stored transposed and contiguous, passed as transposed views: the kernel's batched products
        # then read their right-hand sides contiguously (20–45% faster on the avx512 Xeon than strided) — A as it
        # is, (N, r, in), for a kernel that reads it by rows (`a_by_rows`, the avx2 tier's); index_select copies
        # whole rows, 2.5–3× faster than advanced indexing for these gathers
        by_rows = getattr(kernel, "a_by_rows", False)
        self.modules, self.plain = {}, {}
        for module, (a_t, b_t) in slots.items():
            ranks = [_padded(sum(lora.a[module].shape[0] for lora, _ in stack if module in lora.a))
                     for stack in stacks]
            unit_ranks = [ranks[s] if s >= 0 else 0 for s in units]
            present, groups = sorted(set(unit_ranks) - {0}), []
            for rank in present:
                members = None if len(present) == 1 else \
                    torch.tensor([i for i, r in enumerate(unit_ranks) if r == rank], device=device)
                gather = torch.tensor([s if s >= 0 and ranks[s] == rank else len(stacks) for s in units],
                                      device=device)  # the rows of other ranks and none: the all-zero slot
                if members is not None:
                    gather = gather.index_select(0, members)
                a = a_t.index_select(0, gather)[..., :rank]
                groups.append((members, a.transpose(1, 2).contiguous() if by_rows else a.contiguous().transpose(1, 2),
                               b_t.index_select(0, gather)[:, :rank].transpose(1, 2)))
            self.modules[module] = groups
            plain = [i for i, s in enumerate(rows) if s < 0 or ranks[s] == 0]
            if plain:
                self.plain[module] = torch.tensor(plain, device=device)

    def touches(self, module: str) -> bool:
        """Whether any row's stack has a LoRA on linear `module` (the others take the plain product)."""
        return module in self.modules

    def plain_rows(self, module: str) -> torch.Tensor | None:
        """The rows whose stack has no LoRA on `module` where some other row's has (None: there are none)."""
        return self.plain.get(module)

    def __call__(self, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The base output `y` of linear `module` on input `x`, plus every row's own LoRA delta."""
        groups = self.modules.get(module)
        if groups is None:
            return y
        # called 30-odd times a forward: the whole batch, the usual case, without slicing it
        low, high = (0, len(y)) if self.whole else self.runs[:2]
        xs, block = (x, y) if self.whole else (x[low:high], y[low:high])
        shape = block.shape
        xs, block = xs.reshape(self.units, -1, x.shape[-1]), block.reshape(self.units, -1, y.shape[-1])
        for members, a, b in groups:
            if members is None:
                block = self.kernel(xs, block, a, b, None, None)
            else:
                block = block.index_copy(0, members, self.kernel(xs.index_select(0, members),
                                                                 block.index_select(0, members), a, b, None, None))
        return block.reshape(shape) if self.whole else torch.cat([y[:low], block.reshape(shape), y[high:]])


def equal_runs(rows: list[int]) -> tuple[int, int, list[int]] | None:
    """(low, high, slot of each run) splitting rows[low:high] into equally long runs of one slot each — the
    greatest common divisor of its runs' lengths, at least 2 — where every row outside it has none (−1): a batch
    sorted by stack, as `sample` makes it. None where the runs share no such length."""
    low = next((i for i, s in enumerate(rows) if s >= 0), len(rows))
    high = len(rows) - next((i for i, s in enumerate(reversed(rows)) if s >= 0), len(rows))
    starts = [low] + [i for i in range(low + 1, high) if rows[i] != rows[i - 1]]
    lengths = [b - a for a, b in zip(starts, [*starts[1:], high], strict=True)]
    length = math.gcd(*lengths) if low < high else 0
    if length < 2:
        return None
    return low, high, [rows[a] for a, n in zip(starts, lengths, strict=True) for _ in range(n // length)]


_SLOT_CACHE: dict = {}  # the few most recent sets of stacks' slot weights, by the LoRAs' identity and scales
_SLOT_CACHE_SIZE = 8
_SLOT_LOCK = threading.Lock()


def slot_weights(stacks: list[tuple], device, dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per module any stack touches: every slot's A and B (`_slots`) with an all-zero slot appended, transposed
    and contiguous — A (S + 1, in, R), B (S + 1, R, out) — the form a plan gathers rows from. Cached by the
    LoraWeights objects themselves (an entry holds them, so their ids stay theirs) and the scales: a hot-swapped
    file loads as a new object, a new key. Built outside inference mode, so that a grad-enabled forward may use
    them too."""
    key = (tuple(tuple((id(lora), float(scale)) for lora, scale in stack) for stack in stacks), str(device), dtype)
    with _SLOT_LOCK:  # LoadedCards in several threads share it
        entry = _SLOT_CACHE.pop(key, None)
    if entry is None:
        slots = {}
        with torch.inference_mode(False), torch.no_grad():
            for module in sorted({m for stack in stacks for lora, _ in stack for m in lora.a}):
                a, b = _slots(module, stacks, device, dtype)
                slots[module] = tuple(torch.cat([w, torch.zeros_like(w[:1])]).transpose(1, 2).contiguous()
                                      for w in (a, b))
        entry = (tuple(stacks), slots)
    with _SLOT_LOCK:
        while len(_SLOT_CACHE) >= _SLOT_CACHE_SIZE:
            _SLOT_CACHE.pop(next(iter(_SLOT_CACHE)))
        _SLOT_CACHE[key] = entry  # most recent last
    return entry[1]


RANK_STEP = 8  # a slot's rank is zero-padded to a multiple of this, whatever its batch-mates' (LoraPlan)


def _padded(rank: int) -> int:
    return -(-rank // RANK_STEP) * RANK_STEP


def _slots(module: str, stacks: list[tuple], device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot's A (S, R, in) and B (S, out, R) for one module: its stack's LoRAs concatenated along the rank,
    each B times scale·α/r, zero-padded to R, the largest total rank padded to a multiple of RANK_STEP (a slot
    whose stack skips the module is zero). Built with a few batched operations, not one per slot: a plan is made
    for every new batch."""
    parts = [[(lora.a[module], lora.b[module], scale * lora.scaling) for lora, scale in stack if module in lora.a]
             for stack in stacks]
    d_in, d_out = next((p[0].shape[1], p[1].shape[0]) for part in parts for p in part)
    rank = _padded(max(sum(a.shape[0] for a, _, _ in part) for part in parts))
    a_slots, b_slots, coefficients = [], [], []
    for part in parts:
        if len(part) == 1 and part[0][0].shape[0] == rank:  # the common case: one LoRA, scaled below in one go
            a_slots.append(part[0][0])
            b_slots.append(part[0][1])
            coefficients.append(part[0][2])
            continue
        a = torch.cat([a for a, _, _ in part]) if part else torch.zeros(0, d_in, device=device)
        b = torch.cat([b * c for _, b, c in part], dim=1) if part else torch.zeros(d_out, 0, device=device)
        a_slots.append(torch.nn.functional.pad(a, (0, 0, 0, rank - a.shape[0])))
        b_slots.append(torch.nn.functional.pad(b, (0, rank - b.shape[1])))
        coefficients.append(1.0)
    scale = torch.tensor(coefficients, device=device, dtype=dtype)[:, None, None]
    return torch.stack(a_slots).to(dtype), torch.stack(b_slots).to(dtype) * scale


@contextlib.contextmanager
def fused(model: nn.Module, stack: tuple):
    """Merge one stack into the base weights (`W0 + Σ scale·(α/r)·B·A`) for a batch that shares it; on exit the
    original weight tensors are put back — the same objects, so the base is restored bit for bit."""
    if not isinstance(model, nn.Module):  # the numpy reference's DiT
        from cardtool.backends.numpy_adapters import fused as fused_numpy

        with fused_numpy(model, stack):
            yield model
        return
    layers = linear_names(model)
    originals = {}
    try:
        for module in sorted({m for lora, _ in stack for m in lora.a}):
            layer = layers[module]
            originals[module] = layer.weight
            with torch.no_grad():
                merged = layer.weight.detach().clone()
                for lora, scale in stack:
                    if module in lora.a:
                        merged += lora.delta(module, scale).to(merged)
            layer.weight = nn.Parameter(merged, requires_grad=False)
        yield model
    finally:
        for module, weight in originals.items():
            layers[module].weight = weight


class TrainableLora(nn.Module):
    """Trainable A and B for the model's linear layers that match `targets`: A ~ U(±1/√in) as PEFT's Kaiming
    init, B = 0, so at init the model is unchanged. Called as a plan: `lora(module, x, y)`."""

    def __init__(self, model: nn.Module, targets, rank: int, alpha: float):
        super().__init__()
        layers = linear_names(model)
        self.names = matching(sorted(layers), targets)
        if not self.names:
            raise ValueError(f"no linear layer matches the LoRA targets {list(targets)}")
        self.rank, self.alpha = rank, float(alpha)
        device = next(model.parameters()).device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name in self.names:
            layer = layers[name]
            bound = 1 / layer.in_features**0.5
            self.lora_A[_key(name)] = nn.Parameter(
                torch.empty(rank, layer.in_features, device=device).uniform_(-bound, bound))
            self.lora_B[_key(name)] = nn.Parameter(torch.zeros(layer.out_features, rank, device=device))

    def forward(self, module: str, x: torch.Tensor, y: torch.Tensor, scales=None) -> torch.Tensor:
        """y + (α/r)·B·A·x, times each batch row's own scale where `scales` (N,) is given."""
        key = _key(module)
        if key not in self.lora_A:
            return y
        a, b = self.lora_A[key], self.lora_B[key]
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a.to(x.dtype)), b.to(x.dtype))
        if scales is not None:
            delta = delta * scales.to(delta.dtype).reshape(-1, *(1,) * (delta.ndim - 1))
        return y + (self.alpha / self.rank) * delta

    def at(self, scales: torch.Tensor):
        """This LoRA as a plan that applies it at a scale per batch row."""
        return functools.partial(self, scales=scales)

    def weights(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A and B by module name, for `write_lora`."""
        return ({n: self.lora_A[_key(n)] for n in self.names}, {n: self.lora_B[_key(n)] for n in self.names})


def _key(module: str) -> str:
    return module.replace(".", "__")  # ParameterDict keys cannot hold dots


class LoraWrapped(nn.Module):
    """A frozen DiT with a trainable LoRA, standing in for the DiT where a post-training method trains one
    (`rl --lora`, `distill --lora`): the same calls, every forward through the LoRA; only A and B train."""

    def __init__(self, base: nn.Module, lora: TrainableLora):
        super().__init__()
        self.base, self.lora = base.requires_grad_(False), lora
        self.config, self.ops = base.config, base.ops

    def forward(self, x, t, text, text_mask=None, text_context=None, lora=None, control=None):
        return self.base(x, t, text, text_mask, text_context, lora=self.lora, control=control)

    def text_context(self, text, lora=None):
        return self.base.text_context(text, self.lora)

    @property
    def blocks(self):
        return self.base.blocks


def merge(model: nn.Module, stack) -> None:
    """Add a stack's deltas to the model's weights in place (a frozen copy that serves a LoRA card as its loop does)."""
    layers = linear_names(model)
    with torch.no_grad():
        for lora, scale in stack:
            for module in lora.a:
                layers[module].weight += lora.delta(module, scale).to(layers[module].weight)
