"""What each command that writes (fuzz_disk's commands) does under an address-space limit (`ulimit -v`, as shared
clusters and batch systems set one): run once per limit, its outcome is `ran` (exit 0), `said` (exit 1 or 2 with one
`error` line and nothing else Python printed: out of memory, with the limit named), `traceback`, `noise` (a message,
then Python's "Exception ignored" lines), `killed` (the process died without a word from cardtool: a C++ abort inside
torch, libgomp or OpenBLAS failing to start a thread and exiting) or `hang` (past --timeout). The first three are
cardtool's to keep at zero; `killed` and `hang` happen in native code before Python can speak — this measures how
often.

    python benchmarks/memory_limits.py --limits 700 800 900 1100 1400 [--commands generate eval …] [--out F.json]
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
from fuzz_disk import COMMANDS, runnable  # noqa: E402 - beside this script, not a package
from fuzz_kills import example_cards, report_and_exit  # noqa: E402

CARDTOOL_FAULTS = ("traceback", "noise")


def _limited(megabytes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))
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


def measure(names: list[str], limits: list[int], timeout: float, root: Path) -> dict:
    cards = example_cards(root)
    rows, counts = [], {}
    for name in names:
        args, _ = COMMANDS[name]
        if not runnable(name):
            continue
        for megabytes in limits:
            where = root / f"{name}-{megabytes}"
            where.mkdir()
            env = {**os.environ, "CARDTOOL_PATH": str(cards), "CARDTOOL_CACHE": str(where / "cache")}
            try:
                done = subprocess.run([sys.executable, "-m", "cardtool", *args], cwd=where, env=env,
                                      capture_output=True, text=True, timeout=timeout,
                                      preexec_fn=_limited(megabytes))
                code, stderr, kind = done.returncode, done.stderr, outcome(done.returncode, done.stderr)
            except subprocess.TimeoutExpired as stopped:
                code, kind = None, "hang"
                stderr = stopped.stderr.decode(errors="replace") if isinstance(stopped.stderr, bytes) else ""
            counts[kind] = counts.get(kind, 0) + 1
            last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
            row = {"command": name, "limit_mib": megabytes, "exit": code, "outcome": kind, "said": last[:300]}
            if kind in CARDTOOL_FAULTS:  # where it happened: the traceback's frames, its source lines left out
                row["detail"] = "\n".join(line for line in stderr.splitlines() if not line.startswith("    "))[-3000:]
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)
    return {"limits_mib": limits, "counts": counts, "runs": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", type=int, nargs="+", default=[700, 800, 900, 1100, 1400], help="MiB each")
    parser.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS))
    parser.add_argument("--timeout", type=float, default=120.0, help="Seconds before a run counts as a hang.")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = measure(args.commands, args.limits, args.timeout, Path(scratch))
    report_and_exit(report, args.out, CARDTOOL_FAULTS)


if __name__ == "__main__":
    main()
