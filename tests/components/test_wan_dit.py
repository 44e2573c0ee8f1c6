"""The Wan2.1 DiT: one safetensors file runs in diffusers, in our torch module and in our numpy forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cardtool.backends.numpy_wan_dit import NumpyWanDiT
from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import WanDiT
from cardtool.errors import BadInput

TINY = WanDiTConfig(dim=24, depth=2, heads=2, ffn_dim=48, in_channels=4, out_channels=4, text_dim=16, freq_dim=32)
CPU = Platform("cpu", "generic")


def inputs(dtype=torch.float32, batch=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 4, 1, 8, 8, generator=g, dtype=dtype)
    t = torch.tensor([999.0, 250.0][:batch], dtype=dtype)
    text = torch.randn(batch, 7, 16, generator=g, dtype=dtype)
    return x, t, text


def diffusers_model(seed=0):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    return diffusers.WanTransformer3DModel(**TINY.to_diffusers()).eval()


def test_diffusers_weights_load_into_ours_and_agree(tmp_path):
    theirs = diffusers_model()
    path = tmp_path / "diffusers.safetensors"
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(path))
    ours = WanDiT(TINY, CPU).eval()
    ours.load_state_dict(load_file(str(path)), strict=True)
    x, t, text = inputs()
    with torch.no_grad():
        expected = theirs(x, t, text, return_dict=False)[0]
        actual = ours(x, t, text)
    assert expected.abs().max() > 0.1, "a zero output would make the comparison empty"
    assert (actual - expected).abs().max().item() <= 1e-5


def test_our_weights_load_into_diffusers_and_agree(tmp_path):
    torch.manual_seed(1)
    ours = WanDiT(TINY, CPU).eval()
    torch.nn.init.normal_(ours.proj_out.weight, std=0.2)  # our head starts at zero; give it something to say
    path = tmp_path / "ours.safetensors"
    save_file(ours.state_dict(), str(path))
    theirs = diffusers_model(seed=5)
    missing, unexpected = theirs.load_state_dict(load_file(str(path)), strict=True)
    x, t, text = inputs()
    with torch.no_grad():
        assert (theirs(x, t, text, return_dict=False)[0] - ours(x, t, text)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("text_mask", [True, False])
def test_numpy_forward_matches_torch_in_float64_with_and_without_the_text_mask(text_mask):
    config = TINY.model_copy(update={"text_mask": text_mask, "heads": 3})  # heads ≠ batch: no shape mix-up hides
    torch.manual_seed(2)
    model = WanDiT(config, CPU).double().eval()
    torch.nn.init.normal_(model.proj_out.weight, std=0.2)
    reference = NumpyWanDiT(config, {k: v.numpy() for k, v in model.state_dict().items()})
    x, t, text = inputs(torch.float64)
    mask = torch.tensor([[True] * 4 + [False] * 3, [True] * 7])
    text = text * mask[..., None]  # padded states are zero, as the text encoder gives them
    with torch.no_grad():
        actual = model(x, t, text, mask).numpy()
    expected = reference(x.numpy(), t.numpy(), text.numpy(), mask.numpy())
    np.testing.assert_allclose(actual, expected, atol=1e-12, rtol=1e-10)
    unmasked = reference(x.numpy(), t.numpy(), text.numpy())
    if text_mask:
        assert np.abs(unmasked[0] - expected[0]).max() > 1e-6, "the mask changes the padded sample's output"
    else:
        np.testing.assert_array_equal(unmasked, expected, "Wan2.1 semantics: the mask is not used")
    np.testing.assert_allclose(unmasked[1], expected[1], atol=1e-12)


def test_by_default_a_padded_prompt_gives_what_diffusers_gives(tmp_path):
    """Wan2.1 semantics: zero-padded text states attended to in full, whatever mask comes with them."""
    theirs = diffusers_model(seed=3)
    ours = WanDiT(TINY, CPU).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x, t, text = inputs()
    mask = torch.tensor([[True] * 3 + [False] * 4, [True] * 5 + [False] * 2])
    text = text * mask[..., None]
    with torch.no_grad():
        expected = theirs(x, t, text, return_dict=False)[0]
        assert (ours(x, t, text, mask) - expected).abs().max().item() <= 1e-5
    with pytest.raises(BadInput, match="text_mask: true masks padded text tokens"):
        TINY.model_copy(update={"text_mask": True}).to_diffusers()


def test_untrained_head_predicts_zero_velocity():
    x, t, text = inputs()
    with torch.no_grad():
        assert WanDiT(TINY, CPU)(x, t, text).abs().max().item() == 0.0


def test_primitive_ops_come_from_the_kernel_table(kernels):
    calls = []
    import cardtool.backends.torch_ops as torch_ops

    def counting_attention(q, k, v, mask=None):
        calls.append(q.shape)
        return torch_ops.attention(q, k, v, mask)

    torch_ops.counting_attention = counting_attention
    try:
        kernels.register("attention", "cpu", "avx2", "default", target="cardtool.backends.torch_ops:counting_attention")
        model = WanDiT(TINY, Platform("cpu", "avx2")).eval()
        with torch.no_grad():
            model(*inputs())
    finally:
        del torch_ops.counting_attention
    assert len(calls) == 2 * TINY.depth, "self- and cross-attention of every block use the platform's kernel"
    assert calls[0] == (2, 2, 16, 12)  # (B, heads, tokens = 1·4·4, head dim)


def test_gradients_flow_to_every_parameter():
    model = WanDiT(TINY, CPU)
    torch.nn.init.normal_(model.proj_out.weight, std=0.2)
    model(*inputs()).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_config_is_checked():
    with pytest.raises(BadInput, match="layers: unknown key"):
        WanDiTConfig.from_card({"dim": 32, "layers": 3})
    with pytest.raises(BadInput, match="even size"):
        WanDiTConfig.from_card({"dim": 30, "heads": 2})
    assert WanDiTConfig.from_card(TINY.to_card()) == TINY


@pytest.mark.parametrize(("config", "millions"), [
    (WanDiTConfig(dim=256, depth=6, heads=4, ffn_dim=1024, text_dim=384), 7.03),
    (WanDiTConfig(dim=384, depth=8, heads=6, ffn_dim=1536, text_dim=384), 20.39),
])
def test_supported_sizes_parameter_counts(config, millions):
    count = sum(p.numel() for p in WanDiT(config, CPU).parameters())
    assert round(count / 1e6, 2) == millions, count


def test_a_forward_under_inference_mode_leaves_nothing_that_breaks_training():
    from cardtool.backends import torch_ops

    torch_ops._rope_rotations.cache_clear()  # the tables are cached: make this forward the one that builds them
    model = WanDiT(TINY, CPU)
    x, t, text = inputs()
    with torch.inference_mode():
        model(x, t, text)
    model(x, t, text).sum().backward()  # would raise if a cached table were an inference tensor
    assert model.blocks[0].attn1.to_q.weight.grad is not None
