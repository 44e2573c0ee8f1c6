"""What the built-in adapters do, measured: each LoRA's effect at scales 0, 0.5 and 1 and two composed — the
fraction of shoes pointing right (mirror), ink area, the fraction of pixels above 127 (bold), mean intensity
(bright, invert) — with class accuracy under the judge; the same measures on the real test images with each LoRA's
transform applied (raw, and through the card's VAE: what a LoRA in its latent space can reach at best); and the
ControlNet's adherence: the IoU between a held-out test image's silhouette, given as the control, and the silhouette
of the image generated from it (prompted with that image's class), against the base without control.

Every row samples the class prompts × seeds 0…per_class−1 at the card's loop defaults. The ControlNet rows use the
first `--control-images` test images (never trained on), seed i for image i.

    python benchmarks/adapter_effects.py --card fashion-adapters --out benchmarks/results/adapter_effects.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card
from cardtool.core.data import CLASS_NAMES, load_split
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.control import ControlImage, silhouette
from cardtool.core.sampling.denoise import Request
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.planning import plan_requests
from cardtool.core.sampling.sampler import sample
from cardtool.core.transforms import transform

STACKS = [[], [("mirror", 0.5)], [("mirror", 1.0)], [("bright", 0.5)], [("bright", 1.0)],
          [("mirror", 1.0), ("bright", 1.0)], [("mirror", 0.5), ("bright", 0.5)], [("bold", 0.5)], [("bold", 1.0)],
          [("mirror", 1.0), ("bold", 1.0)], [("mirror", 0.5), ("bold", 0.5)], [("invert", 1.0)]]
FOOTWEAR = [CLASS_NAMES.index(name) for name in ("sandal", "sneaker", "ankle boot")]


def pointing_right(images: np.ndarray, labels: np.ndarray, means: np.ndarray) -> float:
    """The fraction of footwear images that correlate better with their class's mean training image mirrored than
    with the mean itself: Fashion-MNIST's shoes point left (0.02 of the test set's footwear; mirrored, 0.98)."""
    keep = np.isin(labels, FOOTWEAR)
    x, mean = images[keep].astype(np.float32), means[labels[keep]]
    x = x - x.mean((1, 2), keepdims=True)
    mean = mean - mean.mean((1, 2), keepdims=True)
    return float(((x * mean[..., ::-1]).sum((1, 2)) > (x * mean).sum((1, 2))).mean())


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-image intersection over union of two boolean masks (B, H, W)."""
    union = (a | b).sum((1, 2))
    return np.where(union > 0, (a & b).sum((1, 2)) / np.maximum(union, 1), 1.0)


def roundtrip(vae, images: np.ndarray) -> np.ndarray:
    """Images encoded to the VAE's posterior mean and decoded."""
    import torch

    out = []
    with torch.no_grad():
        for i in range(0, len(images), 500):
            x = torch.from_numpy(images[i:i + 500].astype(np.float32)[:, None] / 127.5 - 1)
            out.append(vae.decode(vae.encode(x)[0])[:, 0].float().numpy())
    return np.clip(np.round((np.concatenate(out) + 1) * 127.5), 0, 255).astype(np.uint8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--card", default="fashion-adapters")
    parser.add_argument("--judge", default="fashion-classifier")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--control-images", type=int, default=1000)
    parser.add_argument("--controlnet", default="silhouette")
    parser.add_argument("--device")
    parser.add_argument("--data", help="An IDX folder (default: Fashion-MNIST).")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    platform = Platform.detect(args.device)
    judge = FashionJudge(ModelInstance(load_card(locate(args.judge)), platform, "float32"))
    loaded = LoadedCard(args.card, device=args.device)
    loop = loaded.loop()
    labels = np.repeat(np.arange(len(CLASS_NAMES)), args.per_class)
    train = load_split("train", args.data)
    means = np.stack([train.images[train.labels == c].astype(np.float32).mean(0) for c in range(len(CLASS_NAMES))])

    def measures(pictures: np.ndarray, truth: np.ndarray, inverted: bool) -> dict:
        row = {"images": len(pictures), "mean_intensity": round(float(pictures.mean()), 2),
               "ink_area": round(float((pictures > 127).mean()), 4),
               "shoes_pointing_right": round(pointing_right(255 - pictures if inverted else pictures, truth, means), 4),
               "class_accuracy": round(float((judge.probabilities(pictures).argmax(1) == truth).mean()), 4)}
        if inverted:  # the judge reads dark-on-light garments once turned back
            row["class_accuracy_uninverted"] = round(float(
                (judge.probabilities(255 - pictures).argmax(1) == truth).mean()), 4)
        return row

    prompts = [class_prompt(c) for c in range(len(CLASS_NAMES))]
    rows = []
    for stack in STACKS:
        requests, _ = plan_requests(loaded.card, prompts, num=args.per_class, adapters=stack)
        images = loop.finalize(sample(loop, requests, max_batch=256))
        row = {"stack": {name: scale for name, scale in stack} or "none",
               **measures(images, labels, inverted=any(name == "invert" for name, _ in stack))}
        rows.append(row)
        print(json.dumps(row), flush=True)

    test = load_split("test", args.data)
    data_rows = []
    real, real_labels = test.images[:len(labels)], test.labels[:len(labels)]
    vae = loop.instance.component(loop.vae)
    for name in ("none", "mirror", "bright", "mirror+bright", "bold", "mirror+bold", "invert"):
        images = real
        for step in name.split("+"):
            images = transform(step, images)
        for how, pictures in (("real", images), ("through the VAE", roundtrip(vae, images))):
            row = {"data": f"test images, {name}, {how}", **measures(pictures, real_labels, "invert" in name)}
            data_rows.append(row)
            print(json.dumps(row), flush=True)
    images, classes = test.images[:args.control_images], test.labels[:args.control_images]
    shapes = silhouette(images)
    control_rows = []
    for scale in (None, 0.5, 1.0):
        requests = []
        for i, (shape, label) in enumerate(zip(shapes, classes, strict=True)):
            [request], _ = plan_requests(loaded.card, [class_prompt(int(label))], seed=i, adapters=[])
            if scale is not None:
                request = Request(**{**request.__dict__, "adapters": ((args.controlnet, scale),),
                                     "control": ControlImage.make(shape, "none")})
            requests.append(request)
        generated = loop.finalize(sample(loop, requests, max_batch=256))
        scores = iou(silhouette(generated) > 0, shapes > 0)
        row = {"control_scale": scale if scale is not None else "no control (base)", "images": len(generated),
               "silhouette_iou": round(float(scores.mean()), 4),
               "iou_at_least_0.85": round(float((scores >= 0.85).mean()), 4),
               "class_accuracy": round(float((judge.probabilities(generated).argmax(1) == classes).mean()), 4)}
        control_rows.append(row)
        print(json.dumps(row), flush=True)
    report = {"card": loaded.card.id, "judge": args.judge, "per_class": args.per_class,
              "platform": f"{platform.device}/{platform.arch}", "lora": rows, "data": data_rows,
              "controlnet": control_rows,
              "control_images": f"the first {len(images)} Fashion-MNIST test images"}
    write_atomic(args.out, (json.dumps(report, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
