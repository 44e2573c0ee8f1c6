"""The libraries' thread pools, fitted to what the machine lets this process use: its CPU quota and its limit on
tasks (processes and threads).

Every library cardtool loads starts a pool of a thread a core at its first use — OpenMP for torch, OpenBLAS for numpy
and again for scipy, the tokenizers' Rayon pool, transformers' loader — counting the cores it may run on, not the CPU
time it may use. Under a CPU quota (a container's `--cpus`, Kubernetes' `limits.cpu`, a Slurm job's cgroup) more
OpenMP threads than the quota's cores spin through their barriers on a budget that runs out every period
(`benchmarks/cpu_quota.py`). Under a limit on tasks (a container's `--pids-limit`, systemd's `TasksMax`, a login
node's `ulimit -u`) a pool past it ends the process with a message of its own (libgomp, OpenBLAS) or panics (Rayon).
The CLI sizes the pools to both before any of them loads.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

try:
    import resource
except ImportError:  # not on Windows
    resource = None

__all__ = ["cpu_quota", "cpu_threads", "fit_thread_pools", "task_room"]

_CGROUPS = Path("/sys/fs/cgroup")
_PROC = Path("/proc")
_OWN = _PROC / "self" / "cgroup"
_COUNTED = 16_384  # a per-user limit above this is a default, not a cap anyone sized: its tasks are not counted
_FITTED: list[str] = []  # why fit_thread_pools sized the pools in this process, where it did


def fit_thread_pools(environ=os.environ) -> int | None:
    """Where the CPU quota holds fewer cores than this process may run on, or the task room is short of what the
    pools would start, the threads each pool may use (OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS) — and
    under a task limit tokenizers without their pool and transformers loading without its workers — set in `environ`
    before any of them loads, a value the user set kept. The count set, or None where nothing needed fitting."""
    cores = _cores()
    quota, room = cpu_quota(), task_room()
    # a core's part its own thread, as the JVM counts a quota's processors: under 1.5 cores of 2 one thread was 4%
    # slower than two, under 1 and 0.5 two were 1.32 and 1.28 times slower than one (`benchmarks/cpu_quota.py`)
    each = cores if quota is None else max(1, min(cores, math.ceil(quota)))
    # new tasks: OpenMP and two OpenBLAS pools a thread a core less than the pool's size, Rayon and transformers'
    # loader (at most 4) as many as theirs, and two spare for what else runs (the room counts this process already)
    short = room is not None and room < 3 * (cores - 1) + cores + min(4, cores) + 2
    if short:  # with Rayon's pool and the loader's workers off: 3·(each − 1) + 2 ≤ room
        each = max(1, min(each, (room + 1) // 3))
    if each == cores and not short:
        return None
    if "OMP_NUM_THREADS" not in environ:
        _FITTED[:] = ([f"a CPU quota of {quota:g} cores"] if quota is not None and quota < cores else []) + \
            ([f"a limit on tasks with room for {room} more"] if short else [])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        environ.setdefault(name, str(each))
    if short:
        environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a few prompts at a time: their pool gains nothing
        environ.setdefault("HF_DEACTIVATE_ASYNC_LOAD", "1")
    return each


def cpu_threads(environ=os.environ) -> tuple[int, str]:
    """The threads torch's CPU pool takes in this process, and why that many: OMP_NUM_THREADS as the user set it or
    as `fit_thread_pools` did (torch takes no more than the machine's cores), else a thread a core this process may
    run on."""
    value = environ.get("OMP_NUM_THREADS", "")
    if value.strip().isdigit() and int(value) > 0:
        return min(int(value), os.cpu_count() or 1), " and ".join(_FITTED) if _FITTED else "OMP_NUM_THREADS"
    return _cores(), "a thread a core this process may run on"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_quota() -> float | None:
    """The cores' worth of CPU time this process may use a period — the least quota of its cgroup and those above
    (cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us, v2's cpu.max) — or None where none is set."""
    quotas = [quota for group in _groups("cpu") if (quota := _quota(group)) is not None]
    return min(quotas) if quotas else None


def task_room() -> int | None:
    """How many more tasks this process may start before the kernel refuses one (EAGAIN): the least room under the
    pids limits of its cgroup and of the cgroups above it, and under the user's limit on tasks (`ulimit -u`, which
    the kernel does not hold root to); None where nothing limits it."""
    rooms = [room for room in (*map(_room, _groups("pids")), _user_room()) if room is not None]
    return max(0, min(rooms)) if rooms else None


def _groups(controller: str) -> list[Path]:
    """The folders of this process's cgroup and of each above it, in `controller`'s cgroup v1 hierarchy and in the v2
    tree; a hierarchy's root where the path is not under it (a container whose own cgroup is mounted as the root)."""
    try:
        lines = _OWN.read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        names, path = parts[1].split(","), parts[2]
        if controller in names:  # v1: mounted by its name, or by the names it shares a hierarchy with
            mount = next((m for m in (_CGROUPS / controller, _CGROUPS / parts[1]) if m.is_dir()), None)
        else:
            mount = _CGROUPS if parts[1] == "" else None
        if mount is None:
            continue
        folder = mount / path.lstrip("/")
        groups += [folder, *[p for p in folder.parents if p.is_relative_to(mount)]] if folder.is_dir() else [mount]
    return groups


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota(group: Path) -> float | None:
    v2 = _read(group / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
    else:
        quota, period = _read(group / "cpu.cfs_quota_us"), _read(group / "cpu.cfs_period_us")
    try:
        return int(quota) / int(period) if int(quota) > 0 and int(period) > 0 else None  # v1's -1, v2's max: none
    except (TypeError, ValueError):
        return None


def _room(group: Path) -> int | None:
    limit, current = _read(group / "pids.max"), _read(group / "pids.current")
    return int(limit) - int(current) if limit and limit.isdigit() and current and current.isdigit() else None


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
        entries = list(os.scandir(_PROC))
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
