"""The zen4 tier (AMD's AVX-512 cores): its own attention in float32 and for bfloat16 and its own bfloat16 linear,
the rest of the avx512_bf16 tier's cells; the zen5 tier (full-width AVX-512) the float32 linear too; and values the
generic cells give (runs on any CPU: the tiers can be forced)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cardtool.backends import cpu_bf16, cpu_zen4, reference, torch_ops
from cardtool.backends.parity import run_parity
from cardtool.backends.platform import Platform
from cardtool.backends.registry import KERNELS

ZEN4, ZEN5 = Platform("cpu", "zen4"), Platform("cpu", "zen5")


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def test_zen4_resolves_its_own_cells_and_the_avx512_tiers_others_and_zen5_the_float32_linear_too():
    for platform in (ZEN4, ZEN5):
        assert KERNELS.resolve("attention", platform)[1] is cpu_zen4.attention
        for op in ("linear", "attention"):
            assert KERNELS.resolve(op, platform, "bf16")[1] is getattr(cpu_zen4, f"{op}_bf16")
        assert KERNELS.resolve("rms_norm", platform, "bf16")[1] is cpu_bf16.rms_norm
        assert KERNELS.resolve("lora_bgmv", platform)[1] is cpu_zen4.lora_bgmv
        assert platform.supports_bf16
    assert KERNELS.resolve("linear", ZEN4)[1] is torch_ops.linear, "Zen 4: MKL's float32 products, as avx512_bf16"
    assert KERNELS.resolve("linear", ZEN5)[1] is cpu_zen4.linear


def test_every_zen4_and_zen5_cell_passes_parity_here():
    rows = run_parity(ZEN5)
    own = [r for r in rows if "/zen4/" in r.cell or "/zen5/" in r.cell]
    expected = {"attention/cpu/zen4/default", "linear/cpu/zen4/bf16", "attention/cpu/zen4/bf16",
                "lora_bgmv/cpu/zen4/default", "linear/cpu/zen5/default"}
    assert {r.cell for r in own} == expected
    assert all(r.passed for r in own), [(r.cell, r.dtype, r.max_abs_err) for r in own if not r.passed]


def test_lora_bgmv_gives_the_generic_deltas_in_place_and_with_a_gradient():
    """The down-projection computed transposed (A·xᵀ): each row its own (or no) adapter, in place on a sampler's
    temporary, and differentiable where a LoRA trains."""
    torch.manual_seed(1)
    x, y = torch.randn(5, 12, 64), torch.randn(5, 12, 96)
    a, b, scales, index = torch.randn(3, 8, 64) / 8, torch.randn(3, 96, 8), torch.tensor([1.0, 0.5, -2.0]), \
        torch.tensor([0, -1, 2, 1, 0])
    expected = torch_ops.lora_bgmv(x.double(), y.double(), a.double(), b.double(), scales.double(), index)
    assert torch.equal(expected[1], y[1].double())
    picked = index.clamp(min=0)
    per_row = (a[picked] * (index >= 0)[:, None, None], b[picked] * scales[picked][:, None, None], None, None)
    for args in ((a, b, scales, index), per_row):
        assert (cpu_zen4.lora_bgmv(x, y, *args).double() - expected).abs().max() < 1e-4
        with torch.inference_mode():
            temporary = y.clone()
            assert cpu_zen4.lora_bgmv(x, temporary, *args).data_ptr() == temporary.data_ptr()
            assert (temporary.double() - expected).abs().max() < 1e-4
    assert cpu_zen4.lora_bgmv(x, y, a[:0], b[:0], None, None) is y, "a plan with no slots: y as it is"
    trained = a.clone().requires_grad_(True)
    cpu_zen4.lora_bgmv(x, y, trained, b, scales, index).sum().backward()
    reference = a.clone().requires_grad_(True)
    torch_ops.lora_bgmv(x, y, reference, b, scales, index).sum().backward()
    assert (trained.grad - reference.grad).abs().max() < 1e-3 and trained.grad[1].abs().sum() > 0


@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_linear_gives_the_generic_values_and_keeps_its_gradient(activation):
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 16, 64), torch.randn(96, 64) / 8, torch.randn(96)
    expected = torch_ops.linear(x.double(), w.double(), b.double(), activation)
    with torch.inference_mode():
        y = cpu_zen4.linear(x, w, b, activation)
    assert y.dtype == torch.float32 and (y.double() - expected).abs().max() < 2e-5
    grads = []
    for cell in (cpu_zen4.linear, torch_ops.linear):  # with a gradient to take: oneDNN's product with its backward
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
        trained = cell(*leaves, activation)
        assert (trained.double() - expected).abs().max() < 2e-5
        (trained * torch.linspace(-1, 1, 96)).sum().backward()
        grads.append([t.grad for t in leaves])
    for mine, generic in zip(*grads, strict=True):
        assert (mine - generic).abs().max() < 1e-4 * max(1.0, float(generic.abs().max()))
    for trains in range(3):  # one of input, weight and bias trains, the others frozen: its gradient, and theirs none
        leaves = [t.detach().clone().requires_grad_(i == trains) for i, t in enumerate((x, w, b))]
        (cpu_zen4.linear(*leaves, activation) * torch.linspace(-1, 1, 96)).sum().backward()
        assert [t.grad is not None for t in leaves] == [i == trains for i in range(3)]
        generic = grads[1][trains]
        assert (leaves[trains].grad - generic).abs().max() < 1e-4 * max(1.0, float(generic.abs().max()))
    frozen = cpu_zen4.linear(x.requires_grad_(True), w, b)  # frozen weights (a LoRA's base): the input's gradient only
    frozen.sum().backward()
    assert torch.allclose(x.grad, w.sum(0).expand_as(x), atol=1e-5)
    with pytest.raises(ValueError, match="unknown activation"):
        cpu_zen4.linear(x, w, b, "relu")


@pytest.mark.parametrize("inputs", [16, 128, 256, 512])
def test_a_small_product_gets_the_bits_its_rows_get_in_a_large_one(inputs):
    """C2: a request alone makes products of a few dozen rows, which may go to MKL; in a batch, of thousands, which
    always go to oneDNN. Either way a row gets the same bits (on the Zen 5, the products of 256 and 512
    inputs are blocked differently and stay on oneDNN)."""
    torch.manual_seed(3)
    w, b = torch.randn(128, inputs) / inputs**0.5, torch.randn(128)
    with torch.inference_mode():
        for rows in (16, 32, 64):
            x = torch.randn(rows, inputs)
            batch = torch.cat([x, torch.randn(2048, inputs)])
            assert torch.equal(cpu_zen4.linear(x, w, b), cpu_zen4.linear(batch, w, b)[:rows])
            assert torch.equal(cpu_zen4.linear(x, w, None), cpu_zen4._onednn(x, w, None, None))
        expanded = torch.randn(1, inputs).expand(16, inputs)  # rows sharing memory: never tried, oneDNN's
        assert torch.equal(cpu_zen4.linear(expanded, w, b), cpu_zen4._onednn(expanded, w, b, None))
    shapes = {(key[0], key[2]) for key in cpu_zen4._SAME_BITS}
    assert {((rows, inputs), (128, inputs)) for rows in (16, 32, 64)} <= shapes  # each small shape tried once
    assert ((2048 + 16, inputs), (128, inputs)) not in shapes  # a large product goes to oneDNN untried


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "no-bf16-onednn"])
def test_bf16_linear_is_a_bfloat16_product_under_autocast_with_the_tanh_gelu(onednn, monkeypatch):
    """Also where oneDNN cannot compute the bfloat16 product (the tier forced on a CPU without avx512_bf16): the
    fallback gets x rounded, not a float32 input with autocast off."""
    if not onednn:
        monkeypatch.setattr(torch_ops, "fusable_on_cpu", lambda *tensors: False)
    elif not torch_ops.fusable_on_cpu(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)):
        pytest.skip("this CPU's oneDNN has no bfloat16 product")
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 16, 64), (torch.randn(96, 64) / 8).bfloat16(), torch.randn(96).bfloat16()
    exact = x.bfloat16().double() @ w.double().T + b.double()
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain, gelu = cpu_zen4.linear_bf16(x, w, b), cpu_zen4.linear_bf16(x, w, b, "gelu_tanh")
        float_bias = cpu_zen4.linear_bf16(x, w, b.float())  # a bias not rounded at load: autocast's product
    assert plain.dtype == gelu.dtype == torch.bfloat16
    step = 2.0 ** -8  # one bfloat16 rounding, relative
    assert ((plain.double() - exact).abs() <= step * exact.abs() + 1e-2).all()
    tanh_gelu = torch.nn.functional.gelu(exact, approximate="tanh")
    assert ((gelu.double() - tanh_gelu).abs() <= step * tanh_gelu.abs() + 1e-2).all()
    assert float_bias.dtype == torch.bfloat16
    assert ((float_bias.double() - exact).abs() <= step * exact.abs() + 1e-2).all()


def test_written_out_attention_keeps_a_nan_that_its_inputs_hold():
    """Only the rows that attend to nothing are zeroed: a NaN query (a LoRA scale of 1e308 made one) stays NaN, as in
    the numpy reference, so the sampler refuses the image instead of serving one whose attention was dropped."""
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    q[0, 1, 3] = float("nan")
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    mask[1] = False
    for given in (None, mask):
        out = torch_ops.attention_matmul(q, k, v, given)
        expected = reference.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(),
                                       None if given is None else given.numpy())
        assert torch.isnan(out[0, 1, 3]).all() and torch.isfinite(out[0, 0]).all()
        assert torch.isfinite(out[0, 1, 4]).all()  # the other queries of that head
        assert np.isnan(expected[0, 1, 3]).all()
        if given is not None:
            assert (out[1] == 0).all() and (expected[1] == 0).all()
        with torch.inference_mode():
            assert torch.isnan(cpu_zen4.attention(q, k, v, given)[0, 1, 3]).all()


@pytest.mark.parametrize(("keys", "bf16_error"), [(7, 1e-5), (90, 2e-2)])  # 16 × 7 written out in float32; 80 × 90
def test_attention_gives_the_generic_values_and_zeros_where_nothing_is_attended(keys, bf16_error):  # > 4,096: fused
    torch.manual_seed(2)
    queries = 16 if keys < 64 else 80
    q, k, v = torch.randn(2, 3, queries, 8), torch.randn(2, 3, keys, 8), torch.randn(2, 3, keys, 8)
    mask = torch.rand(2, 1, 1, keys) > 0.4
    mask[1] = False  # the second sample attends to nothing
    expected = torch_ops.attention(q.double(), k.double(), v.double(), mask)
    with torch.inference_mode():
        for out, error in ((cpu_zen4.attention(q, k, v, mask), 1e-5), (cpu_zen4.attention_bf16(q, k, v, mask),
                                                                          bf16_error)):
            assert out.dtype == torch.float32 and (out.double() - expected).abs().max() < error
            assert (out[1] == 0).all()
