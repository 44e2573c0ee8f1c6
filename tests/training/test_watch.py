"""`--watch-every N`: its schedule, its checks and what it measures (in a distill run: test_distill.py)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import REPO, write_idx_folder

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.data import CLASS_NAMES, load_split
from cardtool.core.evaluation.metrics import frechet_distance
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.core.training.watch import Watch, check_every, watched
from cardtool.errors import BadInput


def test_the_watch_joins_the_first_progress_line_at_or_past_each_multiple_of_every():
    calls, logged = [], []

    def watch():
        calls.append(1)
        return {"watch_fid": float(len(calls))}

    log = watched(logged.append, watch, 4)
    for step in (3, 6, 7, 9, 12, 13, 20, 21):  # progress lines every few steps, not on the multiples
        log({"step": step, "loss": 0.5})
    assert [(e["step"], e.get("watch_fid")) for e in logged] == [
        (3, None), (6, 1.0), (7, None), (9, 2.0), (12, 3.0), (13, None), (20, 4.0), (21, None)]
    assert all(e["loss"] == 0.5 for e in logged)
    quiet = watched(None, watch, 1)  # no progress callback: the watch still runs on schedule
    quiet({"step": 1})
    assert len(calls) == 5


def test_without_a_watch_the_progress_callback_is_returned_as_it_is():
    assert watched(print, None, 4) is print and watched(None, None, 4) is None


@pytest.mark.parametrize("every", [-1, 1.5, True, "2", None])
def test_watch_every_is_zero_or_a_positive_whole_number(every):
    with pytest.raises(BadInput, match="--watch-every must be 0 .off. or a positive whole number"):
        check_every(every)
    check_every(0)
    check_every(7)


def test_the_watch_judges_the_images_the_card_generates_with_each_judge_and_fid_by_the_first(examples, tmp_path):
    """Accuracy under each judge of the class prompts × seeds as `generate` makes them with the watched loop's
    settings, FID under the first judge against the test images; fewer than two test images is refused."""
    # the platform `generate` detects: on another tier the images differ in their last bits, and FID over six images
    # magnifies that past any tolerance meant for the same computation
    platform, data = Platform.detect("cpu"), str(write_idx_folder(tmp_path / "idx", train=4, test=6))
    card, judges = load_card(examples / "tiny-base"), [examples / "tiny-judge", REPO / "cards" / "fashion-classifier"]
    module = ModelInstance(card, platform).component("transformer")
    loop = {"steps": 2, "guidance": 2.0}

    def watch(per_class, folder, judged=judges):
        return Watch(card, "transformer", module, TextFeatureCache(disk=False), loop, [str(j) for j in judged],
                     platform, "float32", per_class=per_class, data=folder)

    watching = watch(2, data)
    started = time.perf_counter()
    got = watching()
    elapsed = time.perf_counter() - started
    assert 0 < watching.seconds <= elapsed, "the time spent watching, which rl_efficiency.py leaves out of training's"
    watching()
    assert watching.seconds <= time.perf_counter() - started, "added up over the calls"
    report = LoadedCard(card, device="cpu").generate([class_prompt(c) for c in range(len(CLASS_NAMES))], num=2,
                                                     out=None, **loop)
    images = np.stack([image.pixels for image in report.images])
    labels = np.repeat(np.arange(len(CLASS_NAMES)), 2)
    first, second = (FashionJudge(ModelInstance(load_card(j), platform)) for j in judges)
    assert got == pytest.approx({
        "watch_accuracy": (first.probabilities(images).argmax(1) == labels).mean(),
        "watch_accuracy_fashion-classifier": (second.probabilities(images).argmax(1) == labels).mean(),
        "watch_fid": frechet_distance(first.features(images), first.features(load_split("test", data).images))})
    with pytest.raises(BadInput, match="there is 1; give a data folder with more"):
        watch(1, str(write_idx_folder(tmp_path / "one", train=4, test=1)))
    watch(1, str(write_idx_folder(tmp_path / "two", train=4, test=2)), judges[:1])  # two are enough
    # a judge named twice, by its folder and by its manifest, judges once: no second column of the same numbers
    twice = watch(2, data, [judges[0], judges[0] / "card.yaml"])
    assert len(twice.judges) == 1 and twice() == {k: v for k, v in got.items() if "fashion-classifier" not in k}
    # rl's and distill's watch, at its default: the class prompts × seeds 0…49 (the README's 50 seeds each)
    default = Watch(card, "transformer", module, TextFeatureCache(disk=False), loop, [str(judges[0])], platform,
                    "float32", data=data)
    assert [(r.prompt, r.seed) for r in default.requests] == [(class_prompt(c), i) for c in range(len(CLASS_NAMES))
                                                              for i in range(50)]
    assert np.array_equal(default.labels, np.repeat(np.arange(len(CLASS_NAMES)), 50))
