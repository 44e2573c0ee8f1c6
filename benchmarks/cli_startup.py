"""Median wall time of light cardtool commands, each in a fresh process (DESIGN.md invariant 5).

    python benchmarks/cli_startup.py [--repeats N] [--out benchmarks/results/cli_startup.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# validate with checksums: deep validation of the built-in and example cards (headers against configs, sums)
COMMANDS = (["--help"], ["cards", "list", "--json"],
            ["cards", "validate", "--checksums", str(REPO / "examples" / "cards"), str(REPO / "cards")])


def measure(argv: list[str], repeats: int, env: dict) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cli_startup.json")
    args = parser.parse_args()

    script = shutil.which("cardtool")
    launcher = [script] if script else [sys.executable, "-m", "cardtool"]
    env = {**os.environ, "CARDTOOL_PATH": str(REPO / "examples" / "cards")}
    measure(launcher + ["--version"], 1, env)  # warm the file cache once
    results = {"launcher": " ".join(launcher), "repeats": args.repeats, "python": platform.python_version(),
               "machine": platform.machine(), "cpus": os.cpu_count(), "median_s": {}}
    for command in COMMANDS:
        name = "cardtool " + " ".join(os.path.relpath(c, REPO) if c.startswith("/") else c for c in command)
        times = measure(launcher + command, args.repeats, env)
        results["median_s"][name] = round(statistics.median(times), 4)
        print(f"{name:32s} median {statistics.median(times) * 1000:7.1f} ms  "
              f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, n={len(times)})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
