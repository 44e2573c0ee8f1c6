"""The quality benchmarks' yardstick: images made for the eval's requests (the class prompts × seeds 0…per_class−1),
scored for class accuracy by the reward's judge and by a held-out judge, mean reward (the reward judge's probability
of the prompt's class) and FID-FMNIST against the test split, in the reward judge's features."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic
from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.data import CLASS_NAMES, load_split
from cardtool.core.evaluation.metrics import frechet_distance, precision_recall
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.planning import plan_requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every quality benchmark takes: its judges, images per class, device and data."""
    parser.add_argument("--reward", default="fashion-classifier")
    parser.add_argument("--held-out-judge", default="fashion-referee")
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--device")
    parser.add_argument("--data", help="An IDX folder (default: Fashion-MNIST).")


class Judging:
    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Judging:
        return cls(args.reward, args.held_out_judge, args.per_class, args.device, args.data)

    def __init__(self, reward: str, held_out: str, per_class: int, device: str | None = None,
                 data: str | None = None):
        self.platform, self.reward, self.held_out = Platform.detect(device), reward, held_out
        self.judges = [FashionJudge(ModelInstance(load_card(locate(j)), self.platform, "float32"))
                       for j in (reward, held_out)]
        self.real = self.judges[0].features(load_split("test", data).images)
        self.labels = np.repeat(np.arange(len(CLASS_NAMES)), per_class)
        self.prompts = [class_prompt(c) for c in range(len(CLASS_NAMES))]
        self.per_class = per_class

    def requests(self, card: Card, **loop) -> list:
        """The eval's requests at the card's loop defaults, `loop` (guidance=…) overriding them."""
        return plan_requests(card, self.prompts, num=self.per_class, **loop)[0]

    def score(self, images: np.ndarray) -> dict:
        reward, held_out = (judge.probabilities(images) for judge in self.judges)
        rows, features = np.arange(len(images)), self.judges[0].features(images)
        pair = precision_recall(features, self.real) or (None, None)
        return {"images": len(images), "mean_reward": round(float(reward[rows, self.labels].mean()), 4),
                "class_accuracy": round(float((reward.argmax(1) == self.labels).mean()), 4),
                "held_out_accuracy": round(float((held_out.argmax(1) == self.labels).mean()), 4),
                "fid_fmnist": round(frechet_distance(features, self.real), 3),
                "manifold_precision": pair[0], "manifold_recall": pair[1]}

    def write(self, path: Path, rows: list[dict], **fields) -> None:
        """The benchmark's JSON at `path`, atomically: `fields`, its judges, images per class, platform and rows."""
        document = {**fields, "reward": self.reward, "held_out_judge": self.held_out, "per_class": self.per_class,
                    "platform": f"{self.platform.device}/{self.platform.arch}", "rows": rows}
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(document, indent=1) + "\n").encode())
