"""The machine's limit on tasks — processes and threads — and the thread pools fitted under it.

A container's `--pids-limit`, systemd's `TasksMax`, a batch system's cgroup and a login node's `ulimit -u` each cap
the tasks a process may start. Every library cardtool loads starts a pool of threads a core at its first use (OpenMP
for torch, OpenBLAS for numpy and again for scipy, the tokenizers' Rayon pool, transformers' loader); past the limit a
native pool ends the process with a message of its own (libgomp, OpenBLAS) or panics (Rayon). Where the room is
short of what those pools would take, the CLI sizes them to fit before any of them loads.
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import resource
except ImportError:  # not on Windows
    resource = None

__all__ = ["fit_thread_pools", "task_room"]

_CGROUPS = Path("/sys/fs/cgroup")
_OWN = Path("/proc/self/cgroup")
_COUNTED = 16_384  # a per-user limit above this is a default, not a cap anyone sized: its tasks are not counted


def task_room() -> int | None:
    """How many more tasks this process may start before the kernel refuses one (EAGAIN): the least room under the
    pids limits of its cgroup and of the cgroups above it, and under the user's limit on tasks (`ulimit -u`, which
    the kernel does not hold root to); None where nothing limits it."""
    rooms = [room for room in (*_cgroup_rooms(), _user_room()) if room is not None]
    return max(0, min(rooms)) if rooms else None


def fit_thread_pools(environ=os.environ) -> int | None:
    """Where the task room is short of what the libraries' thread pools would take, the threads each pool may start
    (OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS), tokenizers without their pool, transformers loading
    without its workers — set in `environ` before any of them loads, a value the user set kept. The count set, or
    None where the room is enough (or unlimited)."""
    room = task_room()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # OpenMP and two OpenBLAS pools start a thread a core less than the pool's size; Rayon and transformers' loader
    # (at most 4) as many as theirs; the main thread and two spare for what else runs
    if room is None or room >= 3 * (cores - 1) + cores + min(4, cores) + 3:
        return None
    each = max(1, min(cores, (room + 1) // 3))  # with the Rayon pool and the loader's workers off: 3·(each − 1) + 3
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        environ.setdefault(name, str(each))
    environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a few prompts at a time: their pool gains nothing
    environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
    return each


def _cgroup_rooms() -> list[int]:
    """The room under each pids limit on the way from this process's cgroup to its hierarchy's root (cgroup v1's
    pids controller or v2's unified tree); the root itself where the path is not there (a container whose own
    cgroup is mounted as the root)."""
    try:
        lines = _OWN.read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "pids":
            mount = _CGROUPS / "pids"
        elif controllers == "" and path:
            mount = _CGROUPS
        else:
            continue
        folder = mount / path.lstrip("/")
        for group in (folder, *[p for p in folder.parents if p.is_relative_to(mount)]) if folder.is_dir() else [mount]:
            room = _room(group)
            if room is not None:
                rooms.append(room)
    return rooms


def _room(group: Path) -> int | None:
    try:
        limit = (group / "pids.max").read_text().strip()
        current = int((group / "pids.current").read_text())
    except (OSError, ValueError):
        return None
    return int(limit) - current if limit.isdigit() else None


def _user_room() -> int | None:
    """The room under RLIMIT_NPROC: its soft limit less the tasks the real user runs now (/proc's status files),
    for a user the kernel holds to it and a limit someone set."""
    if resource is None or os.getuid() == 0:
        return None
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    if limit == resource.RLIM_INFINITY or limit > _COUNTED:
        return None
    return limit - tasks_of(os.getuid())


def tasks_of(uid: int) -> int:
    """The tasks (threads) of the processes whose real user is `uid`, as RLIMIT_NPROC counts them."""
    running = 0
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc, or no handle left to list it: nothing counted
        return 0
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("Uid", "").split()[:1] == [str(uid)]:
            running += int(fields.get("Threads", "1").strip() or 1)
    return running
