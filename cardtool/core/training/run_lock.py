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

from cardtool.errors import BadInput, raise_if_the_machines

__all__ = ["LOCK", "run_claimed"]

LOCK = ".lock"


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
    path = Path(run_dir) / LOCK
    remedy = "remove it (cardtool makes it), or give this run another --run-dir"
    try:  # never through a link: the lock is truncated and rewritten, which would clobber the file it points to
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise_if_the_machines(e)
        if path.is_symlink():
            raise BadInput(f"{path} is a link; {remedy}") from None
        raise BadInput(f"cannot open {path}, the run's lock ({e.strerror or e}); {remedy}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"{path} is not a regular file (a device, a pipe); {remedy}")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise BadInput(f"{run_dir} is in use by another run (process {holder}); wait for it to finish, or "
                           "give this run another --run-dir") from None
        except OSError:  # a file system without flock (some NFS mounts): train unlocked rather than not at all
            pass
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
