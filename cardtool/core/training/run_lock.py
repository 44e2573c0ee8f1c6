"""One run folder, one run at a time: a second `train`/`distill`/`rl` (or `--resume`) started on a folder a run is
still using would interleave its checkpoints with the first's. The lock is an advisory `flock` on `RUN/.lock`, which
the kernel drops when its process ends, however it ends — a kill -9 leaves no stale lock to clear by hand. Where
there is no `fcntl` (Windows) runs are not locked."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from cardtool.errors import BadInput, RunFailed, raise_if_the_machines

__all__ = ["LOCK", "keep_held", "run_claimed"]

LOCK = ".lock"
_HELD: dict[str, int] = {}  # the run folders this process holds: the descriptor of each one's lock


@contextlib.contextmanager
def run_claimed(run_dir: Path, claim: bool = True) -> Iterator[None]:
    """Hold `run_dir` for this process (only where `claim`: under torchrun, rank 0 claims it for every rank);
    BadInput naming the holder's process id if another process holds it."""
    try:
        import fcntl
    except ImportError:  # no flock here: nothing to hold
        fcntl = None
    if not claim or fcntl is None:
        yield
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    key = str(Path(run_dir).resolve())
    _HELD[key] = _held(Path(run_dir), BadInput)
    try:
        yield
    finally:
        os.close(_HELD.pop(key))  # closing the descriptor releases the lock


def keep_held(run_dir: Path) -> None:
    """After a write into `run_dir` (a checkpoint): where this process holds it but its lock file is no longer the one
    held — the folder was removed mid-run, and the write made it again without the lock — hold the new one, so a
    second run is still refused there; RunFailed where another run has taken it meanwhile."""
    key = str(Path(run_dir).resolve())
    if key not in _HELD:
        return
    try:
        now, held = os.stat(Path(run_dir) / LOCK, follow_symlinks=False), os.fstat(_HELD[key])
        if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return
    except FileNotFoundError:
        pass
    fd = _held(Path(run_dir), RunFailed, after=" (its folder was removed and made again during this run)")
    os.close(_HELD[key])
    _HELD[key] = fd


def _held(run_dir: Path, refused, after: str = "") -> int:
    """The descriptor of `run_dir`'s lock, held by this process (flock, its process id written in it); `refused`
    (BadInput, RunFailed) where another process holds it or it cannot be the lock."""
    import fcntl

    path = run_dir / LOCK
    remedy = "remove it (cardtool makes it), or give this run another --run-dir"
    try:  # never through a link: the lock is truncated and rewritten, which would clobber the file it points to
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise_if_the_machines(e)
        if path.is_symlink():
            raise refused(f"{path} is a link; {remedy}") from None
        raise refused(f"cannot open {path}, the run's lock ({e.strerror or e}); {remedy}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refused(f"{path} is not a regular file (a device, a pipe); {remedy}")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise refused(f"{run_dir} is in use by another run (process {holder}){after}; wait for it to finish, or "
                      "give this run another --run-dir") from None
    except OSError:  # a file system without flock (some NFS mounts): train unlocked rather than not at all
        pass
    else:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
