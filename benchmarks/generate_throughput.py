"""Images/s of `cardtool generate` against a bare loop of the same transformer forwards, in one run.

For each batch size B (B images of one prompt, seeds 0…B−1, one command):
- command:   `cardtool generate` as a user runs it, in a fresh process (start-up, loading, PNGs included);
- generate:  the same generate() call in this process, models loaded and text features cached (best of
             --repeats; it includes decoding and writing the PNGs);
- bare loop: only the forward passes that call makes (B samples, twice with CFG, per step) and the Euler
             updates, on the same instance: the ceiling the loop's own overhead is measured against.

    python benchmarks/generate_throughput.py [--card examples/cards/tiny-base] [--steps 20]
        [--batch-sizes 1 16 100] [--out benchmarks/results/generate_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cardtool.atomic import write_atomic
from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request, shifted_sigmas
from cardtool.core.sampling.generate import generate
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(instance: ModelInstance, batch: int, steps: int, guidance: float) -> float:
    """Seconds for the forwards and Euler steps alone, on fixed tensors."""
    loop = DenoiseLoop(instance, cache=TextFeatureCache(disk=False))
    [state] = loop.init([Request("a bag", guidance=guidance)])
    inputs = loop.next(state)
    repeat = lambda x: x.repeat_interleave(batch, dim=0)  # noqa: E731 - (k, …) → (k·B, …)
    x, t, text, mask = (repeat(a) for a in (inputs.x, inputs.t, inputs.text, inputs.mask))
    transformer = instance.component("transformer")
    sigmas = shifted_sigmas(steps, 1.0)
    with torch.no_grad():
        started = time.perf_counter()
        for i in range(steps):
            v = transformer(x, t, text, mask)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        return time.perf_counter() - started


def _timed(fn, *args, **kwargs) -> float:
    started = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--card", default=str(ROOT / "examples" / "cards" / "tiny-base"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 100])
    parser.add_argument("--repeats", type=int, default=3, help="in-process timings are the best of this many")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "generate_throughput.json")
    args = parser.parse_args()

    card = load_card(args.card)
    device = Platform.detect()
    instance = ModelInstance(card, device)
    results = {"card": card.id, "steps": args.steps, "guidance": args.guidance, "repeats": args.repeats,
               "platform": f"{device.device}/{device.arch}", "torch_threads": torch.get_num_threads(),
               "python": platform.python_version(), "cpus": os.cpu_count(), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "CARDTOOL_CACHE": str(Path(tmp) / "cache")}
        os.environ["CARDTOOL_CACHE"] = env["CARDTOOL_CACHE"]
        cache = TextFeatureCache()
        common = dict(steps=args.steps, guidance=args.guidance, cache=cache)
        generate(args.card, ["a bag"], num=1, out=Path(tmp) / "warm", **common)  # load models, cache the prompt
        for batch in args.batch_sizes:
            command = [sys.executable, "-m", "cardtool", "generate", args.card, "-p", "a bag", "-n", str(batch),
                       "--steps", str(args.steps), "--guidance", str(args.guidance), "--out", str(Path(tmp) / "cmd")]
            started = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, env=env)
            command_s = time.perf_counter() - started
            generate_s = min(_timed(generate, args.card, ["a bag"], num=batch, out=Path(tmp) / f"b{batch}",
                                    max_batch=2 * batch, **common) for _ in range(args.repeats))
            bare_s = min(bare_loop(instance, batch, args.steps, args.guidance) for _ in range(args.repeats))
            row = {"batch": batch, "command_images_per_s": round(batch / command_s, 2),
                   "generate_images_per_s": round(batch / generate_s, 2),
                   "bare_loop_images_per_s": round(batch / bare_s, 2),
                   "generate_over_bare": round(bare_s / generate_s, 3)}
            results["rows"].append(row)
            print(f"batch {batch:4d}: command {row['command_images_per_s']:8.2f} img/s   "
                  f"generate {row['generate_images_per_s']:8.2f} img/s   bare loop {row['bare_loop_images_per_s']:8.2f}"
                  f" img/s   generate/bare {row['generate_over_bare']:.3f}")
    write_atomic(args.out, (json.dumps(results, indent=2) + "\n").encode())
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
