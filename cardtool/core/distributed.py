"""Running under `torchrun` (torch.distributed): the one piece every command uses to run unchanged on P processes.

torchrun starts each process with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; `ranks()` joins the
process group on first use (`nccl` on CUDA, each process on its LOCAL_RANK's device; `gloo` on the CPU) and says
where this process stands. Work is split by rank (`shard`), results come back to rank 0 (`gather`), and only rank 0
writes. Without WORLD_SIZE > 1 nothing is initialised and every call is the one-process identity.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

from cardtool.errors import BadInput

__all__ = ["Ranks", "end_process", "ranks", "reporting"]

LAUNCH = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT = timedelta(minutes=30)  # a rank that died is reported by its peers' collectives within this
SAY_WAITING_AFTER = 10.0  # seconds: torchrun starts a group's ranks together; longer, one is missing


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local: int = 0
    device: str = "cpu"  # where the group's collectives take their tensors: nccl's are on this rank's GPU

    @property
    def main(self) -> bool:
        """Whether this process writes (cards, checkpoints, images, reports)."""
        return self.rank == 0

    def shard(self, items: list) -> list[int]:
        """The indices of `items` this rank works on: every world-th one, from its rank."""
        return list(range(self.rank, len(items), self.world))

    def gather(self, value) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None elsewhere); [value] in one process."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world if self.main else None
        dist.gather_object(value, out, dst=0)
        return out

    def all_gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank; [value] in one process."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def spread(self, items: list, work) -> list:
        """`work(chosen items)` → one result per item, run on this rank's share; every rank gets all the results,
        in the items' order."""
        mine = self.shard(items)
        done = work([items[i] for i in mine]) if mine else []
        parts = self.all_gather(list(zip(mine, done, strict=True)))
        return [result for _, result in sorted((pair for part in parts for pair in part), key=lambda pair: pair[0])]

    def sum(self, values: list[float]) -> list[float]:
        """Each of `values` summed over the ranks (float64), on every rank; `values` in one process."""
        if self.world == 1:
            return values
        import torch
        import torch.distributed as dist

        total = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total.tolist()

    def sees(self, path, option: str) -> bool:
        """Whether `path` exists, as every rank sees it. Ranks that disagree — `option`'s folder on each node's own
        disk, rank 0 writing where its peers never look — are refused together, where one rank's own refusal would
        leave its peers to fail on a lost connection."""
        seen = self.all_gather(os.path.exists(path))
        if len(set(seen)) > 1:
            have, lack = ([r for r, flag in enumerate(seen) if flag == want] for want in (True, False))
            raise BadInput(f"{_named(have)} {'sees' if len(have) == 1 else 'see'} {path} and {_named(lack)} "
                           f"{'does' if len(lack) == 1 else 'do'} not: under torchrun on several nodes, {option} must "
                           "be on a file system every node shares")
        return seen[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()


def _named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_FAILED = []  # set by end_process when this rank ends with an error
_JOINED = []  # set once this process has joined a group: without one, end_process has nothing to do


def _leave() -> None:
    """At exit, wait for every rank, then close the group: a rank that tore its connections down while a peer still
    used them would abort that peer. A rank that failed waits for none: its peers may be inside another collective
    (a refusal only it met), which its barrier would hold for the group's whole timeout; its exit ends theirs."""
    import torch.distributed as dist

    if dist.is_initialized() and not _FAILED:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except RuntimeError:  # a peer already gone: torchrun reports the failure
            pass


def end_process(code) -> None:
    """Under torchrun, end this process with `code` (SystemExit's): leave the group while the interpreter is whole
    (the exit handlers run now, `_leave` among them), then exit without finalising it. Once every rank had left, a
    rank could still abort ("terminate called without an active exception", SIGABRT) as the runtime tore down — 2 in
    74 two-process runs on 2 cores — and turn a finished job into a failed one. Without a group, it returns, and
    imports nothing: a Ctrl-C inside torch's import leaves it half made, and importing it again raises."""
    import sys

    if not _JOINED:
        return
    if code in (1, 2) or isinstance(code, str):  # an error; a stop by signal (130, 143, 129) is every rank's
        _FAILED.append(code)
    atexit._run_exitfuncs()
    if isinstance(code, str):  # as SystemExit would print it
        sys.stderr.write(code + "\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone, a stream closed: the exit status still says what happened
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def reporting() -> bool:
    """Whether this process logs and reports for the run, known without joining the group (so without torch): rank 0
    of the processes torchrun started, or a process torchrun did not start. A RANK the shell holds without WORLD_SIZE
    above 1 (exported by another tool) is no rank, as `ranks` reads it — not a reason to say nothing."""
    world, rank = _number(os.environ.get("WORLD_SIZE", "1")), _number(os.environ.get("RANK", "0"))
    if world is None or world <= 1:
        return True
    return rank is None or rank == 0


def _number(text: str) -> int | None:
    """A launch variable's whole number, or None: ASCII digits, at most 9 of them (int() of 5,000 digits raises)."""
    return int(text) if text.isascii() and text.isdecimal() and len(text) <= 9 else None


def _say_once_after(seconds: float, line: str):
    """A timer that writes `line` to stderr after `seconds` unless cancelled first: the rendezvous is a C++ wait
    that says nothing, for up to TIMEOUT, while a rank the group needs has not started."""
    import sys
    import threading

    def say():
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()

    timer = threading.Timer(seconds, say)
    timer.daemon = True
    timer.start()
    return timer


def ranks(device: str = "cpu") -> Ranks:
    """This process's place among the processes torchrun launched (joining their group the first time)."""
    world = _number(os.environ.get("WORLD_SIZE", "1"))
    if world is None or world < 1:
        raise BadInput(f"WORLD_SIZE must be a positive whole number, got {os.environ['WORLD_SIZE'][:40]!r}")
    if world == 1:
        return Ranks()
    missing = [name for name in LAUNCH if not os.environ.get(name)]
    if missing:
        raise BadInput(f"WORLD_SIZE={world}, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
                       "launch with torchrun (torchrun --nproc-per-node P -m cardtool …), which sets them all")
    numbers = {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "MASTER_PORT")}
    bad = [f"{name}={value[:40]!r}" for name, value in numbers.items() if _number(value) is None]
    if bad:
        raise BadInput(f"{', '.join(bad)}: each must be a whole number (torchrun sets them)")
    if int(numbers["RANK"]) >= world:  # it would wait out the rendezvous timeout for a place no one has
        raise BadInput(f"RANK={numbers['RANK']} is not below WORLD_SIZE={world}: ranks are 0 … {world - 1}")
    import torch
    import torch.distributed as dist

    local = int(numbers["LOCAL_RANK"])
    if not dist.is_initialized():
        if device == "cuda":
            visible = torch.cuda.device_count()
            if local >= visible:  # set_device would fail with CUDA's "invalid device ordinal"
                fewer = f"start at most {visible} per node (torchrun --nproc-per-node {visible}), or " * (visible > 0)
                raise BadInput(f"LOCAL_RANK={local}, but this process sees {visible or 'no'} CUDA device"
                               f"{'' if visible == 1 else 's'} (one per process): {fewer}run on the CPU with --device "
                               "cpu")
            torch.cuda.set_device(local)
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}, rank {os.environ['RANK']} of {world}"
        waiting = _say_once_after(SAY_WAITING_AFTER, f"waiting for the torchrun group's other ranks ({where}); it "
                                  f"waits up to {TIMEOUT.total_seconds() / 60:g} minutes for all of them to start")
        try:
            dist.init_process_group("nccl" if device == "cuda" else "gloo", timeout=TIMEOUT)
        except (RuntimeError, ValueError) as e:
            raise BadInput(f"cannot join the torchrun process group ({where}): {e}") from None
        finally:
            waiting.cancel()
        atexit.register(_leave)
        _JOINED.append(True)
    # the group's own backend, not the caller's device: a later ranks() call without one joins nothing new
    on_gpu = dist.get_backend() == "nccl"
    return Ranks(dist.get_rank(), dist.get_world_size(), local, f"cuda:{local}" if on_gpu else "cpu")

