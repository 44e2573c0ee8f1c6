"""Best-of-N (`generate --best-of N --reward R`): the image kept is the argmax of the recorded scores, every
candidate reproduces by plain sampling at its seed, and candidate 0 is the plain request."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from helpers import reading_judge, rows_are_independent, write_tensors
from PIL import Image
from typer.testing import CliRunner

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.cli import app
from cardtool.core.evaluation.reward import load_reward
from cardtool.core.sampling.best_of import best_of_n, candidate_seed
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.planning import plan_requests


def pixels(path):
    with Image.open(path) as image:
        return np.asarray(image)


def test_the_kept_image_is_the_argmax_of_the_recorded_scores_and_reproduces_at_its_seed(examples, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "-p", "a dress", "-n", "2",
                                 "--steps", "4", "--best-of", "4", "--reward", str(examples / "tiny-judge"),
                                 "--out", str(tmp_path / "best"), "--json"])
    assert result.exit_code == 0, result.output
    images = json.loads(result.stdout)["images"]
    assert len(images) == 4
    for image in images:
        scores, chosen = image["scores"], int(image["candidate"])
        assert len(scores) == 4 and chosen == int(np.argmax(scores)) and image["reward"] == "tiny-judge"
        assert int(image["seed"]) == candidate_seed(int(image["request_seed"]), chosen)
        again = runner.invoke(app, ["generate", str(examples / "tiny-base"), "-p", image["prompt"], "--seed",
                                    image["seed"], "--steps", "4", "--out", str(tmp_path / "plain.png")])
        assert again.exit_code == 0, again.output
        # alone it runs at another batch size: the same bits where sampling is batch-invariant (C2), else within
        # a grey level where the CPU's kernels round differently per batch size
        difference = np.abs(pixels(tmp_path / "plain.png").astype(int) - pixels(image["path"]).astype(int))
        assert difference.max() <= (0 if rows_are_independent() else 1) and difference.mean() < 0.01


def test_candidates_are_scored_in_one_batch_and_candidate_zero_is_the_plain_request(examples):
    loaded = LoadedCard(str(examples / "tiny-base"))
    requests, _ = plan_requests(loaded.card, ["a bag", "a sneaker"], num=2, steps=3)
    reward = load_reward(str(examples / "tiny-judge"))
    calls = []
    score = reward.score
    reward.score = lambda images, prompts: calls.append(len(images)) or score(images, prompts)
    picked = best_of_n(loaded.loop(), reward, requests, 3)
    assert calls == [12], "one reward call for every candidate of every request"
    plain = best_of_n(loaded.loop(), reward, requests, 1)
    assert [r.seed for r in plain.requests] == [r.seed for r in requests] and plain.chosen == [0] * 4
    for k, row in enumerate(picked.scores):
        assert row[0] == pytest.approx(plain.scores[k][0], abs=1e-6)  # candidate 0 is the plain sample
        assert row[picked.chosen[k]] == max(row) >= plain.scores[k][0] - 1e-6
    assert len({candidate_seed(7, i) for i in range(100)}) == 100 and candidate_seed(7, 0) == 7
    derived = [candidate_seed(7, i) for i in range(1, 200)]  # 63-bit seeds: within a seed's range, and using it
    assert max(derived) < 2**63 and sum(seed >= 2**62 for seed in derived) > 50


def test_progress_over_waves_of_candidates_counts_every_candidates_steps_once(examples, tmp_path):
    """Two prompts × 3 candidates × 2 steps in waves of one request (max_batch 3): 12 steps, counted up in order."""
    seen = []
    LoadedCard(str(examples / "tiny-base")).generate(["a bag", "a coat"], steps=2, best_of=3, max_batch=3,
                                                     reward=str(examples / "tiny-judge"), out=None,
                                                     on_step=lambda done, total: seen.append((done, total)))
    assert {total for _, total in seen} == {12} and seen[-1][0] == 12
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[0][0] > 0


@pytest.mark.parametrize("args, message", [
    (["--best-of", "3"], "needs --reward"),
    (["--best-of", "0", "--reward", "REWARD"], "--best-of must be at least 1"),
    (["--best-of", "1025", "--reward", "REWARD"], "--best-of must be at most 1024 candidates a request, got 1025"),
    (["--best-of", "2", "--reward", "BASE"], "is not a reward"),
    (["--best-of", "2", "--reward", "FIVE"], "not a Fashion-MNIST judge: its classifier tells 5 classes, not the 10"),
])
def test_bad_best_of_requests_are_clear_errors(examples, tmp_path, args, message):
    if "FIVE" in args:  # a classifier of 5 classes: an IndexError scoring a prompt of class 8 ('a bag')
        five = shutil.copytree(examples / "tiny-judge", tmp_path / "five")
        text = (five / "card.yaml").read_text().replace("features: 16}", "features: 16, classes: 5}")
        (five / "card.yaml").write_text(re.sub(r"\n\s*sha256: \w+", "", text))
        write_tensors(five / "classifier.safetensors", FashionCNNConfig(width=8, features=16, classes=5).tensors())
    names = {"REWARD": examples / "tiny-judge", "BASE": examples / "tiny-base", "FIVE": tmp_path / "five"}
    args = [str(names.get(a, a)) for a in args]
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2",
                                      "--out", str(tmp_path / "x"), "--json", *args])
    assert result.exit_code == 2 and message in json.loads(result.stdout)["error"]["message"]
    assert not (tmp_path / "x").exists()


def test_a_candidate_sampled_as_nan_is_never_kept_and_a_request_of_only_such_fails(examples, monkeypatch, tmp_path):
    from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages

    loaded = LoadedCard(str(examples / "tiny-base"))
    requests, _ = plan_requests(loaded.card, ["a bag", "a sneaker"], steps=3)
    reward = load_reward(str(examples / "tiny-judge"))
    clean = best_of_n(loaded.loop(), reward, requests, 3)
    decode, broken = DenoiseLoop.decode, set()

    def with_broken(self, states):  # as if these candidates (request k's candidate c: row 3k + c) overflowed
        images, finite = decode(self, states)
        finite[sorted(broken)] = False
        return images, finite

    monkeypatch.setattr(DenoiseLoop, "decode", with_broken)
    broken.update(3 * k + c for k, c in enumerate(clean.chosen))  # each request's winner
    picked = best_of_n(loaded.loop(), reward, requests, 3)
    for k, row in enumerate(picked.scores):
        assert row[clean.chosen[k]] is None and picked.chosen[k] != clean.chosen[k]
        assert row[picked.chosen[k]] == max(s for s in row if s is not None)
    assert json.loads(picked.metadata()[0]["scores"])[clean.chosen[0]] is None
    broken.update({3, 4, 5})  # every candidate of the second request
    lost = best_of_n(loaded.loop(), reward, requests, 3)
    assert lost.finite.tolist() == [True, False] and lost.scores[1] == [None] * 3
    with pytest.raises(NonFiniteImages, match="made NaN or inf for 1 of 2 images \\('a sneaker' seed 0\\)"):
        lost.checked("tiny-base")
    with pytest.raises(NonFiniteImages, match=r"1 of 2 images \('a sneaker' seed 0\); the other 1 are written") as info:
        loaded.generate(["a bag", "a sneaker"], steps=3, best_of=3, reward=str(examples / "tiny-judge"),
                        out=tmp_path)
    assert [p.name[:25] for p in tmp_path.glob("*.png")] == ["tiny-base-000-a-bag-seed0"], "the finite one is kept"
    assert [image["path"] for image in info.value.partial["images"]] == [str(p) for p in tmp_path.glob("*.png")]


def test_prompts_naming_no_garment_are_said_with_the_class_the_reward_reads_them_as(examples):
    """Best-of-N keeps the candidate the reward scores highest for the class it reads the prompt as: where the prompt
    names no class word, that is the nearest phrasing's class, which the warnings name before the images are made."""
    card = LoadedCard(examples / "tiny-base")
    report = card.generate(["a camisole", "a bag", "flip-flops", "a camisole"], steps=2, best_of=2,
                           reward=str(reading_judge(examples)), out=None)
    [said] = [w for w in report.warnings if "name no garment" in w]
    assert said == ("2 prompt(s) name no garment, and reward 'tiny-reader' reads them by the nearest phrasing it "
                    "knows: 'a camisole' as coat, 'flip-flops' as sandal; name the garment where that is not the one "
                    "meant")
    named = card.generate(["a bag", "two boots"], steps=2, best_of=2, reward=str(reading_judge(examples)), out=None)
    assert not [w for w in named.warnings if "name no garment" in w]
    plain = card.generate(["a camisole"], steps=2, out=None)
    assert not [w for w in plain.warnings if "name no garment" in w], "no reward reads it"


def test_the_reading_lists_six_prompts_and_counts_the_rest_and_a_reward_that_reads_no_prompts_says_nothing(examples):
    from types import SimpleNamespace

    from cardtool.core.evaluation.reward import free_text_reading

    reader = load_reward(str(reading_judge(examples)))
    said = free_text_reading(reader, [f"a thing number {i}" for i in range(9)] + ["a bag"])
    assert said.startswith("9 prompt(s) name no garment") and said.count(" as ") == 6 and ", and 3 more;" in said
    assert free_text_reading(SimpleNamespace(card_id="other", score=None), ["a thing"]) is None, "not a class judge"
