"""Weight interpolation between a base and its reward-tuned card (WiSE-FT, arXiv 2109.01903; ExPO past α = 1, arXiv
2404.16792): for each α, `cards merge BASE=1−α TUNED=α`, then the class prompts × seeds 0…per_class−1 sampled at each
guidance scale (the card's other loop defaults), scored for class accuracy by the reward's judge and by a held-out
judge (which the RL run never saw), mean reward and FID-FMNIST — where along the line reward and diversity trade.

    python benchmarks/model_soup.py --base fashion-base --tuned fashion-base-nft \
        --alpha 0 --alpha 0.25 --alpha 0.5 --alpha 0.75 --alpha 1 --alpha 1.25 --guidance 1 --guidance 4 \
        --out benchmarks/results/model_soup.json --plot benchmarks/results/model_soup.png
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from judging import Judging, add_arguments  # benchmarks/, this script's folder

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.merge import merge_cards
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.sampler import sample


def plot(rows: list[dict], path: Path) -> None:
    """Held-out accuracy against FID, one line per guidance scale, each point labelled with its α."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for guidance in sorted({r["guidance"] for r in rows}):
        line = [r for r in rows if r["guidance"] == guidance]
        ax.plot([r["fid_fmnist"] for r in line], [r["held_out_accuracy"] for r in line], "o-",
                label=f"guidance {guidance:g}")
        for r in line:
            ax.annotate(f"α={r['alpha']:g}", (r["fid_fmnist"], r["held_out_accuracy"]), fontsize=7,
                        textcoords="offset points", xytext=(4, -9))
    ax.set_xlabel("FID-FMNIST (lower is better)")
    ax.set_ylabel("class accuracy, held-out judge")
    ax.set_title("θ = (1 − α)·base + α·RL'd", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="fashion-base")
    parser.add_argument("--tuned", default="fashion-base-nft")
    parser.add_argument("--alpha", type=float, action="append", required=True, help="The tuned card's weight; repeat.")
    parser.add_argument("--guidance", type=float, action="append", required=True, help="A CFG scale; repeat.")
    parser.add_argument("--steps", type=int, help="Sampling steps (default: the base card's).")
    parser.add_argument("--solver", help="The sampler's solver (default: the base card's).")
    add_arguments(parser)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plot", type=Path, help="Also draw accuracy against FID here (needs matplotlib).")
    args = parser.parse_args()

    judging = Judging.from_args(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for alpha in args.alpha:
            merged = merge_cards([f"{args.base}={1 - alpha!r}", f"{args.tuned}={alpha!r}"], f"soup-{len(rows)}",
                                 Path(tmp) / f"soup-{len(rows)}").card
            loop = LoadedCard(str(merged.folder), device=args.device).loop()
            for guidance in args.guidance:
                requests = judging.requests(merged, guidance=guidance, steps=args.steps, solver=args.solver)
                images = loop.finalize(sample(loop, requests, max_batch=256))
                rows.append({"alpha": alpha, "guidance": guidance, **judging.score(images)})
                print(json.dumps(rows[-1]), flush=True)
    defaults = load_card(locate(args.base)).manifest.loops["denoise"].defaults
    sampled = {k: v for k, v in defaults.items() if k != "guidance"}
    sampled |= {k: v for k, v in (("steps", args.steps), ("solver", args.solver)) if v is not None}
    judging.write(args.out, rows, base=args.base, tuned=args.tuned, loop=sampled)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
