"""`cardtool eval A --versus B`: both cards on the same requests, compared image pair by image pair — McNemar's exact
test and paired bootstrap intervals, which see a difference that two independent intervals cannot."""

from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest
from helpers import EXAMPLE_CARDS, write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.evaluation import evaluate as evaluate_module
from cardtool.core.evaluation.metrics import frechet_distance, wilson_interval
from cardtool.core.evaluation.paired import mcnemar_p, paired_differences
from cardtool.core.evaluation.versus import compare
from cardtool.core.interrupt import Interrupted
from cardtool.errors import BadInput, CardValidationError


def test_mcnemar_p_is_the_doubled_binomial_tail_of_the_discordant_pairs():
    assert mcnemar_p(1, 9) == pytest.approx(2 * (1 + 10) / 2 ** 10)
    assert mcnemar_p(9, 1) == mcnemar_p(1, 9), "two-sided"
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(5, 5) == 1.0, "no evidence either way"
    exact = 2 * sum(math.comb(40, i) for i in range(13)) / 2 ** 40
    assert mcnemar_p(12, 28) == pytest.approx(exact, rel=1e-9)
    # 3,000 pairs: 2 ** 3000 overflows a float, the tail is summed in log space
    assert 0 < mcnemar_p(1400, 1600) < 0.001 and mcnemar_p(1490, 1510) > 0.5


def test_paired_intervals_see_a_difference_independent_intervals_cannot():
    """B right on 30 more of 1,000 pairs, wrong on none that A got: the two Wilson intervals overlap, the paired one
    excludes zero and McNemar rejects equality."""
    rng = np.random.default_rng(0)
    hits_a = rng.random(1000) < 0.9
    hits_b = hits_a.copy()
    hits_b[np.flatnonzero(~hits_a)[:30]] = True
    features = rng.standard_normal((1000, 8))
    real = rng.standard_normal((2000, 8))
    low_b, _ = wilson_interval(int(hits_b.sum()), 1000)
    _, high_a = wilson_interval(int(hits_a.sum()), 1000)
    assert low_b < high_a, "separately the two accuracies are not told apart"
    d = paired_differences(hits_a, features, hits_b, features + 0.5, real)
    assert d["accuracy"] == pytest.approx(0.03) and d["only_a"] == 0 and d["only_b"] == 30
    assert 0 < d["accuracy_ci95"][0] <= 0.03 <= d["accuracy_ci95"][1] and d["mcnemar_p"] < 1e-8
    fid = frechet_distance(features + 0.5, real) - frechet_distance(features, real)
    assert d["fid_fmnist"] == pytest.approx(fid, abs=1e-3) and fid > 1
    assert d["fid_fmnist_ci95"][0] > 0 and d["fid_fmnist_std"] > 0
    same = paired_differences(hits_a, features, hits_a, features, real)
    assert same["accuracy"] == same["fid_fmnist"] == 0 and same["mcnemar_p"] == 1
    assert same["accuracy_ci95"] == [0, 0] and same["fid_fmnist_ci95"] == [0, 0], "a card against itself: no noise"


def test_the_paired_bootstrap_draws_the_same_pairs_for_both_sides():
    """Each resample draws n image pairs with replacement and takes B − A on the same draw; written out here."""
    rng = np.random.default_rng(3)
    hits_a, hits_b = rng.random(50) < 0.6, rng.random(50) < 0.7
    a, b, real = rng.standard_normal((50, 3)), rng.standard_normal((50, 3)) + 0.3, rng.standard_normal((300, 3))
    draw, accuracy, fid = np.random.default_rng(0), [], []
    for _ in range(9):
        i = draw.integers(0, 50, 50)
        accuracy.append(hits_b[i].mean() - hits_a[i].mean())
        fid.append(frechet_distance(b[i], real) - frechet_distance(a[i], real))
    d = paired_differences(hits_a, a, hits_b, b, real, resamples=9)
    assert d["accuracy_ci95"] == pytest.approx([round(v, 4) for v in np.percentile(accuracy, [2.5, 97.5])], abs=1e-9)
    assert d["fid_fmnist_ci95"] == pytest.approx([round(v, 4) for v in np.percentile(fid, [2.5, 97.5])], abs=1e-4)
    assert d["fid_fmnist_std"] == pytest.approx(np.std(fid), abs=1e-4)
    unjudged = paired_differences(None, a, None, b, real, resamples=9)  # captions: FID only
    assert set(unjudged) == {"fid_fmnist", "fid_fmnist_ci95", "fid_fmnist_std"}
    assert unjudged["fid_fmnist_ci95"] == d["fid_fmnist_ci95"], "the same draws, with or without hits"


def test_precision_differences_come_from_rank_0_only():
    from cardtool.core.evaluation.evaluate import EvalReport
    from cardtool.core.evaluation.paired import precision_differences

    assert precision_differences(EvalReport("c", "j", "cpu/generic", 1, rank=1, samples=[None])) == []
    assert precision_differences(EvalReport("c", "j", "cpu/generic", 1)) == []


def test_a_row_without_a_measurement_on_either_side_pairs_as_nulls():
    from cardtool.core.evaluation.evaluate import EvalRow
    from cardtool.core.evaluation.paired import difference

    row = EvalRow(2, 4.0, [0.0, 1.0], "float32", 3, 1.0, 5.0, 0.1, 0.01, 0.9, 1.0)
    kept = (np.array([True, False, True]), np.random.default_rng(0).standard_normal((3, 2)))
    real = np.random.default_rng(1).standard_normal((10, 2))
    for a, b in ((None, kept), (kept, None)):  # a row of NaN images kept nothing
        d = difference(row, a, row, b, real)
        assert d.a == d.b == {"steps": 2, "guidance": 4.0, "guidance_interval": [0.0, 1.0], "precision": "float32",
                              "shift": 1.0, "solver": "euler"}
        assert d.accuracy is d.fid_fmnist is d.mcnemar_p is None
    assert difference(row, kept, row, kept, real).accuracy == 0


def run(tmp_path, *args):
    data = write_idx_folder(tmp_path / "idx")
    return CliRunner().invoke(app, ["eval", str(EXAMPLE_CARDS / "tiny-base"), "--judge",
                                    str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "2", "--data", str(data),
                                    *args], env={"COLUMNS": "250"})  # no elision in the tables


def test_versus_measures_both_cards_on_the_same_requests_and_pairs_their_rows(tmp_path):
    result = run(tmp_path, "--steps", "2", "--steps", "3", "--versus", str(EXAMPLE_CARDS / "tiny-distilled"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    versus = report["versus"]
    assert report["card"] == "tiny-base" and versus["card"] == "tiny-distilled" and report["ok"] is True
    assert [r["steps"] for r in report["rows"]] == [r["steps"] for r in versus["rows"]] == [2, 3]
    assert [r["guidance"] for r in versus["rows"]] == [1.0, 1.0], "each card at its own defaults for the rest"
    for a, b, d in zip(report["rows"], versus["rows"], versus["differences"], strict=True):
        assert (d["a"]["steps"], d["b"]["steps"], d["b"]["guidance"]) == (a["steps"], b["steps"], b["guidance"])
        assert d["accuracy"] == pytest.approx(b["class_accuracy"] - a["class_accuracy"], abs=1e-4)
        assert d["fid_fmnist"] == pytest.approx(b["fid_fmnist"] - a["fid_fmnist"], abs=1e-3)
        assert d["fid_fmnist_ci95"][0] <= d["fid_fmnist_ci95"][1] and 0 <= d["mcnemar_p"] <= 1
    alone = json.loads(run(tmp_path, "--steps", "2", "--steps", "3", "--json").stdout)
    assert [r["fid_fmnist"] for r in alone["rows"]] == [r["fid_fmnist"] for r in report["rows"]], \
        "the first card's rows are its own eval's"
    text = run(tmp_path, "--steps", "2", "--versus", str(EXAMPLE_CARDS / "tiny-base"))
    assert text.exit_code == 0 and "B − A: the same prompts and seeds" in text.stdout
    assert "+0.0000 (+0.000…+0.000)" in text.stdout, "a card against itself differs by nothing"


@pytest.mark.parametrize("extra", [["--out", "x.json"], ["--record"], ["--expect", "kid<1"]])
def test_versus_refuses_what_belongs_to_one_card(tmp_path, extra):
    result = run(tmp_path, "--versus", str(EXAMPLE_CARDS / "tiny-distilled"), *extra, "--json")
    assert result.exit_code == 2 and "--versus measures and compares two cards" in result.stdout
    with pytest.raises(BadInput, match="out does not apply"):
        compare("tiny-base", "tiny-base", out="x.json")


def test_what_the_second_card_cannot_do_is_refused_before_the_first_is_measured(tmp_path, monkeypatch):
    """A card B not found, with no loop, of a size the judge does not take or with weights other than its manifest
    declares fails at once, not after A's rows."""
    import shutil

    def never(*args, **kwargs):
        raise AssertionError("the first card was measured before the second was checked")

    monkeypatch.setattr(evaluate_module, "_measure_row", never)
    wide = tmp_path / "wide"
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", wide)
    manifest = wide / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: wide").replace(
        "channels: [8, 16, 32]}", "channels: [8, 16, 32], image_size: 32}"))
    options = {"judge": str(EXAMPLE_CARDS / "tiny-judge"), "per_class": 1, "steps": [2],
               "data": str(write_idx_folder(tmp_path / "idx"))}
    for card_b, message in ((EXAMPLE_CARDS / "nowhere", "nowhere"), (EXAMPLE_CARDS / "tiny-judge", "no 'denoise' loop"),
                            (wide, "32×32")):
        with pytest.raises(BadInput, match=message):
            compare(str(EXAMPLE_CARDS / "tiny-base"), str(card_b), **options)
    damaged = shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "damaged")  # weights not the manifest's
    weights = bytearray((damaged / "transformer.safetensors").read_bytes())
    weights[-100] ^= 0xFF
    (damaged / "transformer.safetensors").write_bytes(bytes(weights))
    with pytest.raises(CardValidationError, match="sha256 of 'transformer.safetensors' is"):
        compare(str(EXAMPLE_CARDS / "tiny-base"), str(damaged), **options)


def test_the_python_api_reports_each_row_with_its_card_and_takes_a_false_resume(tmp_path):
    """compare() as a script calls it: on_row(card, row) for every row of both cards, in order; `resume=False` (what a
    caller passing its own defaults through sends) is no resume; a non-function on_row and a keyword evaluate() does
    not take are refused before any eval."""
    seen = []
    options = {"judge": str(EXAMPLE_CARDS / "tiny-judge"), "per_class": 1, "steps": [2, 3],
               "data": str(write_idx_folder(tmp_path / "idx"))}
    with pytest.raises(BadInput, match="on_row must be a function, got 'print'"):
        compare(str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "nowhere"), on_row="print", **options)
    for wrong in ({"per_clas": 1}, {"card_ref": "tiny-base"}):  # a Python error naming compare, before any eval
        with pytest.raises(TypeError, match=f"compare.. got an unexpected keyword argument '{next(iter(wrong))}'"):
            compare(str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "nowhere"), **options, **wrong)
    result = compare(str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "tiny-distilled"), resume=False,
                     keep_samples=False, on_row=lambda card, row: seen.append((card, row.steps)), **options)
    a, b = str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "tiny-distilled")
    assert seen == [(a, 2), (a, 3), (b, 2), (b, 3)] and len(result.differences) == 2


def test_a_stop_during_the_first_cards_last_row_does_not_start_the_second(tmp_path, monkeypatch, interactive_signals):
    measure = evaluate_module._measure_row
    measured = []

    def measure_then_sigint(report, *args, **kwargs):
        measure(report, *args, **kwargs)
        measured.append(report.card)
        if len(measured) == 1:  # the first card's only row
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(evaluate_module, "_measure_row", measure_then_sigint)
    with pytest.raises(Interrupted, match="tiny-base's rows; .*tiny-distilled was not measured") as stopped:
        compare(str(EXAMPLE_CARDS / "tiny-base"), str(EXAMPLE_CARDS / "tiny-distilled"),
                judge=str(EXAMPLE_CARDS / "tiny-judge"), per_class=1, steps=[2],
                data=str(write_idx_folder(tmp_path / "idx")))
    assert measured == ["tiny-base"] and len(stopped.value.partial["rows"]) == 1


def test_a_stop_during_the_second_card_keeps_both_cards_rows(tmp_path, monkeypatch, interactive_signals):
    measure = evaluate_module._measure_row

    def measure_then_sigint(report, *args, **kwargs):
        measure(report, *args, **kwargs)
        if report.card == "tiny-distilled":  # after the second card's first of two rows
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(evaluate_module, "_measure_row", measure_then_sigint)
    result = run(tmp_path, "--steps", "2", "--steps", "3", "--versus", str(EXAMPLE_CARDS / "tiny-distilled"), "--json")
    assert result.exit_code == 130, result.output
    partial = json.loads(result.stdout)["error"]["partial"]
    assert [r["steps"] for r in partial["rows"]] == [2, 3] and [r["steps"] for r in partial["versus"]["rows"]] == [2]


def test_an_eval_of_several_precisions_pairs_each_with_the_first(tmp_path):
    result = run(tmp_path, "--steps", "2", "--steps", "3", "--precision", "float32", "--precision", "bfloat16",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = {(r["precision"], r["steps"]): r for r in report["rows"]}
    pairs = report["precision_differences"]
    assert [(d["a"]["precision"], d["b"]["precision"], d["b"]["steps"]) for d in pairs] == [
        ("float32", "bfloat16", 2), ("float32", "bfloat16", 3)]
    for d in pairs:
        steps = d["b"]["steps"]
        assert d["fid_fmnist"] == pytest.approx(rows["bfloat16", steps]["fid_fmnist"]
                                                - rows["float32", steps]["fid_fmnist"], abs=1e-3)
    alone = json.loads(run(tmp_path, "--steps", "2", "--json").stdout)
    assert "precision_differences" not in alone, "one precision: nothing to pair"
    text = run(tmp_path, "--steps", "2", "--precision", "float32", "--precision", "bfloat16")
    assert "each precision against the first" in text.stdout
