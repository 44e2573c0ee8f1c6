"""`--watch-every N` of `rl` and `distill`: the model in training, sampled as the card it becomes will serve (the RL'd
card's steps without CFG, the student's own few steps), on each class prompt × fixed seeds every N steps — class
accuracy under each judge and FID-FMNIST under the first, logged with the progress line. Where reward hacking (a
held-out judge disagreeing), a collapse of diversity (FID rising) or a student that stopped improving shows, hours
before the final eval. The live weights are read, never changed, and every draw comes from the requests' own seeds,
so a watched run trains exactly as an unwatched one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.errors import BadInput

if TYPE_CHECKING:
    import torch

__all__ = ["Watch", "check_every", "watched"]


class Watch:
    """`module` (the live weights of `card`'s component `name`) sampled with `loop` settings (steps, guidance, shift,
    solver) on the class prompts × seeds 0…per_class−1."""

    def __init__(self, card: Card, name: str, module: torch.nn.Module, cache, loop: dict, judges: list[str],
                 platform: Platform, precision: str, per_class: int = 50, data: str | None = None):
        from cardtool.core.data import CLASS_NAMES, load_split
        from cardtool.core.evaluation.reference import reference_features
        from cardtool.core.evaluation.reward import FashionJudge
        from cardtool.core.prompts import class_prompt
        from cardtool.core.sampling.denoise import DenoiseLoop, Request
        from cardtool.core.sampling.instance import ModelInstance

        instance = ModelInstance(card, platform, precision)
        instance.use(name, module)
        self.loop = DenoiseLoop(instance, cache=cache)
        # one judge named twice (--judge J --held-out-judge J, by id and by path) is judged once
        files = dict.fromkeys(locate(j).resolve() for j in judges)
        self.judges = [FashionJudge(ModelInstance(load_card(file), platform, "float32")) for file in files]
        test = load_split("test", data).classes("--watch-every's class accuracy")
        if len(test) < 2:  # FID's covariance of one image is undefined: every watch would log NaN
            raise BadInput(f"--watch-every measures FID against the test images, and there is {len(test)}; give a "
                           "data folder with more")
        self.real = reference_features(self.judges[0], test.images, test.digest())
        self.requests = [Request(class_prompt(c), seed=i, **loop)
                         for c in range(len(CLASS_NAMES)) for i in range(per_class)]
        self.labels = np.repeat(np.arange(len(CLASS_NAMES)), per_class)
        self.seconds = 0.0  # spent watching, which a benchmark of training speed leaves out (rl_efficiency.py)

    def __call__(self) -> dict[str, float]:
        from cardtool.core.evaluation.metrics import frechet_distance
        from cardtool.core.sampling.sampler import sample

        started = time.perf_counter()
        images = self.loop.finalize(sample(self.loop, self.requests, max_batch=256))
        out = {}
        features, first = self.judges[0].judged(images)  # FID's features and the first judge's classes, one pass
        for i, judge in enumerate(self.judges):
            probabilities = first if i == 0 else judge.probabilities(images)
            out["watch_accuracy" if i == 0 else f"watch_accuracy_{judge.card_id}"] = float(
                (probabilities.argmax(1) == self.labels).mean())
        out["watch_fid"] = frechet_distance(features, self.real)
        self.seconds += time.perf_counter() - started
        return out


def watched(on_log: Callable[[dict], None] | None, watch: Watch | None,
            every: int) -> Callable[[dict], None] | None:
    """The trainer's progress callback with the watch's numbers added to the first progress line at or past each
    multiple of `every` steps."""
    if watch is None:
        return on_log
    due = every

    def log(entry: dict) -> None:
        nonlocal due
        if entry["step"] >= due:
            entry = {**entry, **watch()}
            due = (entry["step"] // every + 1) * every
        if on_log:
            on_log(entry)

    return log


def check_every(every) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise BadInput(f"--watch-every must be 0 (off) or a positive whole number, got {every!r}")
