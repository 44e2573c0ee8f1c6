"""How long a command takes under a CPU quota — a container's `--cpus`, Kubernetes' `limits.cpu`, a Slurm job's
cgroup — with the thread pools cardtool fits to it (the default) against a thread a core (OMP_NUM_THREADS and the
BLAS counts set to the cores this process may run on, as every pool took before). Each quota a cgroup of its own
(cgroup v1's cpu hierarchy or v2's cpu.max: as root); the two settings alternate, `--rounds` times, the median kept.

    python benchmarks/cpu_quota.py [--quotas 0.5 1 1.5] [--rounds 3] [--out F.json] [-- COMMAND ARGS…]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_limits import new_cgroup  # noqa: E402 - beside this script, not a package

DEFAULT = ["generate", "fashion-base", "-p", "a bag", "-n", "8", "--steps", "20", "--out", "{scratch}/out"]
POOLS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_cgroup(quota: float | None) -> Path | None:
    """A new cgroup holding this quota (cores a period), or None for none; exits saying why there is none."""
    if quota is None:
        return None
    group, v2 = new_cgroup("cpu", f"cardtool-quota-{os.getpid()}-{quota}")
    try:
        if v2:
            (group / "cpu.max").write_text(f"{int(quota * 100_000)} 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(quota * 100_000)))
    except OSError as e:
        group.rmdir()
        raise SystemExit(f"cannot set the quota of {group}: {e.strerror}") from None
    return group


def timed(args: list[str], group: Path | None, env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cardtool", *args], env=env, capture_output=True, text=True,
                          preexec_fn=(lambda: (group / "cgroup.procs").write_text("0")) if group else None)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quotas", type=float, nargs="+", default=[0.5, 1.0, 1.5])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("command", nargs="*", help="cardtool's arguments after --; {scratch} a scratch folder")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        command = [arg.replace("{scratch}", scratch) for arg in (args.command or DEFAULT)]
        base = {k: v for k, v in os.environ.items() if k not in POOLS}
        settings = {"fitted": base, "a thread a core": {**base, **dict.fromkeys(POOLS, str(cores))}}
        timed(command, None, base)  # the text cache and the OS's page cache warm, for both alike
        for quota in [None, *args.quotas]:
            group = cpu_cgroup(quota)
            try:
                seconds = {name: [] for name in settings}
                for _ in range(args.rounds):
                    for name, env in settings.items():
                        seconds[name].append(timed(command, group, env))
            finally:
                if group is not None:
                    group.rmdir()
            row = {"quota_cores": quota, **{name: round(statistics.median(s), 2) for name, s in seconds.items()},
                   "runs": {name: [round(x, 2) for x in s] for name, s in seconds.items()}}
            row["speedup"] = round(row["a thread a core"] / row["fitted"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"command": command, "cores": cores, "rounds": args.rounds, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
