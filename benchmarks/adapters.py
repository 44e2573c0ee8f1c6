"""Multi-LoRA serving throughput: one batch of requests spread over K different LoRAs (one base matmul per layer plus
one gathered `lora_bgmv` call) against the same batch with no adapter, against serving the K groups one after
another (each group its own batch: fused into the base, or unfused), and a single shared LoRA fused against unfused.

The K rank-r LoRAs are random (throughput does not depend on what they learned), written beside the card in a
temporary card that extends it. Every mode makes the same images' worth of work (the batch's prompts × seeds at the
card's loop defaults) in one process; the median of --repeats timed runs after a warm-up is reported.

    python benchmarks/adapters.py --card fashion-base --out benchmarks/results/adapters.json \
        --plot benchmarks/results/adapters.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from adapters_forward import serving_ratios  # benchmarks/, this script's folder

from cardtool.atomic import write_atomic
from cardtool.backends.lora import fused, linear_names, write_lora
from cardtool.backends.lora_targets import DEFAULT_TARGETS, matching
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.planning import plan_requests
from cardtool.core.sampling.sampler import sample


def adapter_card(base, folder: Path, count: int, rank: int) -> Path:
    """A card extending `base` that declares `count` random rank-`rank` LoRAs on the default targets."""
    dit = LoadedCard(base, device="cpu").instance.component("transformer")
    layers = linear_names(dit)
    names = matching(sorted(layers), DEFAULT_TARGETS)
    generator = torch.Generator().manual_seed(0)
    entries = []
    for i in range(count):
        a = {n: torch.randn(rank, layers[n].in_features, generator=generator) / layers[n].in_features**0.5
             for n in names}
        b = {n: torch.randn(layers[n].out_features, rank, generator=generator) * 0.02 for n in names}
        write_lora(folder / "adapters" / f"l{i}.safetensors", a, b, rank, rank)
        entries.append(f"  l{i}: {{kind: lora, target: transformer, weights: adapters/l{i}.safetensors, "
                       f"rank: {rank}, alpha: {rank}}}")
    manifest = (f"schema: cardtool/v1\nid: {base.id}-loras\nextends: {os.path.relpath(base.folder, folder)}\n"
                "adapters:\n" + "\n".join(entries) + f"\nrecipe: {{method: lora, parents: [{base.id}]}}\n")
    (folder / "card.yaml").write_text(manifest)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", default="fashion-base")
    parser.add_argument("--batch", type=int, default=64, help="Requests in the batch.")
    parser.add_argument("--adapters", type=int, default=8, help="Distinct LoRAs the batch is spread over.")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, help="Sampling steps (default: the card's).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    if args.batch % args.adapters:
        parser.error("--batch must be a multiple of --adapters")

    base = load_card(locate(args.card))
    with tempfile.TemporaryDirectory() as tmp:
        loaded = LoadedCard(str(adapter_card(base, Path(tmp), args.adapters, args.rank)), device=args.device)
        loop = loaded.loop()
        dit = loop.instance.component(loop.transformer)
        prompts = [class_prompt(i % 10) for i in range(args.batch)]
        group = args.batch // args.adapters

        def requests(stacks):
            out = []
            for prompt, stack in zip(prompts, stacks, strict=True):
                [request], _ = plan_requests(loaded.card, [prompt], steps=args.steps, adapters=list(stack))
                out.append(request)
            return out

        plain = requests([()] * args.batch)
        mixed = requests([((f"l{i % args.adapters}", 1.0),) for i in range(args.batch)])
        shared = requests([(("l0", 1.0),)] * args.batch)

        def fused_run(reqs):
            stack = loop.instance.adapters.resolve(reqs[0].adapters)
            with fused(dit, tuple((u.adapter.value, u.scale) for u in stack)):
                loop.fused = tuple((u.adapter, u.scale) for u in stack)
                try:
                    sample(loop, reqs, max_batch=256)
                finally:
                    loop.fused = None

        groups = [mixed[i::args.adapters] for i in range(args.adapters)]
        plain_groups = [plain[i::args.adapters] for i in range(args.adapters)]
        modes = {
            "no adapter": lambda: sample(loop, plain, max_batch=256),
            f"mixed {args.adapters} LoRAs, one batch": lambda: sample(loop, mixed, max_batch=256),
            f"{args.adapters} groups one after another, unfused": lambda: [sample(loop, g, max_batch=256)
                                                                          for g in groups],
            f"{args.adapters} groups one after another, each fused": lambda: [fused_run(g) for g in groups],
            "one shared LoRA, unfused": lambda: sample(loop, shared, max_batch=256),
            "one shared LoRA, fused": lambda: fused_run(shared),
            # the ceiling of mixed / groups: no adapter anywhere, the same groups one after another
            f"no adapter, {args.adapters} groups one after another": lambda: [sample(loop, g, max_batch=256)
                                                                            for g in plain_groups],
        }
        for run in modes.values():
            run()  # warm: adapter loading and first-call costs stay out of the timings
        # round robin, so a load change on a shared machine falls on every mode alike
        times = {name: [] for name in modes}
        for _ in range(args.repeats):
            for name, run in modes.items():
                started = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - started)
        rows = []
        for name, spent in times.items():
            median = statistics.median(spent)
            rows.append({"mode": name, "images": args.batch, "median_s": round(median, 4),
                         "images_per_second": round(args.batch / median, 2)})
            print(json.dumps(rows[-1]), flush=True)
    ratios = serving_ratios(rows)
    # the same ratio within each round of the round robin: how far a shared machine's load moves it
    plain_times, mixed_times = times["no adapter"], times[f"mixed {args.adapters} LoRAs, one batch"]
    paired = sorted(a / b for a, b in zip(plain_times, mixed_times, strict=True))
    spread = {"mixed / no adapter, per round": {"min": round(paired[0], 3),
                                                "median": round(statistics.median(paired), 3),
                                                "max": round(paired[-1], 3)}}
    report = {"card": base.id, "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
              "steps": mixed[0].steps, "group_size": group, "platform": loop.instance.platform.device + "/"
              + loop.instance.platform.arch, "threads": torch.get_num_threads(), "repeats": args.repeats,
              "rows": rows, "ratios": ratios, "spread": spread}
    write_atomic(args.out, (json.dumps(report, indent=2) + "\n").encode())
    print(json.dumps({**ratios, **spread}, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.barh([r["mode"] for r in rows][::-1], [r["images_per_second"] for r in rows][::-1], color="#4c72b0")
        ax.set_xlabel("images / s")
        ax.set_title(f"{base.id}: {args.batch} requests, {args.adapters} rank-{args.rank} LoRAs, "
                     f"{mixed[0].steps} steps ({report['platform']})", fontsize=9)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
