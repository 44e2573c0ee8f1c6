"""`cardtool parity` passes every cell on this machine and has teeth: wrong kernels fail, named."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from cardtool.backends.builtin import OPS
from cardtool.backends.component_parity import component_rows
from cardtool.backends.parity import compare_arrays, run_parity
from cardtool.backends.platform import Platform, cpu_tier
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.cli import app

HERE = Platform("cpu", cpu_tier()[0])


def test_every_torch_cell_passes_at_float64_float32_bfloat16():
    rows = run_parity(HERE)
    generic = {(r.cell, r.dtype) for r in rows if "/cpu/generic/" in r.cell}
    assert generic == {(f"{op}/cpu/generic/default", d) for op in OPS for d in ("float64", "float32", "bfloat16")}
    failed = [(r.cell, r.dtype, r.max_abs_err, r.error) for r in rows if not r.passed]
    assert not failed, failed
    assert all(len(r.shapes) >= 1 for r in rows)
    # the errors reported are the measured ones: float64 at its rounding, not a starting value
    assert all(0 <= r.max_abs_err < 1e-9 for r in rows if r.dtype == "float64"), rows


@pytest.mark.skipif(HERE.arch not in ("zen5", "zen4", "avx512_bf16", "avx2"),
                    reason="the bf16 variants live on the CPU tiers")
def test_bf16_variants_are_held_to_bf16_tolerances_against_float32():
    """This machine's tier: avx512_bf16 computes in bf16 (zen4 and zen5 too, with their own attention and linear), avx2
    emulates it in float32 (and an avx512_bf16 machine may run the avx2 cells too, further down its chain)."""
    from cardtool.backends.builtin import BF16_OPS, ZEN4_OPS

    bf16_tier = "avx2" if HERE.arch == "avx2" else "avx512_bf16"
    rows = {r.cell: r for r in run_parity(HERE) if r.cell.endswith(f"/{bf16_tier}/bf16") or
            (HERE.arch in ("zen4", "zen5") and r.cell.endswith("/zen4/bf16"))}
    lowered = ("attention", "lora_bgmv", "gelu_tanh", "linear", "modulated_layer_norm")
    expected = {f"{op}/cpu/{bf16_tier}/bf16" for op in BF16_OPS}
    if HERE.arch in ("zen4", "zen5"):
        expected |= {f"{op}/cpu/zen4/bf16" for op in ZEN4_OPS}
    assert set(rows) == expected and set(BF16_OPS) == set(lowered + ("rms_norm",))
    for row in rows.values():
        assert row.passed and row.dtype == "float32" and row.against.endswith("in float32") and row.atol >= 1e-2
    for op in lowered:
        assert rows[f"{op}/cpu/{bf16_tier}/bf16"].max_abs_err > 1e-4, "bf16 accuracy is really lower precision"
    assert rows[f"rms_norm/cpu/{bf16_tier}/bf16"].max_abs_err == 0, "computed and handed on in float32"
    if HERE.arch in ("zen4", "zen5"):
        assert rows["linear/cpu/zen4/bf16"].max_abs_err > 1e-4, "a bfloat16 product"
        assert rows["attention/cpu/zen4/bf16"].max_abs_err < 1e-5, "short sequences written out in float32"


def test_the_avx2_bf16_emulation_rounds_as_a_bf16_product_does():
    """Products of bf16-rounded operands summed in float32, rounded once: what a bf16 GEMM gives, up to the order
    of the float32 sums."""
    import torch

    from cardtool.backends import cpu_bf16_emulated

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 7, 32), torch.randn(24, 32).bfloat16(), torch.randn(24).bfloat16()
    y = cpu_bf16_emulated.linear(x, w, b)
    exact = x.bfloat16().double() @ w.double().T + b.double()
    half_step = 2.0 ** -8  # bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most this
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= half_step * exact.abs() + 1e-5).all()
    gelu = cpu_bf16_emulated.linear(x, w, b, "gelu_tanh")
    expected = torch.nn.functional.gelu(exact, approximate="tanh")
    assert ((gelu.double() - expected).abs() <= half_step * expected.abs() + 5e-4).all()  # erf form: ≤ 4.7e-4 off


def test_the_avx2_bf16_emulation_of_lora_rounds_once_also_under_the_samplers_autocast():
    """A mixed-adapter delta from bf16-rounded operands, summed in float32 and rounded once to bfloat16 — also when
    called, as a bfloat16 run calls it, under the precision's autocast (which would compute the down-projection in
    bf16 and round it a second time)."""
    import torch

    from cardtool.backends import cpu_bf16_emulated

    torch.manual_seed(0)
    x, a, b = torch.randn(2, 5, 32), torch.randn(3, 4, 32), torch.randn(3, 24, 4)
    scales, index = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([2, 0])
    r = [t.bfloat16().double() for t in (x, a, b, scales)]
    exact = torch.stack([(r[0][i] @ r[1][k].T) @ (r[2][k] * r[3][k]).T for i, k in enumerate(index.tolist())])
    half_step = 2.0 ** -8
    for autocast in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            delta = cpu_bf16_emulated.lora_bgmv(x, torch.zeros(2, 5, 24).bfloat16(), a, b, scales, index)
        assert delta.dtype == torch.bfloat16
        assert ((delta.double() - exact).abs() <= half_step * exact.abs() + 1e-5).all(), autocast


def test_numpy_platform_has_nothing_to_compare():
    assert run_parity(Platform("numpy", "generic")) == []


@pytest.mark.parametrize(("op", "target"), [("cfg_combine", "wrong_kernels:cfg_combine_sign_flipped"),
                                            ("attention", "wrong_kernels:attention_drops_mask"),
                                            ("attention", "wrong_kernels:attention_nan_for_empty_rows"),
                                            ("rms_norm", "wrong_kernels:rms_norm_eps_1e3")])
def test_a_wrong_kernel_fails_parity_naming_its_cell(kernels, monkeypatch, op, target):
    kernels.register(op, "cpu", "avx2", "default", target=target, requires=("torch",))
    monkeypatch.setenv("CARDTOOL_ARCH", "avx2")
    result = CliRunner().invoke(app, ["parity", "--device", "cpu", "--op", op, "--json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    verdicts = {(r["cell"], r["dtype"]): r["passed"] for r in report["rows"]}
    wrong = f"{op}/cpu/avx2/default"
    assert not verdicts[(wrong, "float64")] and not verdicts[(wrong, "float32")]
    assert all(ok for (cell, _), ok in verdicts.items() if cell != wrong), "the correct cells still pass"
    table = CliRunner().invoke(app, ["parity", "--device", "cpu", "--op", op], env={"COLUMNS": "200"})  # no elision
    assert table.exit_code == 1 and "cpu/avx2/default" in table.stdout and "FAIL" in table.stdout
    failed = sum(not r["passed"] for r in report["rows"])
    assert f"\n{len(report['rows']) - failed} passed, {failed} failed\n" in table.stdout
    shapes = next(r["shapes"] for r in report["rows"] if r["shapes"])  # the cases each op ran, as typed, brackets kept
    assert f"\n  {op}: {'; '.join(shapes)}\n" in table.stdout


def test_a_plugins_numpy_cell_is_held_to_the_reference_with_its_masks_as_given(kernels):
    """Not a reference itself (say a numba kernel on the numpy device): compared like any other, at each precision
    it declares, on numpy arrays — the right one passes, the one that drops the mask fails."""
    kernels.register("attention", "numpy", "generic", "plugin", target="wrong_kernels:numpy_attention",
                     dtypes=("float32", "float16"))
    kernels.register("attention", "numpy", "generic", "careless", target="wrong_kernels:numpy_attention_drops_mask")
    rows = {(r.cell, r.dtype): r for r in run_parity(Platform("numpy", "generic"), "attention")}
    plugin, careless = "attention/numpy/generic/plugin", "attention/numpy/generic/careless"
    assert {key: row.passed for key, row in rows.items()} == {
        (plugin, "float32"): True, (plugin, "float16"): True, (careless, "float64"): False,
        (careless, "float32"): False}, {k: r.error for k, r in rows.items()}  # no bfloat16 row: numpy has none
    assert rows[("attention/numpy/generic/plugin", "float32")].max_abs_err > 0, "float32 against float64, measured"


def test_a_crashing_kernel_is_a_failed_row_not_a_crash(kernels, monkeypatch):
    kernels.register("rms_norm", "cpu", "avx2", "default", target="wrong_kernels:no_such_function")
    rows = run_parity(Platform("cpu", "avx2"), "rms_norm")
    crashed = [r for r in rows if r.cell == "rms_norm/cpu/avx2/default"]
    assert crashed and all(not r.passed and "AttributeError" in r.error for r in crashed)


def test_parity_cli_passes_here_and_rejects_unknown_ops():
    result = CliRunner().invoke(app, ["parity", "--json"])
    assert result.exit_code == 0, result.stdout[-2000:]
    assert json.loads(result.stdout)["ok"]
    assert {row["source"] for row in json.loads(result.stdout)["rows"]} == {"builtin"}
    assert CliRunner().invoke(app, ["parity", "--op", "nope"]).exit_code == 2


def test_an_op_only_a_plugin_registers_is_known_to_parity_and_fails_for_want_of_a_reference(kernels):
    kernels.register("fancy_norm", "cpu", "generic", "default", target="wrong_kernels:rms_norm_eps_1e3")
    result = CliRunner().invoke(app, ["parity", "--op", "fancy_norm", "--json"])
    assert result.exit_code == 1, result.output  # a failed check, not an unknown op (2)
    rows = {r["dtype"]: r for r in json.loads(result.stdout)["rows"]}
    assert not any(r["passed"] for r in rows.values()) and set(rows) == {"float64", "float32", "bfloat16"}
    assert "nothing can run kernel 'fancy_norm' (variant default) on numpy/generic" in rows["float32"]["error"]
    kernels.register("fancy_norm", "numpy", "generic", "default", target="wrong_kernels:numpy_attention",
                     reference=True)  # a reference, and still no inputs to run the two on: said how to give them
    errors = {r.error for r in run_parity(Platform("cpu", "generic"), "fancy_norm")}
    assert errors == {"KeyError: \"no parity inputs for op 'fancy_norm': the plugin that adds it registers none "
                      "(kernels.register_inputs)\""}, errors


def test_bf16_attention_keeps_short_key_sequences_in_float32_even_under_autocast():
    import torch

    from cardtool.backends import cpu_bf16, torch_ops

    torch.manual_seed(0)
    q = torch.randn(2, 2, 8, 16)
    for keys, exact in ((16, True), (cpu_bf16.SHORT_KEYS, False)):
        k, v = torch.randn(2, 2, keys, 16), torch.randn(2, 2, keys, 16)
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = cpu_bf16.attention(q, k, v)
        expected = torch_ops.attention(q, k, v)
        assert out.dtype == torch.float32
        assert torch.equal(out, expected) == exact, keys
        assert (out - expected).abs().max() < 2e-2


@pytest.mark.parametrize(("actual", "expected", "passed"), [
    ([1.0, np.inf], [1.0, np.inf], True),
    ([1.0, np.nan], [1.0, np.nan], False),  # no number to compare
    ([1.0, -np.inf], [1.0, np.inf], False),  # an overflow of the other sign
    ([1.0, np.nan], [1.0, np.inf], False),
    ([np.inf, 1.0], [1.0, np.inf], False),
    ([1.0, 2.0], [1.0, 2.0 + 1e-3], False),
    ([1.0, 2.0], [1.0, 2.0 + 1e-7], True),
])
def test_values_that_are_not_finite_match_only_themselves(actual, expected, passed):
    """The oracle's comparison: a kernel giving −inf where the reference gives +inf, or NaN for inf, fails."""
    abs_err, rel_err, ok = compare_arrays(np.array(actual), np.array(expected), 1e-6, 1e-6)
    assert ok is passed and (abs_err == rel_err == np.inf) is (not np.isfinite(actual + expected).all() and not passed)


def test_arrays_of_other_shapes_never_match():
    assert compare_arrays(np.zeros(3), np.zeros((1, 3)), 1.0, 1.0) == (np.inf, np.inf, False)


SMALL_DIT = {"dim": 16, "depth": 1, "heads": 2, "ffn_dim": 16, "in_channels": 4, "out_channels": 4, "text_dim": 8,
             "freq_dim": 8}


@pytest.mark.parametrize("patch", [[1, 2, 2], [1, 3, 3], [1, 16, 16], [1, 1, 8]])
def test_a_dit_of_any_valid_patch_is_compared_with_numpy(tmp_path, patch):
    """`parity --card` fed every DiT 8 × 8 latents, which a patch of 3 or 16 does not tile: a valid card failed."""
    config = {**SMALL_DIT, "patch": patch}
    rng = np.random.default_rng(0)
    save_file({k: (rng.standard_normal(s) * 0.1).astype(np.float32)
               for k, s in WanDiTConfig(**config).tensors().items()}, tmp_path / "dit.safetensors")
    rows = component_rows("transformer", "wan-dit", config, tmp_path / "dit.safetensors", Platform("cpu", "generic"))
    assert [(r.dtype, r.passed, r.error) for r in rows] == [("float64", True, ""), ("float32", True, "")]
    assert 0 < rows[0].max_abs_err < 1e-9 and rows[0].shapes[0].startswith("2x4x1x")


def test_a_component_that_cannot_run_is_a_failed_row_and_one_without_a_numpy_forward_has_none(tmp_path, kernels):
    config = SMALL_DIT
    save_file({"x": np.zeros(1, np.float32)}, tmp_path / "other.safetensors")  # not this DiT's tensors
    rows = component_rows("transformer", "wan-dit", config, tmp_path / "other.safetensors", Platform("cpu", "generic"))
    assert [r.passed for r in rows] == [False, False] and all(r.error for r in rows), rows
    rows = component_rows("text", "hf-encoder", {}, None, Platform("cpu", "generic"))  # no source folder
    assert [r.passed for r in rows] == [False, False] and all("needs a `source` folder" in r.error for r in rows)
    from cardtool.backends import registry  # the fixture restores it after this torch-only implementation

    registry.COMPONENTS.register("torch-only", "cpu", "default", target="cardtool.backends.builders:conv_vae_torch",
                                 kind="vae")
    assert component_rows("vae", "torch-only", {}, tmp_path / "other.safetensors", Platform("cpu", "generic")) == []
    assert component_rows("transformer", "wan-dit", config, tmp_path / "other.safetensors",
                          Platform("numpy", "generic")) == [], "numpy against itself compares nothing"


def test_a_cell_declaring_only_a_low_precision_is_also_held_to_numpy_in_float32(kernels):
    """A plugin's bfloat16-only kernel: its bfloat16 row compares with itself in float32, so that float32 run must be
    checked against numpy too, or a kernel wrong at every precision would pass."""
    kernels.register("rms_norm", "cpu", "avx2", "default", target="wrong_kernels:rms_norm_eps_1e3",
                     dtypes=("bfloat16",))
    rows = [r for r in run_parity(Platform("cpu", "avx2"), "rms_norm") if r.cell == "rms_norm/cpu/avx2/default"]
    assert [(r.dtype, r.against, r.passed) for r in rows] == [("float32", "numpy float64", False),
                                                            ("bfloat16", "rms_norm in float32", True)]
