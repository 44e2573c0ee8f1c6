"""Resolution walks explicit chains to older or portable code only, caches, and explains failures."""

from __future__ import annotations

import pytest

from cardtool.backends import registry
from cardtool.backends.chains import kernel_chain
from cardtool.backends.platform import Platform
from cardtool.backends.registry import KERNELS, NoCellAvailable

SM90, SM80, SM100, SM120 = (Platform("cuda", a) for a in ("sm90", "sm80", "sm100", "sm120"))
AVX2, AVX512, NO_TORCH = Platform("cpu", "avx2"), Platform("cpu", "avx512_bf16"), Platform("numpy", "generic")


def test_chains_are_explicit_and_never_reach_a_newer_arch():
    assert kernel_chain("cuda", "sm90") == [("cuda", "sm90a"), ("cuda", "sm80"), ("cuda", "generic")]
    assert kernel_chain("cuda", "sm120") == [("cuda", "sm120"), ("cuda", "sm80"), ("cuda", "generic")]
    assert ("cuda", "sm90a") not in kernel_chain("cuda", "sm100")
    assert kernel_chain("cuda", "sm80") == [("cuda", "sm80"), ("cuda", "generic")]
    assert kernel_chain("cpu", "avx512_bf16") == [("cpu", "avx512_bf16"), ("cpu", "avx2"), ("cpu", "generic"),
                                                  ("numpy", "generic")]
    assert kernel_chain("cpu", "zen4") == [("cpu", "zen4"), ("cpu", "avx512_bf16"), ("cpu", "avx2"),
                                           ("cpu", "generic"), ("numpy", "generic")]
    assert kernel_chain("cpu", "zen5")[:3] == [("cpu", "zen5"), ("cpu", "zen4"), ("cpu", "avx512_bf16")]
    assert ("cpu", "zen5") not in kernel_chain("cpu", "zen4"), "never the newer core's code"
    assert kernel_chain("cpu", "avx2") == [("cpu", "avx2"), ("cpu", "generic"), ("numpy", "generic")]
    assert kernel_chain("numpy", "generic") == [("numpy", "generic")]
    # an arch cardtool does not know yet gets only portable tiers
    assert kernel_chain("cuda", "sm110") == [("cuda", "sm80"), ("cuda", "generic")]
    assert kernel_chain("cuda", "sm61") == [("cuda", "generic")]
    # CARDTOOL_ARCH as typed: '²' is a digit to str.isdigit and no number to int()
    assert kernel_chain("cuda", "sm²") == [("cuda", "generic")] and not Platform("cuda", "sm²").supports_bf16


@pytest.fixture
def fake_attention(kernels):
    for arch in ("sm90a", "sm80", "sm100"):
        kernels.register("attention", "cuda", arch, "default", target="wrong_kernels:attention_drops_mask")
    kernels.register("attention", "cpu", "avx512_bf16", "default", target="wrong_kernels:attention_drops_mask")
    return kernels


@pytest.mark.parametrize(("platform", "expected"), [
    (SM90, "attention/cuda/sm90a/default"),
    (SM80, "attention/cuda/sm80/default"),
    (SM100, "attention/cuda/sm100/default"),
    (SM120, "attention/cuda/sm80/default"),
    (AVX512, "attention/cpu/avx512_bf16/default"),
    (AVX2, "attention/cpu/generic/default"),
    (NO_TORCH, "attention/numpy/generic/default"),
])
def test_resolution_takes_the_first_runnable_cell_on_the_chain(fake_attention, platform, expected):
    assert fake_attention.resolve("attention", platform)[0].name == expected


def test_sm100_falls_back_to_sm80_not_sm90a(fake_attention):
    fake_attention.unregister("attention", "cuda", "sm100", "default")
    assert fake_attention.resolve("attention", SM100)[0].name == "attention/cuda/sm80/default"


def test_a_cell_that_cannot_run_is_skipped_for_the_next_rung(kernels):
    kernels.register("rms_norm", "cpu", "avx2", "default", target="no_such_module:rms_norm",
                     requires=("no_such_module",))
    cell = kernels.resolve("rms_norm", AVX2)[0]
    assert cell.name == "rms_norm/cpu/generic/default"
    assert kernels.reasons(kernels._cells[("rms_norm", "cpu", "avx2", "default")], AVX2) == [
        "needs no_such_module, which is not installed"]


def test_without_torch_the_torch_cells_give_reasons_and_numpy_serves(kernels, monkeypatch):
    monkeypatch.setattr(registry, "_importable", lambda module: module != "torch")
    cell = KERNELS._cells[("attention", "cpu", "generic", "default")]
    assert KERNELS.reasons(cell, AVX2) == ["needs torch, which is not installed"]
    assert KERNELS.resolve("attention", AVX2)[0].name == "attention/numpy/generic/default"


def test_variant_falls_back_to_default_when_the_tier_lacks_it(kernels):
    assert kernels.resolve("attention", AVX512, "bf16")[0].name == "attention/cpu/avx512_bf16/bf16"
    assert kernels.resolve("attention", AVX2, "bf16")[0].name == "attention/cpu/avx2/bf16"  # emulated in float32
    assert kernels.resolve("cfg_combine", AVX2, "bf16")[0].name == "cfg_combine/cpu/generic/default"


def test_the_avx2_tier_has_its_own_float32_linear_and_lora_and_avx512_does_not_inherit_them(kernels):
    """avx2 computes the FFN's GELU apart from its product and lays LoRA A out for its BLAS; the avx512_bf16 tier,
    whose chain runs through avx2, keeps the generic cells (oneDNN's fused GELU is fast there)."""
    from cardtool.backends import cpu_avx2, torch_ops

    for op in ("linear", "lora_bgmv"):
        assert kernels.resolve(op, AVX2)[1] is getattr(cpu_avx2, op)
        assert kernels.resolve(op, AVX512)[1] is getattr(torch_ops, op)
        assert kernels.resolve(op, Platform("cpu", "generic"))[1] is getattr(torch_ops, op)


def test_when_nothing_resolves_every_candidate_and_its_reasons_are_listed(kernels):
    kernels.register("only_on_hopper", "cuda", "sm90a", "default", target="x:y")
    kernels.register("only_on_hopper", "cuda", "generic", "default", target="x:y", requires=("no_such_triton",))
    with pytest.raises(NoCellAvailable) as info:
        kernels.resolve("only_on_hopper", SM100)
    message = str(info.value)
    assert "nothing can run kernel 'only_on_hopper' (variant default) on cuda/sm100" in message
    assert "only_on_hopper/cuda/sm90a/default: cuda/sm90a is not on the chain of cuda/sm100" in message
    assert "only_on_hopper/cuda/generic/default: needs no_such_triton, which is not installed" in message
    assert "it runs on" not in message  # the device is right; its arch or a module is not
    with pytest.raises(NoCellAvailable, match="(?m)^  it runs on cuda: use --device cuda$"):
        kernels.resolve("only_on_hopper", Platform("numpy", "generic"))
    with pytest.raises(NoCellAvailable, match="no kernel cell named 'nope'"):
        kernels.resolve("nope", SM100)


def test_custom_availability_check_reasons(kernels):
    kernels.register("rms_norm", "cpu", "avx2", "default", target="wrong_kernels:attention_drops_mask",
                     check="test_chains_and_resolution:needs_big_machine")
    assert kernels.resolve("rms_norm", AVX2)[0].name == "rms_norm/cpu/generic/default"
    assert kernels.reasons(kernels._cells[("rms_norm", "cpu", "avx2", "default")], AVX2) == ["needs 64 cores"]


def needs_big_machine(platform):
    return ["needs 64 cores"]


def test_resolution_is_cached_per_platform_and_reset_by_registration(kernels, monkeypatch):
    loads = []
    original = registry.Cell.load
    monkeypatch.setattr(registry.Cell, "load", lambda self: loads.append(self.name) or original(self))
    first = kernels.resolve("cfg_combine", AVX2)
    assert kernels.resolve("cfg_combine", AVX2) is first
    assert loads == ["cfg_combine/cpu/generic/default"]
    kernels.resolve("cfg_combine", NO_TORCH)
    assert len(loads) == 2, "another platform resolves on its own"
    kernels.register("cfg_combine", "cpu", "avx2", "default", target="wrong_kernels:cfg_combine_sign_flipped")
    assert kernels.resolve("cfg_combine", AVX2)[0].name == "cfg_combine/cpu/avx2/default"


def test_a_cell_whose_key_does_not_fit_or_whose_module_name_is_malformed_is_refused(kernels):
    """What a plugin author gets wrong: a key without the arch, and a requirement that is no module name."""
    with pytest.raises(ValueError, match=r"kernel keys are \(op, device, arch, variant\), got \('rms_norm', 'cpu'"):
        kernels.register("rms_norm", "cpu", "default", target="wrong_kernels:attention_drops_mask")
    kernels.register("rms_norm", "cpu", "avx2", "default", target="wrong_kernels:attention_drops_mask",
                     requires=("not..a.module",))
    cell = kernels._cells[("rms_norm", "cpu", "avx2", "default")]
    assert kernels.reasons(cell, AVX2) == ["needs not..a.module, which is not installed"]
    assert kernels.resolve("rms_norm", AVX2)[0].name == "rms_norm/cpu/generic/default"
