"""Multi-LoRA serving at the transformer alone, on any device: a card's DiT run for --forwards forwards (a denoising
run's worth) on a batch spread over K random rank-r LoRAs — one base matmul per layer plus one gathered `lora_bgmv`
call — against the batch with no adapter, against the K groups run one after another (unfused, and each fused), and
one shared LoRA fused against unfused. Text states are random and their cross-attention keys and values computed once
per batch, as the denoise loop does; the DiT is built from the card's weights alone (no text encoder, no VAE), so the
script runs where only torch is installed. `benchmarks/adapters.py` measures the whole `generate` path on this CPU.

    python benchmarks/adapters_forward.py --card cards/fashion-base --device cuda --out adapters_forward.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from cardtool.atomic import write_atomic
from cardtool.backends.builders import wan_dit_torch
from cardtool.backends.lora import LoraPlan, LoraWeights, fused, linear_names
from cardtool.backends.lora_targets import DEFAULT_TARGETS, matching
from cardtool.backends.platform import Platform


def serving_ratios(rows: list[dict]) -> dict[str, float]:
    """The ratios the issue sets targets for, from rows in the order no adapter, mixed, groups unfused, groups fused,
    shared unfused, shared fused — and, given a seventh row (the groups one after another with no adapter), the
    ceiling of mixed / groups: what batching the groups gains the base alone."""
    speed = [r["images_per_second"] for r in rows]
    ratios = {"mixed / no adapter": round(speed[1] / speed[0], 3),
              "mixed / groups unfused": round(speed[1] / speed[2], 3),
              "mixed / groups fused": round(speed[1] / speed[3], 3),
              "fused / unfused (one shared LoRA)": round(speed[5] / speed[4], 3)}
    if len(speed) > 6:
        ratios["no adapter: one batch / its groups one after another"] = round(speed[0] / speed[6], 3)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", type=Path, default=Path("cards/fashion-base"), help="A card folder.")
    parser.add_argument("--device")
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--forwards", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    platform = Platform.detect(args.device)
    spec = yaml.safe_load((args.card / "card.yaml").read_text())["components"]["transformer"]
    dit = wan_dit_torch(spec["config"], args.card / spec["weights"], None, platform, args.precision)
    device, kernel = platform.torch_device, dit.ops.lora_bgmv
    layers = linear_names(dit)
    names = matching(sorted(layers), DEFAULT_TARGETS)
    generator = torch.Generator().manual_seed(0)
    loras = [LoraWeights(f"l{i}", args.rank, float(args.rank),
                         {n: (torch.randn(args.rank, layers[n].in_features, generator=generator)
                              / layers[n].in_features**0.5).to(device) for n in names},
                         {n: (torch.randn(layers[n].out_features, args.rank, generator=generator) * 0.02).to(device)
                          for n in names}) for i in range(args.adapters)]
    c = dit.config
    x = torch.randn(args.batch, c.in_channels, 1, 8, 8, generator=generator).to(device)
    t = torch.linspace(999, 1, args.batch).to(device)
    text = torch.randn(args.batch, 16, c.text_dim, generator=generator).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run(rows, plan_of):
        """`forwards` forwards of the DiT on rows `rows`, with the LoRA plan `plan_of(rows)` (None: no LoRA)."""
        plan = plan_of(rows)
        context = dit.text_context(text[rows], plan) if plan else dit.text_context(text[rows])
        for _ in range(args.forwards):
            dit(x[rows], t[rows], text[rows], None, context, **({"lora": plan} if plan else {}))

    everything = list(range(args.batch))
    slot = [i * args.adapters // args.batch for i in everything]  # rows ordered by stack, as `sample` orders them
    groups = [[i for i in everything if slot[i] == s] for s in range(args.adapters)]

    def mixed(rows):
        return LoraPlan([((lora, 1.0),) for lora in loras], [slot[i] for i in rows], kernel, device)

    def one(rows):
        return LoraPlan([((loras[0], 1.0),)], [0] * len(rows), kernel, device)

    def fused_groups():
        for s, rows in enumerate(groups):
            with fused(dit, ((loras[s], 1.0),)):
                run(rows, lambda r: None)

    def fused_one():
        with fused(dit, ((loras[0], 1.0),)):
            run(everything, lambda r: None)

    modes = {"no adapter": lambda: run(everything, lambda r: None),
             f"mixed {args.adapters} LoRAs, one batch": lambda: run(everything, mixed),
             f"{args.adapters} groups one after another, unfused": lambda: [run(g, mixed) for g in groups],
             f"{args.adapters} groups one after another, each fused": fused_groups,
             "one shared LoRA, unfused": lambda: run(everything, one),
             "one shared LoRA, fused": fused_one}
    from cardtool.backends.precision import autocast

    times = {name: [] for name in modes}
    with torch.inference_mode(), autocast(platform, args.precision):
        for mode in modes.values():
            mode()  # warm
        for _ in range(args.repeats):  # round robin: a load change falls on every mode alike
            for name, mode in modes.items():
                sync()
                started = time.perf_counter()
                mode()
                sync()
                times[name].append(time.perf_counter() - started)
    rows = []
    for name, spent in times.items():
        median = statistics.median(spent)
        rows.append({"mode": name, "median_s": round(median, 5), "batches_per_second": round(1 / median, 3),
                     "images_per_second": round(args.batch / median, 1)})
        print(json.dumps(rows[-1]), flush=True)
    ratios = serving_ratios(rows)
    name = torch.cuda.get_device_name() if device == "cuda" else f"{platform.device}/{platform.arch}"
    report = {"card": str(args.card), "device": name, "precision": args.precision, "batch": args.batch,
              "adapters": args.adapters, "rank": args.rank, "forwards": args.forwards, "repeats": args.repeats,
              "torch": torch.__version__, "rows": rows, "ratios": ratios}
    write_atomic(args.out, (json.dumps(report, indent=2) + "\n").encode())
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
