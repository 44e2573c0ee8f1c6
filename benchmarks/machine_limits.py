"""What each command that writes (fuzz_disk's commands) does under a limit of the machine's, as shared clusters and
batch systems set them: address space (`ulimit -v`, MiB), open files (`ulimit -n`) or tasks — processes and threads,
as a container's `--pids-limit`, systemd's `TasksMax` or a login node's `ulimit -u` cap them (here a pids cgroup: as
root, where the kernel lets it make one). Run once per limit, its outcome is `ran` (exit 0), `said` (exit 1 or 2
with one `error` line and nothing else Python printed: out of memory, out of file handles or a thread refused, with
the limit named), `traceback`, `noise` (a message, then Python's "Exception ignored" lines), `killed` (the process
died without a word from cardtool: a C++ abort inside torch, libgomp or OpenBLAS failing to start a thread and
exiting) or `hang` (past --timeout). The first three are cardtool's to keep at zero; `killed` and `hang` happen in
native code before Python can speak — this measures how often.

    python benchmarks/machine_limits.py --limits 700 800 900 1100 1400 [--commands generate eval …] [--out F.json]
    python benchmarks/machine_limits.py --resource files --limits 5 6 8 12
    python benchmarks/machine_limits.py --resource processes --limits 1 2 3 4 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz_disk import COMMANDS, arguments, prepared, runnable  # noqa: E402 - beside this script, not a package
from fuzz_kills import report_and_exit  # noqa: E402

CARDTOOL_FAULTS = ("traceback", "noise")


# each limit: the kernel's resource (None: a pids cgroup's), a --limits value in its units, the row's key for it
RESOURCES = {"memory": (resource.RLIMIT_AS, lambda mib: mib << 20, "limit_mib"),
             "files": (resource.RLIMIT_NOFILE, lambda count: count, "limit_files"),
             "processes": (None, lambda count: count, "limit_tasks")}


def new_cgroup(controller: str, name: str) -> tuple[Path, bool]:
    """A new cgroup `name` under `controller` — cgroup v1's hierarchy of that name, or v2's unified tree where it
    enables the controller — and whether it is v2's; exit saying why there is none (as root, where the kernel lets
    this process make one)."""
    for hierarchy, v2 in ((Path("/sys/fs/cgroup") / controller, False), (Path("/sys/fs/cgroup"), True)):
        if (hierarchy / "cgroup.procs").exists() and (not v2 or controller in _text(
                hierarchy / "cgroup.subtree_control").split()):
            group = hierarchy / name
            try:
                group.mkdir()
            except OSError as e:
                raise SystemExit(f"cannot make a {controller} cgroup in {hierarchy}: {e.strerror} (run as root)") \
                    from None
            return group, v2
    raise SystemExit(f"no {controller} cgroup controller on this machine (/sys/fs/cgroup/{controller} or cgroup v2's)")


def pids_cgroup() -> Path:
    """A new pids cgroup for the runs. The kernel counts every task a run starts in it — its threads, its
    children's — and refuses the one past pids.max with EAGAIN, as under `ulimit -u`."""
    return new_cgroup("pids", f"cardtool-limits-{os.getpid()}")[0]


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _limited(kind: str, value: int, group: Path | None = None):
    which, units, _ = RESOURCES[kind]

    def apply() -> None:
        if which is None:  # the child joins the cgroup before it execs: everything it starts counts
            (group / "cgroup.procs").write_text("0")
        else:
            resource.setrlimit(which, (units(value), units(value)))
    if which is None:
        (group / "pids.max").write_text(str(units(value)))
    return apply


def outcome(code: int, stderr: str) -> str:
    """The outcome of one run by its exit code and standard error."""
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    if "Exception ignored" in stderr:
        return "noise"
    if code == 0:
        return "ran"
    said = [line for line in stderr.splitlines() if line.startswith("error ")]
    return "said" if code in (1, 2) and said else "killed"


def measure(names: list[str], limits: list[int], timeout: float, root: Path, kind: str = "memory") -> dict:
    cards = prepared(root, names)
    group = pids_cgroup() if kind == "processes" else None
    try:
        return _measured(names, limits, timeout, root, kind, cards, group)
    finally:
        if group is not None:
            group.rmdir()  # its runs have ended: an empty cgroup is removed


def _measured(names, limits, timeout, root, kind, cards, group) -> dict:
    rows, counts = [], {}
    for name in names:
        args = arguments(name, root)
        if not runnable(name):
            continue
        for limit in limits:
            where = root / f"{name}-{limit}"
            where.mkdir()
            env = {**os.environ, "CARDTOOL_PATH": str(cards), "CARDTOOL_CACHE": str(where / "cache")}
            try:
                done = subprocess.run([sys.executable, "-m", "cardtool", *args], cwd=where, env=env,
                                      capture_output=True, text=True, timeout=timeout,
                                      preexec_fn=_limited(kind, limit, group))
                code, stderr, ended = done.returncode, done.stderr, outcome(done.returncode, done.stderr)
            except subprocess.TimeoutExpired as stopped:
                code, ended = None, "hang"
                stderr = stopped.stderr.decode(errors="replace") if isinstance(stopped.stderr, bytes) else ""
            counts[ended] = counts.get(ended, 0) + 1
            last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
            row = {"command": name, RESOURCES[kind][2]: limit, "exit": code, "outcome": ended, "said": last[:300]}
            if ended in CARDTOOL_FAULTS:  # where it happened: the traceback's frames, its source lines left out
                row["detail"] = "\n".join(line for line in stderr.splitlines() if not line.startswith("    "))[-3000:]
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)
    return {"resource": kind, "limits": limits, "counts": counts, "runs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resource", choices=list(RESOURCES), default="memory")
    parser.add_argument("--limits", type=int, nargs="+", help="MiB each for memory (default 700 800 900 1100 "
                        "1400), open files each for files (default 5 6 8 12), tasks for processes (default 1 2 3 4 6)")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--timeout", type=float, default=120.0, help="Seconds before a run counts as a hang.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        limits = args.limits or {"memory": [700, 800, 900, 1100, 1400], "files": [5, 6, 8, 12],
                                 "processes": [1, 2, 3, 4, 6]}[args.resource]
        report = measure(args.commands, limits, args.timeout, Path(scratch), args.resource)
    report_and_exit(report, args.out, CARDTOOL_FAULTS)


if __name__ == "__main__":
    main()
