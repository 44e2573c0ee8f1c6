"""The same denoise loop on one machine under two arch tiers' kernel cells: which tier's cells are faster here, by
batch size and precision (e.g. the zen4 tier against the avx512_bf16 one on an AMD CPU).

Each (tier, precision) runs in a process of its own (`CARDTOOL_ARCH` forced), as a `cardtool generate` does: on a
Zen 5 EPYC, two tiers or two precisions in one process disturbed each other (MKL's and oneDNN's products and the
flash kernel sharing one heap and thread pool) by up to 1.7× either way. A round starts one process per (tier,
precision), in turn, so the machine's load spreads over all; each loads the card, runs every batch size once to warm
up, then times each --runs times. Medians over all rounds. The loop is `sample`: one prompt × B seeds, S Euler
steps, CFG on every step, no decoding.

    python benchmarks/cpu_tiers.py [--card fashion-base] [--tiers avx512_bf16 zen4] [--batch-sizes 1 16 64]
        [--precisions float32 bfloat16] [--steps 20] [--rounds 5] [--runs 3] [--out benchmarks/results/cpu_tiers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from cardtool.atomic import write_atomic

PROMPT = "an ankle boot"


def worker(args) -> None:
    """In a process whose CARDTOOL_ARCH is the tier: each cell's times, as JSON on stdout."""
    import torch

    from cardtool.core.sampling.denoise import Request
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.core.sampling.sampler import sample

    loaded = LoadedCard(args.card, device="cpu")
    requests = {b: [Request(PROMPT, seed=i, steps=args.steps, guidance=4.0, shift=1.0, guidance_interval=(0.0, 1.0))
                    for i in range(b)] for b in args.batch_sizes}
    cells = [(b, p) for b in args.batch_sizes for p in args.precisions]
    for b, p in cells:
        sample(loaded.loop(p), requests[b])
    times = {f"{b} {p}": [] for b, p in cells}
    for _ in range(args.runs):
        for b, p in cells:
            started = time.perf_counter()
            sample(loaded.loop(p), requests[b])
            times[f"{b} {p}"].append(time.perf_counter() - started)
    print(json.dumps({"arch": loaded.platform.arch, "cpu": loaded.platform.name, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default="fashion-base")
    parser.add_argument("--tiers", nargs=2, default=["avx512_bf16", "zen4"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--precisions", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu_tiers.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    command = [sys.executable, __file__, "--worker", "--card", args.card, "--steps", str(args.steps), "--runs",
               str(args.runs), "--batch-sizes", *map(str, args.batch_sizes)]
    times: dict[tuple, list[float]] = {}
    machine = {}
    for round_ in range(args.rounds):
        for tier, precision in [(t, p) for t in args.tiers for p in args.precisions]:
            done = subprocess.run([*command, "--precisions", precision], env={**os.environ, "CARDTOOL_ARCH": tier},
                                  check=True, capture_output=True, text=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            assert result["arch"] == tier, result["arch"]
            machine = {k: result[k] for k in ("cpu", "torch", "threads")}
            for cell, runs in result["times"].items():
                b, p = cell.split()
                times.setdefault((int(b), tier, p), []).extend(runs)
        print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr)
    median = {cell: statistics.median(t) for cell, t in times.items()}
    first, second = args.tiers
    ratios = {}
    for b in args.batch_sizes:
        for p in args.precisions:
            ratios[f"{second} / {first}, {p}, B={b}"] = round(median[(b, first, p)] / median[(b, second, p)], 3)
        if {"float32", "bfloat16"} <= set(args.precisions):
            for tier in args.tiers:
                ratios[f"bfloat16 / float32, {tier}, B={b}"] = round(
                    median[(b, tier, "float32")] / median[(b, tier, "bfloat16")], 3)
    report = {"card": args.card, "steps": args.steps, "rounds": args.rounds, "runs": args.runs,
              "machine": {**machine, "python": platform.python_version()},
              "rows": [{"batch": b, "tier": tier, "precision": p, "median_s": round(median[(b, tier, p)], 5),
                        "runs_s": [round(t, 5) for t in times[(b, tier, p)]]}
                       for b in args.batch_sizes for tier in args.tiers for p in args.precisions],
              "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, (json.dumps(report, indent=1) + "\n").encode())
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
