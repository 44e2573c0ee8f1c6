"""`cardtool eval --expect METRIC>=VALUE`: a CI gate on a card's measurements, checked on every row."""

from __future__ import annotations

import json

import pytest
from helpers import write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.evaluation.expectations import parse_expectation
from cardtool.errors import BadInput


def run_eval(examples, tmp_path, *expect: str, json_: bool = True):
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "1",
            "--steps", "2", "--steps", "3", "--data", str(write_idx_folder(tmp_path / "idx"))]
    return CliRunner().invoke(app, args + [a for e in expect for a in ("--expect", e)] + (["--json"] if json_ else []))


def test_rows_that_meet_every_expectation_exit_0_and_one_that_misses_exits_1_naming_it(examples, tmp_path):
    measured = json.loads(run_eval(examples, tmp_path).stdout)
    assert measured["ok"] is True and measured["expectations"] == []
    for row in measured["rows"]:  # each measurement with its spread
        low, high = row["class_accuracy_ci95"]
        assert 0 <= low <= row["class_accuracy"] <= high <= 1 and high - low > 0.1, "10 images: a wide interval"
        assert row["fid_fmnist_std"] > 0
        assert 0 <= row["manifold_precision"] <= 1 and 0 <= row["manifold_recall"] <= 1
        by_class = row["accuracy_by_class"]
        assert list(by_class)[:2] == ["T-shirt/top", "trouser"] and len(by_class) == 10
        assert sum(by_class.values()) / 10 == pytest.approx(row["class_accuracy"], abs=1e-3), "one image each"
    assert set(measured["manifold_floors"]) == {"train_vs_test", "vae_reconstruction"}
    accuracy = {r["steps"]: r["class_accuracy"] for r in measured["rows"]}
    fid = max(r["fid_fmnist"] for r in measured["rows"])
    met = run_eval(examples, tmp_path, f"fid_fmnist<={fid}", "class_accuracy>=0")
    assert met.exit_code == 0, met.output
    assert json.loads(met.stdout)["ok"] is True
    missed = run_eval(examples, tmp_path, f"fid_fmnist<{fid}", f"class_accuracy>{min(accuracy.values())}",
                      "images_per_second>0")
    assert missed.exit_code == 1, missed.output
    report = json.loads(missed.stdout)
    assert report["ok"] is False and len(report["rows"]) == 2, "the measurements are reported either way"
    checks = {c["expect"]: c for c in report["expectations"]}
    assert not checks[f"fid_fmnist<{fid:.10g}"]["passed"] and checks["images_per_second>0"]["passed"]
    assert checks[f"fid_fmnist<{fid:.10g}"]["failures"][0].startswith(f"fid_fmnist {fid:.6g} at ")
    text = run_eval(examples, tmp_path, f"fid_fmnist<{fid}", json_=False)
    assert text.exit_code == 1 and "expectation missed fid_fmnist" in " ".join(text.stderr.split())


@pytest.mark.parametrize(("text", "message"), [
    ("accuracy>=0.9", "unknown metric 'accuracy'"),
    ("class_accuracy=>0.9", "write METRIC>=VALUE"),
    ("class_accuracy>=nan", "is not a finite number"),
    ("class_accuracy>=high", "is not a finite number"),
    ("fid_fmnist", "write METRIC>=VALUE"),
    ("class_accuracy>=", "write METRIC>=VALUE"),  # not "'=' is not a finite number"
    ("class_accuracy>==0.9", "write METRIC>=VALUE"),
    ("class_accuracy>=0.5,fid_fmnist<=16", "one threshold per --expect; repeat the option"),
    ("class_accuracy>=0,9", "is not a finite number .write a decimal point, not a comma"),
])
def test_an_expectation_that_is_not_one_is_refused(text, message):
    with pytest.raises(BadInput, match=message):
        parse_expectation(text)


def test_a_bad_expectation_is_refused_before_the_eval_runs(examples, tmp_path, monkeypatch):
    from cardtool.core.evaluation import evaluate as evaluating

    monkeypatch.setattr(evaluating, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    result = run_eval(examples, tmp_path, "fid<=16")
    assert result.exit_code == 2 and "unknown metric 'fid'" in json.loads(result.stdout)["error"]["message"]


def test_the_table_for_people_shows_each_rows_numbers_and_the_rows_kept(examples, tmp_path):
    out = tmp_path / "eval.json"
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "1", "--steps",
            "1", "--guidance", "2", "--guidance-interval", "0.2,0.7", "--data", str(write_idx_folder(tmp_path / "idx")),
            "--out", str(out), "--expect", "class_accuracy>=0"]
    first = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
    assert first.exit_code == 0, first.output
    [row] = json.loads(out.read_text())["rows"]
    [line] = [line for line in first.stdout.splitlines() if line.strip().startswith("float32") and "σ" in line]
    low, high = row["class_accuracy_ci95"]
    for cell in ("2 on σ ∈ [0.2, 0.7]", f"{row['class_accuracy']:.4f} ({low:.3f}–{high:.3f})",
                 f"{row['fid_fmnist']:.3f} ± {row['fid_fmnist_std']:.2f}", f"{row['mean_reward']:.4f}",
                 f"{row['manifold_precision']:.3f} / {row['manifold_recall']:.3f}"):
        assert cell in line, (cell, line)
    said = f"precision {row['manifold_precision']:.3f} recall {row['manifold_recall']:.3f}"  # the row's progress line
    assert said in first.stderr
    assert "every row meets class_accuracy>=0" in first.stderr
    floors = json.loads(out.read_text())["floors"]
    assert f"floors: real train vs test FID {floors['train_vs_test']:.3f} / KID×1000" in first.stdout
    weakest = sorted(row["accuracy_by_class"].items(), key=lambda item: item[1])[:3]
    assert "weakest classes " + " · ".join(f"{name} {value:.3f}" for name, value in weakest) in first.stdout
    again = CliRunner().invoke(app, [*args[:-2], "--resume"], env={"COLUMNS": "1000"})  # and no --expect
    assert f"1 of 1 rows kept from {out} (measured before)" in again.stderr and line in again.stdout
    assert "every row meets" not in again.stderr


def test_a_rows_cells_for_what_it_lacks_and_its_guidance_interval():
    from types import SimpleNamespace

    from cardtool.cli.evaluate import _accuracy, _interval, _reward

    def row(guidance, interval, accuracy=None, reward=None):
        return SimpleNamespace(guidance=guidance, guidance_interval=interval, class_accuracy=accuracy,
                               class_accuracy_ci95=None, mean_reward=reward)

    assert [_interval(row(g, i)) for g, i in ((2, (0, 0.4)), (2, (0, 1)), (1, (0.2, 0.4)))] == [" on σ ≤ 0.4", "", ""]
    assert (_accuracy(row(2, (0, 1))), _reward(row(2, (0, 1)))) == ("–", "–")  # captions: no class, no reward
    assert (_accuracy(row(2, (0, 1), float("nan"), float("nan"))), _accuracy(row(2, (0, 1), 0.5))) == ("–", "0.5000")
