"""The training loop every method shares: deterministic data order and noise, AdamW with warmup and cosine
decay, optional EMA, bf16 autocast through the platform, atomic checkpoints that a `--resume` continues
bit-for-bit, a stop with a clear error on a NaN/inf loss that keeps the last good checkpoint, a checkpoint on
Ctrl-C or SIGTERM before stopping (core/interrupt.py), and under torchrun data parallelism by DDP or FSDP2
(parallel.py)."""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file

from cardtool.atomic import atomic_path, refuse_stream, save_tensors, writable_folder
from cardtool.backends.host_allocator import keep_freed_memory
from cardtool.backends.platform import Platform
from cardtool.backends.precision import autocast
from cardtool.backends.training import check_optimizer_tensors, load_optimizer_tensors, optimizer_tensors
from cardtool.core import distributed
from cardtool.core.cards.components import few
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.sampling.denoise import NonFiniteImages
from cardtool.core.training.parallel import Parallel
from cardtool.core.training.recipes import Recipe
from cardtool.core.training.run_lock import LOCK, keep_held, run_claimed
from cardtool.errors import BadInput, OutOfMemory, RunFailed, write_remedy
from cardtool.files import is_regular_file, parse_json
from cardtool.paths import opened_by_utf8_name

if TYPE_CHECKING:
    from cardtool.core.cards.loader import Card

__all__ = ["Task", "TrainingDiverged", "TrainResult", "check_run", "check_start", "train_loop", "writable_outputs",
           "CHECKPOINT"]

CHECKPOINT = "checkpoint.safetensors"


class TrainingDiverged(RunFailed):
    """The loss became NaN or inf; the last good checkpoint stays."""


class Task(ABC):
    """What a method trains: its modules, its data, the loss of a batch."""

    # some steps leave a trainable module out of the graph (DMD2's generator between its turns)
    modules_take_turns: bool = False
    # why FSDP2 cannot shard the trainable modules (it gathers a module's weights in that module's own forward), if so
    unshardable: str | None = None
    # every rank runs each trainable module as often in a step; else (rollouts that differ between ranks) a sharded
    # module's weights, gathered at its first forward, stay whole until its backward (or the step's end)
    even_forwards: bool = True
    sharded: bool = False  # set when FSDP2 has sharded the trainable modules
    data: str | None = None  # a digest of the examples it trains on: a resumed run must train on the same
    parents: str | None = None  # a digest of its parent cards by content: a resumed run must train from the same

    @abstractmethod
    def modules(self) -> dict[str, torch.nn.Module]:
        """Trainable modules by component name (their parameters are optimised and EMA-averaged)."""

    @abstractmethod
    def dataset_size(self) -> int: ...

    @abstractmethod
    def loss(self, indices: np.ndarray, generator: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on the training examples `indices`; all randomness drawn from `generator`. Modules the step
        should not update simply get no gradient (AdamW leaves a parameter without one untouched)."""

    def lr_scales(self) -> dict[str, float]:
        """Learning-rate multipliers by module name (a freshly initialised head beside pretrained networks)."""
        return {}

    def prepare(self, step: int) -> None:
        """Called before each step's loss: a method with a schedule of its own (DMD2's two time-scale updates)
        reads the step here."""
        return None

    def micro_batch(self, part: int, parts: int, batch: np.ndarray, shared: torch.Generator) -> None:
        """Called before each micro-batch's loss: it is micro-batch `part` of the step's `parts` (P processes × M),
        `batch` is the whole step's, and `shared` draws alike on every rank — for a method that makes the step's
        data once for all its micro-batches (RL's rollouts, sampled across the ranks)."""
        return None

    def loss_settings(self) -> dict[str, float]:
        """The recipe's `loss:` settings this run used, defaults included: what the card records of them."""
        return {}

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors besides the trainable modules that a resumed run needs (RL's old policy, a rollout buffer);
        saved in every checkpoint."""
        return {}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore what `state` returned at the checkpoint."""
        return None


@dataclass
class TrainResult:
    modules: dict[str, torch.nn.Module]  # the EMA weights when EMA is on
    steps: int
    final_loss: float
    seconds: float
    samples_per_second: float


class _Order:
    """Epoch-wise permutations seeded by (seed, epoch): the data order of any step is known up front."""

    def __init__(self, size: int, batch: int, seed: int):
        self.size, self.batch, self.seed, self._perms = size, batch, seed, {}

    def __call__(self, step: int) -> np.ndarray:
        positions = np.arange(step * self.batch, (step + 1) * self.batch)
        epochs, offsets = positions // self.size, positions % self.size
        out = np.empty(self.batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            chosen = epochs == epoch
            out[chosen] = self._perm(int(epoch))[offsets[chosen]]
        return out

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 1:
                self._perms.clear()
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return self._perms[epoch]


def _lr(recipe: Recipe, step: int) -> float:
    o = recipe.optim
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    progress = (step - o.warmup) / max(1, o.steps - o.warmup)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def _micro_seed(step_seed: int, part: int, parts: int) -> int:
    """The seed of micro-batch `part` of a step split into `parts`: the step's own seed when it is not split, so a
    one-process run draws exactly what it always drew."""
    return step_seed if parts == 1 else (step_seed * 1_000_033 + part + 1) % 2**63


def train_loop(task: Task, recipe: Recipe, platform: Platform, run_dir: Path, *, resume: bool = False,
               on_log: Callable[[dict], None] | None = None, micro_batches: int = 1) -> TrainResult:
    """Train `task` by `recipe`. The global batch is split into P × `micro_batches` micro-batches (P processes under
    torchrun), micro-batch j taking every (P·M)-th example from j with its own seed (step, j): each rank accumulates
    its M micro-batches' gradients and the ranks average theirs (recipe.train.parallel), so P processes × M equal one
    process with P·M micro-batches, up to the order of the floating-point sums. Rank 0 alone writes checkpoints, and
    holds the run folder while it trains (`run_claimed`): a second run started on it is refused."""
    with run_claimed(run_dir, distributed.ranks(platform.device).main):
        return _train(task, recipe, platform, run_dir, resume, on_log, micro_batches)


def check_start(recipe: Recipe, platform: Platform, run_dir: Path, *, resume: bool, micro_batches: int,
                data: str | None, parents: str | None) -> None:
    """What a run is refused for as it starts (`check_run`, the run folder: in use, holding a run, or none to
    resume), checked before its task is made — which may encode a dataset or have a teacher sample for minutes.
    `data` and `parents`: the digests of what the task will train on and from (`Task`)."""
    check_run(recipe, platform, micro_batches)
    ranks = distributed.ranks(platform.device)
    if ranks.main and (Path(run_dir) / LOCK).exists():
        with run_claimed(run_dir):  # another run holds it: refused now; released again for the run itself
            pass
    if _check_run_dir(run_dir, recipe, resume, data, parents, ranks):
        _check_resumable(checkpoint_metadata(run_dir / CHECKPOINT), run_dir / CHECKPOINT, recipe, data, parents,
                         ranks.world * micro_batches)


def _check_run_dir(run_dir: Path, recipe: Recipe, resume: bool, data: str | None, parents: str | None,
                   ranks) -> bool:
    """Whether `run_dir` holds a checkpoint; refused where a fresh run would overwrite one, or a resume finds neither a
    checkpoint nor a run that started there (one stopped before its first checkpoint starts over)."""
    checkpoint = run_dir / CHECKPOINT
    held = ranks.sees(checkpoint, "--run-dir")
    if held and not resume:
        if not made_by(checkpoint, recipe, data, parents):  # --resume would refuse it: not the advice to give
            changed = recipe_changes(checkpoint_metadata(checkpoint).get("recipe"), recipe.shaping())
            raise BadInput(f"{run_dir} already holds the run of another recipe, other data or other parents"
                           f"{changed}; give this run another --run-dir, or remove the folder")
        raise BadInput(f"{run_dir} already holds a run; continue it with --resume, or remove the folder")
    if resume and not held and not ranks.sees(run_dir / LOCK, "--run-dir"):
        # a folder a run started in (its lock is there) and was stopped in before its first checkpoint has nothing
        # to continue, and loses nothing by starting over: a job re-run with --resume after a kill -9 still runs
        raise BadInput(f"nothing to resume: {checkpoint} does not exist and no run has started in {run_dir}; "
                       "start it without --resume")
    return held


def _check_resumable(metadata: dict[str, str], path: Path, recipe: Recipe, data: str | None, parents: str | None,
                     parts: int) -> None:
    """What a checkpoint's header says a resume of it must match: its recipe, its data, its parent cards and how its
    steps were split (their randomness depends on it). A header it cannot read is left to `_load` to name."""
    if not metadata:
        return
    if metadata.get("fingerprint") != recipe.fingerprint():
        changed = recipe_changes(metadata.get("recipe"), recipe.shaping())
        raise BadInput(f"{path} was made by a different recipe{changed}; resume with the same recipe and overrides")
    if data and metadata.get("data", data) != data:  # a checkpoint from before the digest: unknown
        raise BadInput(f"{path} was trained on other data than this run reads (the --data folder or the recipe's "
                       "data.folder; rl's --prompts); resume with the data it started on")
    if parents and metadata.get("parents", parents) != parents:  # a checkpoint from before the digest: unknown
        named = ", ".join(recipe.parents)[:200]
        raise BadInput(f"{path} was trained from parent cards that have changed since ({named}); resume from the "
                       "cards it started from, or start the run again in a new --run-dir")
    try:
        made = int(metadata.get("micro_batches", "1"))
    except ValueError:
        return
    if made != parts:
        raise BadInput(f"{path} was trained with each step split into {made} micro-batch(es) (processes × "
                       f"--micro-batches); resume with the same product, not {parts}")


def check_run(recipe: Recipe, platform: Platform, micro_batches: int, stage: str = "") -> None:
    """What a run of `recipe` needs: a torch device, bf16 compute for a bfloat16 run, a batch that splits into the
    processes × `micro_batches`. The trainer checks it as a run begins; a chain of runs (the flywheel) checks every
    run before the first, `stage` naming the recipe's section in the messages."""
    platform.torch_device  # noqa: B018 - numpy has none: said as such, before its lack of bf16
    if recipe.train.precision == "bfloat16" and not platform.supports_bf16:
        raise BadInput(f"{stage}train.precision bfloat16 needs bf16 compute, which {platform.device}/{platform.arch} "
                       f"lacks; use --set {stage}train.precision=float32")
    if micro_batches < 1:
        raise BadInput(f"--micro-batches must be at least 1, got {micro_batches}")
    world = distributed.ranks(platform.device).world
    if recipe.optim.batch_size % (world * micro_batches):
        raise BadInput(f"{stage}optim.batch_size {recipe.optim.batch_size} must split into {world} process(es) × "
                       f"{micro_batches} micro-batch(es)")


def _train(task: Task, recipe: Recipe, platform: Platform, run_dir: Path, resume: bool,
           on_log: Callable[[dict], None] | None, micro_batches: int) -> TrainResult:
    check_run(recipe, platform, micro_batches)  # after each command checked its input
    ranks = distributed.ranks(platform.device)
    parts = ranks.world * micro_batches
    if platform.torch_device == "cpu":
        keep_freed_memory()
    modules = task.modules()
    parallel = Parallel(recipe.train.parallel, ranks, task, modules, platform.device)
    groups = [[p for p in m.parameters() if p.requires_grad] for m in modules.values()]
    o, schedule = recipe.optim, recipe.train
    scales = task.lr_scales()
    optimizer = torch.optim.AdamW([{"params": group, "lr_scale": scales.get(name, 1.0)}
                                   for name, group in zip(modules, groups, strict=True) if group],
                                  lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    ema = {name: parallel.shard_copy(name).requires_grad_(False) for name in modules} if schedule.ema else None
    checkpoint = run_dir / CHECKPOINT
    for stale in run_dir.glob(f".{CHECKPOINT}.*.tmp"):  # a write that a kill interrupted
        stale.unlink(missing_ok=True)
    start, loss_value, before = 0, float("nan"), 0.0  # before: training seconds of the sessions a resume continues
    read = ranks.all_gather(task.data)
    if len(set(read)) > 1:  # each rank trains on its own share of the images it read: a mix no card could record
        digests = ", ".join(f"rank {r} {str(digest)[:12]}…" for r, digest in enumerate(read))
        raise BadInput(f"the ranks read different training data ({digests}): under torchrun on several nodes, "
                       "--data must hold the same images on every node")
    if _check_run_dir(run_dir, recipe, resume, task.data, task.parents, ranks):
        start, loss_value, before = _load(checkpoint, recipe, modules, ema, optimizer, task, parts, parallel)
    order = _Order(task.dataset_size(), o.batch_size, schedule.seed)
    scaled = {name: scales[name] for name in modules if scales.get(name, 1.0) != 1.0}  # named if the run diverges
    started, seen = time.perf_counter(), 0
    window: dict[str, list[float]] = {}  # the task's metrics since the last progress line
    with stop_requests(ranks.world == 1) as caught:  # under torchrun the ranks must stop together: not there
        for step in range(start, o.steps):
            for group in optimizer.param_groups:
                group["lr"] = _lr(recipe, step) * group.get("lr_scale", 1.0)
            step_seed = schedule.seed * 1_000_003 + step
            for m in modules.values():
                m.train()
            task.prepare(step)
            optimizer.zero_grad(set_to_none=True)
            batch, loss_value = order(step), 0.0
            mine = range(ranks.rank * micro_batches, (ranks.rank + 1) * micro_batches)
            # too much at once (a batch, a rollout): a failed run, its last checkpoint kept
            with OutOfMemory.raised(f"; at step {step}, {_kept(checkpoint)}",
                                    {"step": step, "checkpoint": str(checkpoint)}):
                for part in mine:
                    seed = _micro_seed(step_seed, part, parts)
                    generator = torch.Generator().manual_seed(seed)
                    # anything drawing from torch's global RNG (dropout) becomes a function of the step too, so a
                    # resumed run draws what the uninterrupted one drew; the checkpoint then holds every piece of state
                    torch.manual_seed(seed)
                    # the step's shared draws: the one-process run's own generator, so any split shares what it drew
                    shared = generator if parts == 1 else torch.Generator().manual_seed(step_seed)
                    with autocast(platform, schedule.precision):
                        try:  # an RL task samples its rollouts here: a policy gone NaN shows first in its images
                            task.micro_batch(part, parts, batch, shared)
                        except NonFiniteImages as e:
                            raise _diverged(step, start, checkpoint, "the model sampled NaN or inf", scaled) from e
                        loss, metrics = parallel.loss(batch[part::parts], generator, sync=part == mine[-1])
                    # the ranks average their gradients: each rank's is the mean over its own micro-batches
                    (loss if micro_batches == 1 else loss / micro_batches).backward()
                    loss_value += float(loss.detach()) / parts
            # summed over the ranks (each holding its micro-batches' share): one process's loss
            [loss_value] = ranks.sum([loss_value])
            if not math.isfinite(loss_value):
                raise _diverged(step, start, checkpoint, f"loss became {loss_value}", scaled)
            for group in groups:  # per module: a critic's large gradient must not shrink the generator's
                torch.nn.utils.clip_grad_norm_(group, o.grad_clip)
            optimizer.step()
            parallel.end_step()
            if ema is not None:
                with torch.no_grad():
                    for name, m in modules.items():
                        for e, p in zip(ema[name].parameters(), m.parameters(), strict=True):
                            e.lerp_(p, 1 - schedule.ema)
            seen += o.batch_size
            done = step + 1
            for key, value in metrics.items():
                window.setdefault(key, []).append(value)
            if done % schedule.log_every == 0 or done == o.steps:  # on every rank (a collective), with on_log or not
                elapsed = time.perf_counter() - started
                # each metric averaged over the iterations that reported it: a generator's loss that only some
                # iterations compute (DMD2's two time-scale rule) shows even when the logged iteration is the critic's
                means = _mean_over_ranks(ranks, {key: sum(values) / len(values) for key, values in window.items()})
                window.clear()
                if on_log:  # the time left at this process's own pace (a resumed run's earlier pace may differ)
                    on_log({"step": done, "steps": o.steps, "loss": loss_value, "lr": _lr(recipe, step),
                            "samples_per_second": seen / elapsed if elapsed else 0.0, **means,
                            "elapsed_seconds": before + elapsed,
                            "eta_seconds": elapsed / (done - start) * (o.steps - done)})
            stopping = bool(caught) and done < o.steps
            if done % schedule.checkpoint_every == 0 or done == o.steps or stopping:  # every rank: shards are gathered
                _save(checkpoint, recipe, done, loss_value, before + time.perf_counter() - started, modules, ema,
                      optimizer, task, parts, parallel, ranks.main)
            if stopping:
                raise Interrupted.after(caught[0], f"step {done} of {o.steps}: {checkpoint} holds every finished "
                                        "step; continue with --resume",
                                        {"step": done, "steps": o.steps, "checkpoint": str(checkpoint)})
    elapsed = time.perf_counter() - started
    final = parallel.plain(ema if ema is not None else modules)
    for m in final.values():
        m.eval()
    total = before + elapsed  # over the whole run, also when a resume only wrote its card: not this process's share
    return TrainResult(final, o.steps, loss_value, total, o.steps * o.batch_size / total if total else 0.0)


def writable_outputs(out: Path, run_dir: Path, *, replace: bool, flag: str, card_id: str, parents=(),
                     rename: str = "--set card.id=NAME", relocate: str = "--out", extends: Card | None = None) -> None:
    """The folder the card goes in and the run folder, proven usable before training, not after it: writable, apart
    (a card is written as a whole new folder, so a run folder at or inside it would stop the card at the end), no
    folder at `out` unless `replace` (the command's `flag`) — and then one `write_card` may replace — and `card_id`
    neither another card's on the search path `out` is in nor one in the lineage of the `parents` it is made from,
    nor `out` the folder of such a card; the card it `extends` one its manifest can name from `out`."""
    from cardtool.core.cards.lineage import check_new_folder, check_new_id
    from cardtool.core.cards.writer import card_folder_usable
    from cardtool.core.training.derived import extends_reference

    refuse_stream(run_dir, "a run's checkpoints are written as files in a folder", option="--run-dir")
    if extends is not None:
        extends_reference(extends, Path(out))
    check_new_id(card_id, list(parents), f"give the new card another id ({rename})")
    check_new_folder(out, list(parents))
    # proven writable, not made: a check after this one may yet refuse the run (the write makes the folders)
    card_folder_usable(Path(out), card_id, replace, flag, f"give the new card another id ({rename}), or write it "
                       f"off the card search path ({relocate})", keep=False)
    card, run = Path(out).resolve(), Path(run_dir).resolve()
    if run == card or card in run.parents:
        raise BadInput(f"--run-dir {run_dir} is {'the card folder' if run == card else 'inside the card folder'} "
                       f"{out}: the card is written as a new folder of its own; give a --run-dir outside it")
    writable_folder(run_dir, "the run folder", keep=False)


def _kept(checkpoint: Path) -> str:
    return f"the last good checkpoint is {checkpoint}" if checkpoint.exists() else "none was written yet"


def _diverged(step: int, start: int, checkpoint: Path, what: str, scaled: dict[str, float]) -> TrainingDiverged:
    """The run stopped at `step` (this session began at `start`, 0 unless it resumed)."""
    kept = _kept(checkpoint)
    if step == 0:  # before the first update the learning rate cannot be the cause
        return TrainingDiverged(f"{what} at step 0, before any update; {kept}. The starting weights or the recipe's "
                                "loss: settings give it (a weight too large, say)")
    if step == start:  # the checkpoint's own weights and state give it: not a good one to go back to
        kept = f"the checkpoint it resumed from, {checkpoint}, already gives it (the run diverged before it was " \
               "written, or the file was changed since)"
    # not "then --resume": a resume must keep the checkpoint's recipe, and the same recipe repeats the same steps
    rates = ", ".join(f"{scale:g} for the {name}" for name, scale in scaled.items())
    rates = f" (the loss: section scales it by {rates})" if rates else ""
    return TrainingDiverged(f"{what} at step {step}; {kept}. Lower optim.lr{rates} or raise optim.warmup and start the "
                            "run again in a new --run-dir")


def _mean_over_ranks(ranks, metrics: dict[str, float]) -> dict[str, float]:
    """Each logged metric averaged over the ranks (every rank logs the same keys: the step's turn is shared)."""
    if ranks.world == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    return {k: total / ranks.world for k, total in zip(keys, ranks.sum([metrics[k] for k in keys]), strict=True)}


def _save(path: Path, recipe: Recipe, step: int, loss: float, seconds: float, modules, ema, optimizer,
          task: Task, parts: int, parallel: Parallel, main: bool) -> None:
    """Write the checkpoint from the main rank, in the one-process layout (full tensors, under any mode)."""
    if not (main or parallel.sharded):
        return
    tensors = {f"model.{n}.{k}": v for n, m in modules.items() for k, v in parallel.full_state(m).items()}
    tensors.update({f"task.{k}": v.detach().clone() for k, v in task.state().items()})
    if ema is not None:
        tensors.update({f"ema.{n}.{k}": v for n, m in ema.items() for k, v in parallel.full_state(m).items()})
    optim, groups = optimizer_tensors(optimizer)
    tensors.update(parallel.full_optimizer(optim))
    if not main:
        return
    metadata = {"step": str(step), "loss": repr(loss), "seconds": repr(seconds), "fingerprint": recipe.fingerprint(),
                "recipe": json.dumps(recipe.shaping(), sort_keys=True), "param_groups": groups,
                "micro_batches": str(parts), **({"data": task.data} if task.data else {}),
                **({"parents": task.parents} if task.parents else {})}
    try:
        with atomic_path(path, durable=True) as temporary:
            save_tensors(temporary, {k: v.contiguous().cpu() for k, v in tensors.items()}, metadata)
    except OSError as e:  # the temporary is gone: the checkpoint before this one is intact
        kept = f"the previous checkpoint is kept — {write_remedy(e)} and continue with --resume" if path.is_file() \
            else f"there is no earlier checkpoint — {write_remedy(e)} and start the run again"
        raise RunFailed(f"cannot write the checkpoint of step {step} to {path}: {e.strerror or e}; {kept}") from None
    keep_held(path.parent)  # a run folder removed mid-run was made again by this write: its lock too


def checkpoint_metadata(path: Path) -> dict[str, str]:
    """A checkpoint's recorded step, recipe, fingerprint and data digest; {} for a file that cannot be read."""
    from safetensors import SafetensorError, safe_open

    if not is_regular_file(path):
        return {}
    try:
        with opened_by_utf8_name(path) as name, safe_open(name, framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError):
        return {}


def made_by(path: Path, recipe: Recipe, data: str | None, parents: str | None = None) -> bool:
    """Whether the checkpoint at `path` is a run of `recipe` on the data of digest `data` from the parents of digest
    `parents` — one --resume continues (a checkpoint from before a digest was recorded: assumed so)."""
    metadata = checkpoint_metadata(path)
    return metadata.get("fingerprint") == recipe.fingerprint() and all(
        not digest or metadata.get(key, digest) == digest for key, digest in (("data", data), ("parents", parents)))


def recipe_changes(recorded: str | None, now: dict, shown: int = 4) -> str:
    """' (KEY was A, now B; …)' for the settings that differ between a checkpoint's recorded recipe (JSON) and this
    run's, or '' where the checkpoint records none (one written before checkpoints did) or it cannot be read."""
    try:
        before = parse_json(recorded) if recorded else None
    except ValueError:
        before = None
    if not isinstance(before, dict):
        return ""

    def flat(node, prefix=""):
        if isinstance(node, dict) and node:
            return {k: v for key, item in node.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix[:-1]: node}

    def value(values: dict, key: str) -> str:
        return json.dumps(values[key]) if key in values else "(unset)"

    try:
        was, is_ = flat(before), flat(now)
    except RecursionError:  # nested past what `flat` recurses: no recipe cardtool wrote
        return ""
    changes = [f"{key} was {value(was, key)}, now {value(is_, key)}" for key in sorted(set(was) | set(is_))
               if (key in was, was.get(key)) != (key in is_, is_.get(key))]
    more = f" and {len(changes) - shown} more" if len(changes) > shown else ""
    return f" ({'; '.join(changes[:shown])}{more})" if changes else ""


def _load(path: Path, recipe: Recipe, modules, ema, optimizer, task: Task, parts: int,
          parallel: Parallel) -> tuple[int, float, float]:
    """Restore a checkpoint; the step it was taken after, that step's loss (what a run killed after its last
    checkpoint reports as final) and the training seconds up to it."""
    from safetensors import SafetensorError, safe_open

    unreadable = (f"{path} is not a checkpoint this run can read ({{}}); start the run again in a new --run-dir, or "
                  "remove the file to start over in this one")
    if not is_regular_file(path):  # a FIFO would block the read for ever; a device or a folder is no checkpoint
        raise BadInput(unreadable.format("it is not a regular file"))
    try:
        with opened_by_utf8_name(path) as name:
            with safe_open(name, framework="pt") as f:
                metadata = f.metadata() or {}
            tensors = load_file(name)
    except (SafetensorError, OSError) as e:  # damaged on disk: the trainer itself writes atomically
        raise BadInput(unreadable.format(str(e).splitlines()[0][:160])) from None
    _check_resumable(metadata, path, recipe, task.data, task.parents, parts)
    broken = sorted(k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all()))
    if broken:  # this trainer stops before saving a step gone NaN: a file altered since would make a NaN card
        raise BadInput(unreadable.format(f"it holds NaN or inf in {few(broken)}"))
    integral = sorted(k for k, v in tensors.items() if k.startswith(("model.", "ema.")) and not v.is_floating_point())
    if integral:  # torch would load them, rounding the weights to whole numbers
        raise BadInput(unreadable.format(f"its weights {few(integral)} are not floating point"))
    try:
        step = int(metadata["step"])
        int(metadata.get("micro_batches", "1"))  # compared by _check_resumable, which leaves one it cannot read here
        loss, seconds = float(metadata.get("loss", "nan")), float(metadata.get("seconds", "0"))
    except (KeyError, ValueError) as e:
        raise BadInput(unreadable.format(f"its step record: {e}")) from None
    if not 0 <= step <= recipe.optim.steps or not math.isfinite(seconds) or seconds < 0:
        raise BadInput(unreadable.format(f"step {step} of {recipe.optim.steps}, {seconds} s"))
    try:
        for prefix, group in (("model", modules), ("ema", ema or {})):
            for name, module in group.items():
                state = {k[len(f"{prefix}.{name}."):]: v for k, v in tensors.items()
                         if k.startswith(f"{prefix}.{name}.")}
                parallel.load_full(module, state)
        check_optimizer_tensors(optimizer, tensors, metadata["param_groups"])
        load_optimizer_tensors(optimizer, parallel.local_optimizer(tensors, optimizer))
        task.load_state({k[len("task."):]: v for k, v in tensors.items() if k.startswith("task.")})
    except (RuntimeError, ValueError, KeyError) as e:  # an older cardtool's training state, or a damaged one
        raise BadInput(f"{path} does not fit this run's training state ({str(e).splitlines()[0][:160]}); "
                       "start the run again in a new --run-dir") from None
    return step, loss, seconds
