"""Image-to-image (`generate --image IMAGE --strength S`) per strength: how much of the start image is kept and how far
the prompt takes over. Start images: real Fashion-MNIST test images, `--per-class` of each class; each is refined
toward the class `--offset` places on (so the prompt always asks for another garment than the image shows), one seed
per start image. Per strength: the judge's accuracy for the prompt's class and for the start image's class, its
probability of each, and the mean absolute pixel difference to the start image (0–255). Then inpainting (`--mask`):
the same images with their rows from `--mask-from` on masked, at strength 1, the difference measured apart in the
kept rows above the masked cells' boundary and in the masked rows.

    python benchmarks/image_to_image.py --card fashion-base --out benchmarks/results/image_to_image.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.core.data import CLASS_NAMES, load_split
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.generate import LoadedCard


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", default="fashion-base")
    parser.add_argument("--judge", default="fashion-classifier")
    parser.add_argument("--strengths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95])
    parser.add_argument("--per-class", type=int, default=20)
    parser.add_argument("--offset", type=int, default=1, help="The prompt's class: the start image's plus this.")
    parser.add_argument("--mask-from", type=int, default=16, help="Inpainting: the first masked row.")
    parser.add_argument("--data", help="An IDX folder (default: Fashion-MNIST).")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    test = load_split("test", args.data)
    starts = [i for c in range(len(CLASS_NAMES)) for i in np.flatnonzero(test.labels == c)[:args.per_class]]
    card = LoadedCard(args.card)
    judge = card.reward(args.judge)
    rows = []
    for strength in args.strengths:
        started, kept, asked, p_kept, p_asked, distance = time.perf_counter(), [], [], [], [], []
        for k, index in enumerate(starts):
            source, target = int(test.labels[index]), (int(test.labels[index]) + args.offset) % len(CLASS_NAMES)
            image = card.generate(class_prompt(target), seed=k, image=test.images[index], strength=strength,
                                  out=None).images[0].pixels
            probabilities = judge.probabilities(image[None])[0]
            kept.append(int(np.argmax(probabilities)) == source)
            asked.append(int(np.argmax(probabilities)) == target)
            p_kept.append(float(probabilities[source]))
            p_asked.append(float(probabilities[target]))
            distance.append(float(np.abs(image.astype(np.float64) - test.images[index]).mean()))
        rows.append({"strength": strength, "prompt_class_accuracy": round(float(np.mean(asked)), 4),
                     "start_class_accuracy": round(float(np.mean(kept)), 4),
                     "p_prompt_class": round(float(np.mean(p_asked)), 4),
                     "p_start_class": round(float(np.mean(p_kept)), 4),
                     "mean_abs_difference": round(float(np.mean(distance)), 2),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(json.dumps(rows[-1]), flush=True)
    report = {"card": args.card, "judge": args.judge, "images": len(starts), "offset": args.offset, "rows": rows,
              "inpainting": inpainting(card, judge, test, starts, args)}
    print(json.dumps(report["inpainting"]), flush=True)
    write_atomic(args.out, (json.dumps(report, indent=2) + "\n").encode())


def inpainting(card, judge, test, starts: list[int], args) -> dict:
    """Each start image with rows `mask_from`… masked, toward the next class's prompt: the kept rows (those above the
    cell row the mask's first row falls in: cells are 4 pixels, the image padded by 2) against the masked rows."""
    mask = np.zeros(test.images.shape[1:], np.uint8)
    mask[args.mask_from:] = 255
    kept = (args.mask_from + 2) // 4 * 4 - 2  # the first row of the latent cell the mask's first row falls in
    started, asked, top, bottom = time.perf_counter(), [], [], []
    for k, index in enumerate(starts):
        target = (int(test.labels[index]) + args.offset) % len(CLASS_NAMES)
        image = card.generate(class_prompt(target), seed=k, image=test.images[index], mask=mask,
                              out=None).images[0].pixels.astype(np.float64)
        asked.append(int(np.argmax(judge.probabilities(image.astype(np.uint8)[None])[0])) == target)
        top.append(float(np.abs(image[:kept] - test.images[index][:kept]).mean()))
        bottom.append(float(np.abs(image[args.mask_from:] - test.images[index][args.mask_from:]).mean()))
    return {"masked_rows": f"{args.mask_from}-{mask.shape[0] - 1}", "kept_rows": f"0-{kept - 1}",
            "prompt_class_accuracy": round(float(np.mean(asked)), 4),
            "kept_rows_mean_abs_difference": round(float(np.mean(top)), 2),
            "masked_rows_mean_abs_difference": round(float(np.mean(bottom)), 2),
            "seconds": round(time.perf_counter() - started, 1)}


if __name__ == "__main__":
    main()
