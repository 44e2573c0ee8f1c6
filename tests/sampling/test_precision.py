"""Precision per request: mixed-precision sampling picks the tier's kernels, stays within the bf16 tolerance of
float32, repeats bit for bit at each precision, and is recorded in the PNG."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import REPO
from typer.testing import CliRunner

from cardtool.backends import cpu_bf16, torch_ops
from cardtool.backends.platform import Platform
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.evaluation.card_parity import generation_rows
from cardtool.core.sampling.generate import LoadedCard, generate
from cardtool.core.sampling.images import read_png_metadata
from cardtool.core.sampling.instance import ModelInstance
from cardtool.errors import BadInput

BF16_CPU = Platform("cpu", "avx512_bf16")  # torch runs bf16 on any CPU, fast only on this tier
FASHION_BASE = REPO / "cards" / "fashion-base"  # trained: its attention matters, unlike tiny-base's


def test_bfloat16_picks_the_tiers_bf16_kernels_over_float32_weights(examples):
    card = load_card(examples / "tiny-base")
    low, full = ModelInstance(card, BF16_CPU, "bfloat16"), ModelInstance(card, BF16_CPU, "float32")
    dit = low.component("transformer")
    assert dit.ops.attention is cpu_bf16.attention and full.component("transformer").ops.attention is \
        torch_ops.attention
    plain = full.component("transformer")
    assert dit.ops.gelu_tanh is cpu_bf16.gelu_tanh and plain.ops.gelu_tanh is torch_ops.gelu_tanh
    # products' weights rounded once, exactly as autocast rounds them on every call; gains and tables stay float32
    assert dit.blocks[0].ffn.net[0].proj.weight.dtype == torch.bfloat16
    assert torch.equal(dit.blocks[0].ffn.net[0].proj.weight, plain.blocks[0].ffn.net[0].proj.weight.bfloat16())
    assert dit.blocks[0].scale_shift_table.dtype == dit.blocks[0].attn1.norm_q.weight.dtype == torch.float32
    assert plain.proj_out.weight.dtype == torch.float32
    generic = ModelInstance(card, Platform("cpu", "generic"), "bfloat16")
    assert generic.component("transformer").ops.attention is torch_ops.attention, "no bf16 cell: the default"
    assert generic.warnings and "no fast bfloat16" in generic.warnings[0]


def test_bf16_generation_is_within_the_bf16_tolerance_of_float32():
    rows = generation_rows(load_card(FASHION_BASE), BF16_CPU)  # measured: 2.1e-2 against a tolerance of 8e-2
    [low] = [r for r in rows if r.dtype == "bfloat16"]
    assert low.passed and low.against == "the same loop in float32"
    assert 1e-5 < low.max_abs_err < low.atol, "bf16 really ran (not float32) and stayed in tolerance"


def test_a_wrong_bf16_kernel_fails_generation_parity(kernels):
    kernels.register("attention", "cpu", "avx512_bf16", "bf16", target="wrong_kernels:attention_ignores_scores",
                     requires=("torch",))
    rows = generation_rows(load_card(FASHION_BASE), BF16_CPU)  # measured: off by 2.9
    assert [(r.dtype, r.passed) for r in rows] == [("float64", True), ("float32", True), ("bfloat16", False)]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_each_precision_repeats_bit_for_bit_and_is_recorded(examples, tmp_path, precision):
    loaded = LoadedCard(load_card(examples / "tiny-base"), device="cpu")
    runs = [loaded.generate(["a coat"], num=2, steps=3, solver="sde", precision=precision, out=tmp_path / name)
            for name in ("a", "b")]
    first, second = ([p.path.read_bytes() for p in r.images] for r in runs)
    assert first == second
    assert {read_png_metadata(p.path)["precision"] for p in runs[0].images} == {precision}


def test_a_loaded_card_serves_several_precisions_as_one_shot_calls_do(examples, tmp_path):
    card = load_card(examples / "tiny-base")
    loaded = LoadedCard(card, device="cpu")
    pixels = {}
    for precision in ("float32", "bfloat16", "float32"):
        report = loaded.generate(["a bag"], steps=3, precision=precision, out=tmp_path / f"loaded-{precision}")
        pixels.setdefault(precision, []).append(report.images[0].path.read_bytes())
        one_shot = generate(card, ["a bag"], device="cpu", steps=3, precision=precision,
                            out=tmp_path / f"one-{precision}")
        assert one_shot.images[0].path.read_bytes() == pixels[precision][-1]
    assert pixels["float32"][0] == pixels["float32"][1]
    assert loaded.loop("float32").instance is not loaded.loop("bfloat16").instance
    latents = {p: loaded.loop(p).instance.arrays.dtype for p in ("float32", "bfloat16")}
    assert latents == {"float32": torch.float32, "bfloat16": torch.float32}, "the state stays float32"


def test_cli_precision_and_refusals(examples, tmp_path, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    result = CliRunner().invoke(app, ["generate", "tiny-base", "-p", "a bag", "--steps", "2", "--precision",
                                      "bfloat16", "--device", "cpu", "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["images"][0]["precision"] == "bfloat16"
    for precision, device, words in (("float8", "cpu", "unknown precision 'float8'"),
                                     ("bfloat16", "numpy", "numpy platform has no bfloat16")):
        result = CliRunner().invoke(app, ["generate", "tiny-base", "-p", "a bag", "--precision", precision,
                                          "--device", device, "--json"])
        assert result.exit_code != 0 and words in json.loads(result.stdout)["error"]["message"]
    with pytest.raises(BadInput, match="numpy platform has no float16"):
        ModelInstance(load_card(examples / "tiny-base"), Platform("numpy", "generic"), "float16")


def test_float16_runs_mixed_on_the_cpu_with_a_warning(examples, tmp_path):
    report = generate(load_card(examples / "tiny-base"), ["a bag"], device="cpu", steps=2, precision="float16",
                      out=tmp_path / "f16.png")
    assert any("float16 on a CPU" in w for w in report.warnings)
    assert read_png_metadata(report.images[0].path)["precision"] == "float16"


@pytest.mark.parametrize(("platform", "precision", "warned"), [
    (Platform("cpu", "avx2"), "bfloat16", "has no fast bfloat16"),
    (Platform("cpu", "avx512_bf16"), "bfloat16", None),
    (Platform("cuda", "sm75"), "bfloat16", "has no fast bfloat16"),
    (Platform("cuda", "sm90"), "bfloat16", None),
    (Platform("cpu", "avx512_bf16"), "float16", "float16 on a CPU is emulated"),
    (Platform("cuda", "sm75"), "float16", None),
    (Platform("cpu", "avx2"), "float32", None),  # a CPU without bf16 or fp16 warns of neither at float32
    (Platform("cpu", "generic"), "float64", None),
    (Platform("numpy", "generic"), "float32", None),
])
def test_a_precision_warns_only_where_it_runs_slowly(platform, precision, warned):
    from cardtool.backends.precision import check_precision

    warnings = check_precision(platform, precision)
    assert (warnings == []) if warned is None else (len(warnings) == 1 and warned in warnings[0]), warnings


def test_only_a_low_precision_on_torch_runs_under_autocast():
    from cardtool.backends.precision import autocast

    cpu = Platform("cpu", "generic")
    for platform, precision in ((cpu, "float32"), (cpu, "float64"), (Platform("numpy", "generic"), "bfloat16")):
        with autocast(platform, precision):
            assert not torch.is_autocast_enabled("cpu"), (platform, precision)
    with autocast(cpu, "bfloat16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("device", ["numpy", "cpu"])
def test_the_loops_arrays_hold_floats_at_the_weights_dtype_and_keep_integers_and_masks(device):
    """The one loop's array namespace: a float becomes the precision's weights dtype (float32 for bfloat16, which
    rounds only products), an integer (a timestep index, a seed) and a boolean (a text mask) keep their kind."""
    import numpy as np

    from cardtool.backends.arrays import arrays_numpy, arrays_torch

    build = arrays_numpy if device == "numpy" else arrays_torch
    arrays = build({}, None, None, Platform(device, "generic"), "float64" if device == "numpy" else "bfloat16")
    floats = arrays.asarray(np.array([0.5, 1.5]))
    ints, mask = arrays.asarray(np.array([3, 4], np.int64)), arrays.asarray(np.array([True, False]))
    assert str(floats.dtype).removeprefix("torch.") == ("float64" if device == "numpy" else "float32")
    assert str(ints.dtype).removeprefix("torch.") == "int64" and str(mask.dtype).removeprefix("torch.") == "bool"
    assert arrays.to_numpy(arrays.cat([floats, floats])).tolist() == [0.5, 1.5, 0.5, 1.5]
    with arrays.inference(), arrays.compute():
        assert not arrays.grad_enabled()
    assert arrays.grad_enabled() is (device != "numpy")
