"""NaN or inf in weights never becomes a PNG: `cards validate --checksums` (which reads every byte) refuses weights
holding one, and so does serving a LoRA holding one (exit 1); a model that samples one makes `generate` fail
with the images named and nothing written (exit 1), makes an eval row null while the other rows are still measured,
and stops an RL run as diverged."""

from __future__ import annotations

import json
import math

import pytest
from helpers import EXAMPLE_CARDS, write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.weight_files import sha256_file

OVERFLOWING = 3e38  # finite weights (validation passes them) whose velocities overflow float32 on the way


def _poison(card, weights: str, key: str, value: float = math.nan) -> None:
    """Set one tensor of `card`/`weights` to `value` and update the sha256 the manifest pins."""
    import torch
    from safetensors.torch import load_file, save_file

    path = card / weights
    old = sha256_file(path)
    tensors = load_file(str(path))
    tensors[key] = torch.full_like(tensors[key], value)
    save_file(tensors, str(path))
    manifest = card / "card.yaml"
    manifest.write_text(manifest.read_text().replace(old, sha256_file(path)))


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_non_finite_values_are_found_in_every_float_dtype(tmp_path, dtype):
    import torch
    from safetensors.torch import save_file

    from cardtool.core.cards.weight_files import non_finite_tensors

    dt = getattr(torch, dtype)
    tensors = {"fine": torch.linspace(-6e4, 6e4, 101).to(dt), "nan": torch.zeros(9, dtype=dt),
               "inf": torch.zeros(9, dtype=dt), "minus_inf": torch.zeros(3, 3, dtype=dt), "ints": torch.arange(5)}
    tensors["nan"][4], tensors["inf"][8], tensors["minus_inf"][2, 2] = math.nan, math.inf, -math.inf
    save_file(tensors, str(tmp_path / "w.safetensors"))
    assert sorted(non_finite_tensors(tmp_path / "w.safetensors")) == ["inf", "minus_inf", "nan"]


def test_validation_with_checksums_refuses_weights_holding_nan(examples):
    _poison(examples / "tiny-base", "transformer.safetensors", "proj_out.bias")
    assert CliRunner().invoke(app, ["cards", "validate", str(examples / "tiny-base")]).exit_code == 0  # headers only
    result = CliRunner().invoke(app, ["cards", "validate", "--checksums", str(examples / "tiny-base"), "--json"])
    assert result.exit_code == 1, result.output
    problem = json.loads(result.stdout)["results"][0]["problems"][0]
    assert problem["field"] == "components.transformer.weights" and "holds NaN or inf in proj_out.bias" in \
        problem["message"] and problem["line"] > 1


def test_a_lora_holding_nan_is_refused_when_it_loads(examples, tmp_path):
    _poison(examples / "tiny-base", "adapters/invert.safetensors", "blocks.0.attn1.to_q.lora_A.weight")
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2",
                                      "--adapter", "invert", "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output  # a used adapter's file is verified in full, located in the card
    assert "card.yaml:35:14: adapters.invert.weights" in result.output
    assert "holds NaN or inf in blocks.0.attn1.to_q.lora_A.weight" in result.output
    plain = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2",
                                     "--out", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output  # the base itself is fine


def test_a_lora_scale_that_overflows_is_caught_not_dropped_by_the_attention(examples, tmp_path):
    """tiny-base's LoRA touches only a query projection: at 3e38 (float32 holds it) its rows overflow to NaN, which
    the written-out attention used to zero with the rows that attend to nothing, and the image came out finite."""
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2",
                                      "--adapter", "invert=3e38", "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 1, result.output
    assert "made NaN or inf for 1 of 1 images" in json.loads(result.stdout)["error"]["message"]


def test_generate_names_nan_images_and_writes_none(examples, tmp_path):
    _poison(examples / "tiny-base", "transformer.safetensors", "proj_out.bias", OVERFLOWING)
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "-n", "2", "--steps",
                                      "2", "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed"
    assert "made NaN or inf for 2 of 2 images" in error["message"] and "'a bag' seed 1" in error["message"]
    assert error["message"].endswith(": check its weights or the settings (guidance, shift)")  # float32 is no cure
    assert not list((tmp_path / "out").glob("*.png"))
    half = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2",
                                    "--precision", "bfloat16", "--out", str(tmp_path / "out"), "--json"])
    assert half.exit_code == 1, half.output
    assert json.loads(half.stdout)["error"]["message"].endswith(
        ": check its weights, the settings (guidance, shift), or a precision that overflows (try --precision float32)")


def test_an_eval_row_of_nan_images_is_null_and_the_others_are_measured(examples, tmp_path, monkeypatch):
    from cardtool.core.evaluation import evaluate
    from cardtool.core.sampling.denoise import NonFiniteImages

    data = write_idx_folder(tmp_path / "idx")
    args = ["eval", str(examples / "tiny-base"), "--judge", str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1",
            "--steps", "1", "--data", str(data)]
    real_sample = evaluate.sample

    def first_row_overflows(loop, requests, **options):
        if requests[0].steps == 1 and len(requests) > 1:  # the first row's images, not its untimed first request
            raise NonFiniteImages("tiny-base", requests, len(requests))
        return real_sample(loop, requests, **options)

    monkeypatch.setattr(evaluate, "sample", first_row_overflows)
    mixed = CliRunner().invoke(app, [*args, "--steps", "2", "--json"])
    assert mixed.exit_code == 0, mixed.output  # a sweep with a measured row made a result
    rows = json.loads(mixed.stdout)["rows"]
    assert rows[0]["class_accuracy"] is None and rows[1]["class_accuracy"] is not None
    monkeypatch.setattr(evaluate, "sample", real_sample)
    _poison(examples / "tiny-base", "transformer.safetensors", "proj_out.bias", OVERFLOWING)
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output  # no row measured: no result, whatever the report holds
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and error["message"].startswith("no row measured: float32, 1 step,")
    report = error["partial"]
    assert report["rows"][0]["class_accuracy"] is None and report["rows"][0]["fid_fmnist"] is None
    assert any("no measurement" in w and "NaN or inf" in w and "seed 0" in w for w in report["warnings"]), \
        "the images' own error, naming them: not the words for a row another rank broke"
    assert all(math.isfinite(v) for v in report["floors"].values())  # the VAE floor does not use the DiT
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 1 and "nan" in table.output and "no row measured" in table.output


def test_an_rl_run_whose_policy_samples_nan_stops_as_diverged(examples, tmp_path):
    _poison(examples / "tiny-base", "transformer.safetensors", "proj_out.bias", OVERFLOWING)
    settings = ["optim.batch_size=2", "loss.group_size=2", "loss.rollout_steps=2", "optim.steps=1",
                "train.precision=float32"]  # rl's default bfloat16 is refused where the CPU lacks bf16 compute
    result = CliRunner().invoke(app, ["rl", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--no-eval", "--out", str(tmp_path / "o"), "--run-dir", str(tmp_path / "r"),
                                      "--json", *(f"--set={s}" for s in settings)])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed"
    assert "sampled NaN or inf at step 0, before any update; none was written yet" in error["message"]
