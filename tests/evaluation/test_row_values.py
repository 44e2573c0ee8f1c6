"""An eval row's numbers are the metrics of its own images: each recomputed here from the judged hits and features
the row kept (`keep_samples`), so a measurement taken from the wrong images or classes, or rounded otherwise, fails."""

from __future__ import annotations

import numpy as np
import torch
from helpers import EXAMPLE_CARDS, REPO, write_idx_folder

from cardtool.core.data import CLASS_NAMES
from cardtool.core.evaluation.evaluate import evaluate
from cardtool.core.evaluation.metrics import (
    frechet_distance,
    frechet_std,
    kernel_distance,
    precision_recall,
    wilson_interval,
)

torch.set_num_threads(1)


def test_a_rows_numbers_are_the_metrics_of_its_images(tmp_path):
    report = evaluate(str(EXAMPLE_CARDS / "tiny-base"), judge=str(EXAMPLE_CARDS / "tiny-judge"), steps=[2],
                      per_class=3, data=str(write_idx_folder(tmp_path / "idx")), keep_samples=True)
    (row,), ((hits, features),), real = report.rows, report.samples, report.real
    labels = np.repeat(np.arange(10), 3)
    assert hits.shape == (30,) and 0 < hits.sum() < 30, "a mix of right and wrong, so that classes tell apart"
    assert row.class_accuracy == round(float(hits.mean()), 4)
    assert row.accuracy_by_class == {name: round(float(hits[labels == c].mean()), 4)
                                     for c, name in enumerate(CLASS_NAMES)}
    assert row.class_accuracy_ci95 == [round(b, 4) for b in wilson_interval(int(hits.sum()), 30)]
    assert row.fid_fmnist == round(frechet_distance(features, real), 4)
    assert row.fid_fmnist_std == round(frechet_std(features, real), 4)
    kid, kid_std = kernel_distance(features, real)
    assert (row.kid, row.kid_std) == (round(kid, 6), round(kid_std, 6))
    assert [row.manifold_precision, row.manifold_recall] == [round(v, 4) for v in precision_recall(features, real)]
    assert 0 < row.mean_reward < 1 and row.images == 30 and row.model_evaluations == 4, "guided: two a step"
    assert row.images_per_second > 0
    # the hits themselves: the same 30 images made by generate (class prompts × seeds 0…2) and judged here
    from cardtool.core.evaluation.reward import load_reward
    from cardtool.core.prompts import class_prompt
    from cardtool.core.sampling.generate import generate

    made = generate(str(EXAMPLE_CARDS / "tiny-base"), [class_prompt(c) for c in range(10)], num=3, steps=2, out=None)
    images = np.stack([image.pixels for image in made.images])
    judge = load_reward(str(EXAMPLE_CARDS / "tiny-judge"))
    np.testing.assert_array_equal(hits, judge.probabilities(images).argmax(1) == labels)
    assert row.mean_reward == round(float(judge.score(images, [class_prompt(c) for c in labels]).mean()), 4)
    np.testing.assert_allclose(features, judge.features(images), atol=1e-6)
    # the train-vs-test floor: 30 distinct training images (seeded) against the same real test images
    from cardtool.core.data import load_split

    train = load_split("train", str(tmp_path / "idx"))
    floor = judge.features(train.images[np.random.default_rng(0).choice(len(train), 30, replace=False)])
    assert report.floors["train_vs_test"] == round(frechet_distance(floor, real), 4)
    assert report.kid_floors["train_vs_test"] == round(kernel_distance(floor, real)[0], 6)
    assert report.manifold_floors["train_vs_test"] == [round(v, 4) for v in precision_recall(floor, real)]


def test_the_vae_floor_reconstructs_the_images_through_the_cards_vae(fashion_mnist, monkeypatch):
    """fashion-base's VAE (test PSNR 27.19 dB) gives back Fashion-MNIST images to within its PSNR, the background
    near black: the floor is measured on reconstructions, not on what a wrong input range decodes to."""
    from cardtool.backends.platform import Platform
    from cardtool.core.cards import discovery
    from cardtool.core.cards.loader import load_card
    from cardtool.core.data import load_split
    from cardtool.core.evaluation.evaluate import _reconstruct
    from cardtool.core.sampling.instance import ModelInstance

    monkeypatch.setattr(discovery, "builtin_dir", lambda: REPO / "cards")
    images = load_split("test").images[:64]
    instance = ModelInstance(load_card("fashion-base"), Platform.detect("cpu"), "float32")
    made = _reconstruct(instance, "vae", images)
    assert made.dtype == np.uint8 and made.shape == images.shape
    mse = float(((made.astype(np.float64) - images) ** 2).mean())
    assert 10 * np.log10(255**2 / mse) >= 25 and (made == 0).any() and (made <= 4).mean() >= 0.4


def test_the_judge_reads_images_in_the_range_it_was_trained_on(fashion_mnist, monkeypatch):
    """fashion-classifier (test accuracy 0.9283) tells 256 Fashion-MNIST test images' classes and scores each image
    high for its class's prompt: pixels reach it as they did in training, not shifted or scaled; no images, no
    scores (of the right shapes)."""
    from cardtool.core.cards import discovery
    from cardtool.core.data import load_split
    from cardtool.core.evaluation.reward import load_reward
    from cardtool.core.prompts import class_prompt

    monkeypatch.setattr(discovery, "builtin_dir", lambda: REPO / "cards")
    test = load_split("test")
    images, labels = test.images[:256], test.labels[:256]
    judge = load_reward("fashion-classifier")
    assert (judge.probabilities(images).argmax(1) == labels).mean() >= 0.93  # 0.945 measured; 0.91 shifted by −1
    assert judge.score(images, [class_prompt(int(label)) for label in labels]).mean() >= 0.89  # 0.907 measured
    none = np.zeros((0, 28, 28), np.uint8)
    assert judge.probabilities(none).shape == (0, 10) and judge.features(none).shape == (0, 256)
    assert judge.score(none, []).shape == (0,)


def test_the_judge_on_numpy_is_its_reference_forward_giving_torchs_numbers(fashion_mnist, monkeypatch):
    """On the numpy platform the judge runs its classifier's numpy forward (float32, as on every device): the same
    classes, probabilities and FID features as torch's within float32 rounding, and none for no images."""
    from cardtool.backends.numpy_fashion_cnn import NumpyFashionCNN
    from cardtool.backends.platform import Platform
    from cardtool.core.cards import discovery
    from cardtool.core.data import load_split
    from cardtool.core.evaluation.reward import load_reward

    monkeypatch.setattr(discovery, "builtin_dir", lambda: REPO / "cards")
    test = load_split("test")
    images = test.images[:64]
    judges = {device: load_reward("fashion-classifier", Platform(device, "generic")) for device in ("cpu", "numpy")}
    assert isinstance(judges["numpy"]._model(), NumpyFashionCNN)
    (torch_features, torch_probs), (numpy_features, numpy_probs) = (judges[d].judged(images) for d in judges)
    assert numpy_features.dtype == numpy_probs.dtype == np.float32
    assert np.abs(numpy_probs - torch_probs).max() < 1e-5 and (numpy_probs.argmax(1) == test.labels[:64]).mean() > 0.9
    assert np.abs(numpy_features - torch_features).max() < 1e-4 * np.abs(torch_features).max()
    assert np.array_equal(judges["numpy"].probabilities(images), numpy_probs)
    assert judges["numpy"].features(np.zeros((0, 28, 28), np.uint8)).shape == (0, 256)


def test_an_eval_on_numpy_gives_torchs_row(tmp_path):
    """The whole eval on the reference rung — sampling, the judge, the FID reference and the VAE floor (which encodes
    the test images) — gives the row torch gives, to float32 rounding (numpy reads the prompts torch encoded)."""
    data = str(write_idx_folder(tmp_path / "idx"))
    reports = {device: evaluate(str(EXAMPLE_CARDS / "tiny-base"), judge=str(EXAMPLE_CARDS / "tiny-judge"),
                                steps=[2], per_class=2, data=data, device=device) for device in ("cpu", "numpy")}
    assert reports["numpy"].to_json()["platform"] == "numpy/generic"
    cpu, numpy_ = reports["cpu"].rows[0], reports["numpy"].rows[0]
    assert numpy_.accuracy_by_class == cpu.accuracy_by_class and numpy_.images == cpu.images == 20
    assert abs(numpy_.fid_fmnist - cpu.fid_fmnist) < 1e-3 * max(1.0, cpu.fid_fmnist)
    assert abs(numpy_.mean_reward - cpu.mean_reward) < 1e-4


def test_a_rows_speed_leaves_out_what_the_device_does_once(tmp_path, monkeypatch):
    """The first sampling at a precision pays one-time costs (on an H200 1.7 s for bfloat16, as long as a 1,000-image
    row's whole work): the row samples one request untimed first, so images/s is the steady rate. A clock that moves
    only while sampling: 100 s for the first call, 1 s for each later one."""
    from cardtool.core.evaluation import evaluate as module

    clock, calls = [0.0], []

    def timed_sample(*args, **kwargs):
        calls.append(len(args[1]))
        clock[0] += 100.0 if len(calls) == 1 else 1.0
        return sample(*args, **kwargs)

    sample = module.sample
    monkeypatch.setattr(module, "sample", timed_sample)
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock[0])
    report = evaluate(str(EXAMPLE_CARDS / "tiny-base"), judge=str(EXAMPLE_CARDS / "tiny-judge"), steps=[2],
                      per_class=1, data=str(write_idx_folder(tmp_path / "idx")))
    assert calls == [1, 10] and report.rows[0].images_per_second == 10.0


def test_samples_are_kept_only_when_asked_and_a_resumed_row_reaches_on_row(tmp_path):
    card, report = str(EXAMPLE_CARDS / "tiny-base"), tmp_path / "report.json"
    common = {"judge": str(EXAMPLE_CARDS / "tiny-judge"), "steps": [1], "per_class": 1,
              "data": str(write_idx_folder(tmp_path / "idx"))}
    plain = evaluate(card, **common, out=report)
    assert plain.samples == [] and plain.real is None, "one precision, not asked: nothing held"
    paired = evaluate(card, **common, precision=["float32", "bfloat16"])
    assert len(paired.precision_differences) == 1 and paired.samples == [] and paired.real is None, \
        "kept to pair the precisions, then dropped"
    seen = []
    again = evaluate(card, **common, out=report, resume=True, on_row=seen.append)
    assert again.kept_rows == 1 and seen == again.rows == plain.rows
