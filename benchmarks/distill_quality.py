"""Quality against model evaluations per image: a teacher's step sweep and its DMD2 students, from their recorded
`cardtool eval` reports (eval.json beside each card), as JSON and a plot.

    python benchmarks/distill_quality.py --teacher fashion-base --students fashion-base-1step fashion-base-2step \
        fashion-base-4step --out benchmarks/results/distill_quality.json --plot benchmarks/results/distill_quality.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cardtool.atomic import write_atomic
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.record import EVAL_REPORT
from cardtool.core.sampling.denoise import shifted_sigmas


def evaluations_per_image(steps: int, guidance: float, interval: list[float], shift: float = 1.0) -> int:
    """Transformer rows per image: one per step, two on the guided steps (σ in the interval, guidance ≠ 1)."""
    if guidance == 1:
        return steps
    low, high = interval
    return steps + int(sum(low - 1e-9 <= s <= high + 1e-9 for s in shifted_sigmas(steps, shift)[:-1]))


def points(card_ref: str, role: str) -> list[dict]:
    card = load_card(locate(card_ref))
    report = card.folder / EVAL_REPORT
    if not report.is_file():
        raise SystemExit(f"{card.id} has no {EVAL_REPORT}: run `cardtool eval {card_ref} --record` first")
    shift = float(card.manifest.loops["denoise"].defaults.get("shift", 1.0))
    return [{"card": card.id, "role": role, "steps": r["steps"], "guidance": r["guidance"],
             "guidance_interval": r["guidance_interval"], "precision": r["precision"],
             "evaluations_per_image": evaluations_per_image(r["steps"], r["guidance"], r["guidance_interval"], shift),
             "class_accuracy": r["class_accuracy"], "fid_fmnist": r["fid_fmnist"],
             "images_per_second": r["images_per_second"]}
            for r in json.loads(report.read_text())["rows"] if r["precision"] == "float32"]


def plot(rows: list[dict], teacher_guidance: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sweep = sorted((r for r in rows if r["role"] == "teacher" and r["guidance"] == teacher_guidance),
                   key=lambda r: r["evaluations_per_image"])
    for ax, key, label in ((axes[0], "fid_fmnist", "FID-FMNIST (lower is better)"),
                           (axes[1], "class_accuracy", "class accuracy")):
        ax.plot([r["evaluations_per_image"] for r in sweep], [r[key] for r in sweep], "o-", color="grey",
                label=f"teacher, w = {teacher_guidance:g} (step sweep)")
        for r in (r for r in rows if r["role"] == "student"):
            ax.plot(r["evaluations_per_image"], r[key], "*", markersize=14, label=f"{r['card']} ({r['steps']} steps)")
        ax.set_xscale("log")
        ax.set_xlabel("transformer evaluations per image")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--teacher", default="fashion-base")
    parser.add_argument("--students", nargs="+", default=[])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/distill_quality.json"))
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    rows = points(args.teacher, "teacher") + [p for s in args.students for p in points(s, "student")]
    teacher = load_card(locate(args.teacher))
    guidance = float(teacher.manifest.loops["denoise"].defaults.get("guidance", 1.0))
    write_atomic(args.out, (json.dumps({"teacher": teacher.id, "rows": rows}, indent=1) + "\n").encode())
    if args.plot:
        plot(rows, guidance, args.plot)
    for r in rows:
        if r["role"] == "student" or r["guidance"] == guidance:
            print(f"{r['card']:22s} {r['steps']:3d} steps  w {r['guidance']:g}  "
                  f"NFE {r['evaluations_per_image']:3d}  accuracy {r['class_accuracy']:.3f}  "
                  f"FID {r['fid_fmnist']:7.2f}  {r['images_per_second']:6.0f} img/s")


if __name__ == "__main__":
    main()
