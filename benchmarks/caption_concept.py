"""A concept learnt from captions: does a LoRA trained on your own captioned images (an image folder, see Training in
the README) tie what its captions say to what its images show?

`--make-folder DIR` writes such a folder from Fashion-MNIST's training images: half of them inverted and captioned
"<the class prompt> in negative", half as they are under the class prompt. Train a LoRA on it (the README's command),
then measure: for each class, `--per-class` images of "<class prompt>" and of "<class prompt> in negative" from the
LoRA card and from its base — mean intensity (the inverted images are bright: Fashion-MNIST's background is black),
and the judge's class accuracy, on the images as made for the plain prompt and inverted back for "in negative".

    python benchmarks/caption_concept.py --make-folder /tmp/negative
    cardtool train --recipe examples/recipes/fashion-bold.yaml --data /tmp/negative --set data.transform=none \\
        --set model.adapter=negative --set card.id=fashion-negative --set optim.steps=600
    python benchmarks/caption_concept.py --card fashion-negative --out benchmarks/results/caption_concept.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic

SUFFIX = " in negative"


def make_folder(root: Path, count: int, seed: int, data: str | None = None) -> None:
    from PIL import Image

    from cardtool.core.data import load_split
    from cardtool.core.prompts import class_prompt

    train = load_split("train", data)
    rows = []
    for n, i in enumerate(np.random.default_rng(seed).choice(len(train), count, replace=False)):
        negative = n % 2 == 1
        name = f"{'negative' if negative else 'plain'}/{n:05d}.png"
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        image = train.images[i]
        Image.fromarray(255 - image if negative else image, "L").save(root / name)
        rows.append({"file_name": name, "text": class_prompt(int(train.labels[i])) + (SUFFIX if negative else "")})
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {count} captioned images to {root}")


def measure(card: str, judge, per_class: int) -> dict:
    import cardtool
    from cardtool.core.data import CLASS_NAMES
    from cardtool.core.prompts import class_prompt

    loaded, labels = cardtool.LoadedCard(card), np.repeat(np.arange(len(CLASS_NAMES)), per_class)
    out = {}
    for kind, suffix in (("plain", ""), ("negative", SUFFIX)):
        prompts = [class_prompt(c) + suffix for c in range(len(CLASS_NAMES))]
        images = np.stack([i.pixels for i in loaded.generate(prompts, num=per_class, out=None).images])
        judged = 255 - images if suffix else images
        out[kind] = {"mean_intensity": round(float(images.mean()), 1),
                     "class_accuracy": round(float((judge.probabilities(judged).argmax(1) == labels).mean()), 4)}
        print(json.dumps({"card": card, "prompts": kind, **out[kind]}), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--make-folder", type=Path, help="Write the captioned image folder here and stop.")
    parser.add_argument("--images", type=int, default=4000, help="Images in the folder (half inverted).")
    parser.add_argument("--data", help="The IDX folder the images come from (default: Fashion-MNIST).")
    parser.add_argument("--card", help="The LoRA card trained on the folder.")
    parser.add_argument("--base", default="fashion-base")
    parser.add_argument("--judge", default="fashion-classifier")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.make_folder:
        make_folder(args.make_folder, args.images, 0, args.data)
        return
    if not args.card or not args.out:
        parser.error("give --make-folder DIR, or --card CARD and --out FILE")
    from cardtool.backends.platform import Platform
    from cardtool.core.cards.discovery import locate
    from cardtool.core.cards.loader import load_card
    from cardtool.core.evaluation.reward import FashionJudge
    from cardtool.core.sampling.instance import ModelInstance

    judge = FashionJudge(ModelInstance(load_card(locate(args.judge)), Platform.detect(), "float32"))
    results = {name: measure(name, judge, args.per_class) for name in (args.base, args.card)}
    write_atomic(args.out, (json.dumps({"judge": args.judge, "per_class": args.per_class, "cards": results},
                                       indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
