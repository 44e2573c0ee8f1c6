"""The numpy reference ops against analytic answers; the torch ops are differentiable (gradcheck)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cardtool.backends import reference as ref
from cardtool.backends import torch_ops

rng = np.random.default_rng(1)


def test_euler_step_moves_along_the_velocity():
    x, v = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    np.testing.assert_allclose(ref.flow_match_step(x, v, np.array([1.0, 0.5]), np.array([0.75, 0.0])),
                               x + np.array([[-0.25], [-0.5]]) * v)


def test_euler_on_a_straight_path_lands_on_the_data():
    """For x_t = (1 − t)·x0 + t·ε the true velocity is ε − x0; Euler integrates it exactly."""
    x0, eps = rng.standard_normal(4), rng.standard_normal(4)
    x, grid = eps.copy(), np.linspace(1, 0, 5)
    for s, s_next in zip(grid[:-1], grid[1:], strict=True):
        x = ref.flow_match_step(x, eps - x0, s, s_next)
    np.testing.assert_allclose(x, x0, atol=1e-12)


def test_sde_step_mean_std_and_logprob_follow_flow_grpo():
    x, v, z = rng.standard_normal((1, 8)), rng.standard_normal((1, 8)), rng.standard_normal((1, 8))
    sigma, sigma_next, eta = 0.6, 0.4, 0.7
    sample, mean, std, logp = ref.flow_sde_step(x, v, sigma, sigma_next, noise=z, eta=eta)
    s = eta * math.sqrt(sigma / (1 - sigma))
    dt = sigma_next - sigma
    np.testing.assert_allclose(mean, x + (v + s**2 / (2 * sigma) * (x + (1 - sigma) * v)) * dt)
    np.testing.assert_allclose(std, [s * math.sqrt(-dt)])
    np.testing.assert_allclose(sample, mean + s * math.sqrt(-dt) * z)
    expected = np.mean(-(z**2) / 2 - math.log(s * math.sqrt(-dt)) - 0.5 * math.log(2 * math.pi))
    np.testing.assert_allclose(logp, [expected])
    # scoring the recorded sample gives the same log-probability
    np.testing.assert_allclose(ref.flow_sde_step(x, v, sigma, sigma_next, prev_sample=sample, eta=eta)[3], logp)


def test_sde_step_at_sigma_one_uses_the_next_grid_point():
    x, v, z = np.zeros((1, 2)), np.ones((1, 2)), np.zeros((1, 2))
    std = ref.flow_sde_step(x, v, 1.0, 0.9, noise=z)[2]
    np.testing.assert_allclose(std, [0.7 * math.sqrt(1.0 / 0.1) * math.sqrt(0.1)])


def test_renoise_step_predicts_x0_and_renoises_to_the_next_sigma():
    """On x_t = (1 − t)·x0 + t·ε with the true velocity ε − x0, x̂0 is x0 exactly: each step lands on the path
    at σ_next with the fresh noise, and the last step returns x0."""
    x0, eps, fresh = rng.standard_normal((2, 6)), rng.standard_normal((2, 6)), rng.standard_normal((2, 6))
    sigma, sigma_next = np.array([0.75, 0.25]), np.array([0.5, 0.0])
    x = (1 - sigma[:, None]) * x0 + sigma[:, None] * eps
    out = ref.flow_renoise_step(x, eps - x0, sigma, sigma_next, fresh)
    np.testing.assert_allclose(out[0], 0.5 * x0[0] + 0.5 * fresh[0], atol=1e-12)
    np.testing.assert_allclose(out[1], x0[1], atol=1e-12)
    # a one-step grid (σ 1 → 0) is the Euler step
    np.testing.assert_allclose(ref.flow_renoise_step(x, eps, 1.0, 0.0, fresh), ref.flow_match_step(x, eps, 1.0, 0.0))


def test_cfg_at_scale_one_is_the_conditional_velocity():
    vu, vc = rng.standard_normal((2, 5)), rng.standard_normal((2, 5))
    np.testing.assert_allclose(ref.cfg_combine(vu, vc, 1.0), vc)
    np.testing.assert_allclose(ref.cfg_combine(vu, vc, 0.0), vu)


def test_masked_attention_equals_attention_over_the_kept_keys():
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    k, v = rng.standard_normal((1, 2, 6, 4)), rng.standard_normal((1, 2, 6, 4))
    keep = np.array([True, False, True, True, False, True])
    np.testing.assert_allclose(ref.attention(q, k, v, keep[None, None, None]),
                               ref.attention(q, k[..., keep, :], v[..., keep, :]), atol=1e-12)
    nothing = np.zeros((1, 1, 3, 6), dtype=bool)
    assert np.all(ref.attention(q, k, v, nothing) == 0)


def test_attention_at_large_scores_is_the_softmax_without_overflow():
    """exp(1000) overflows float64: the softmax must subtract each row's peak, which changes nothing else."""
    q, k, v = np.full((1, 1, 1, 4), 40.0), np.array([[[[20.0] * 4, [19.0] * 4]]]), rng.standard_normal((1, 1, 2, 4))
    weights = np.array([1.0, np.exp(-160.0)])  # scores 1600 and 1520 (÷ √4): the second's share is e^−80·…
    np.testing.assert_allclose(ref.attention(q, k, v)[0, 0, 0], weights @ v[0, 0] / weights.sum(), rtol=1e-12)


def test_rms_and_layer_norm_statistics():
    x = 5 * rng.standard_normal((3, 64)) + 2
    np.testing.assert_allclose(np.sqrt((ref.rms_norm(x, eps=0) ** 2).mean(-1)), 1.0)
    y = ref.modulated_layer_norm(x, np.zeros(64), np.zeros(64), eps=0)
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.std(-1), 1)
    np.testing.assert_allclose(ref.modulated_layer_norm(x, np.full(64, 3.0), np.ones(64), eps=0), 2 * y + 3)


def test_rope_splits_wan_head_dim_and_depends_only_on_relative_position():
    dim = 64  # frames 24, rows 20, columns 20 channels
    angles = ref.rope_angles((3, 4, 5), dim)
    assert angles.shape == (60, 32)
    token = lambda f, h, w: (f * 4 + h) * 5 + w  # noqa: E731
    # moving one row changes only the row channels
    delta = angles[token(1, 2, 3)] - angles[token(1, 1, 3)]
    assert np.all(delta[:12] == 0) and np.all(delta[12:22] != 0) and np.all(delta[22:] == 0)
    q, k = rng.standard_normal((1, 1, 60, dim)), rng.standard_normal((1, 1, 60, dim))
    rq, rk = ref.rope_3d(np.broadcast_to(q[:, :, :1], q.shape).copy(), (3, 4, 5)), \
        ref.rope_3d(np.broadcast_to(k[:, :, :1], k.shape).copy(), (3, 4, 5))
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q[:, :, :1], axis=-1).repeat(60, 2))
    # each axis's ladder is θ^(−2i/n) over its own n channels: the frames' 24 from 1 down, the rows' and columns' 20
    ladder = [10000.0 ** (-np.arange(0, n, 2) / n) for n in (24, 20, 20)]
    np.testing.assert_allclose(angles[token(1, 1, 1)], np.concatenate(ladder))
    # <R(p)q, R(p')k> depends on p − p' only
    np.testing.assert_allclose(rq[0, 0, token(0, 1, 1)] @ rk[0, 0, token(0, 0, 0)],
                               rq[0, 0, token(2, 3, 4)] @ rk[0, 0, token(2, 2, 3)])


def test_timestep_embedding_is_cos_then_sin():
    emb = ref.timestep_embedding(np.array([0.0, 2.0]), 8)
    np.testing.assert_allclose(emb[0], [1, 1, 1, 1, 0, 0, 0, 0])
    freqs = np.exp(-np.log(10000) * np.arange(4) / 4)
    np.testing.assert_allclose(emb[1], np.concatenate([np.cos(2 * freqs), np.sin(2 * freqs)]))
    odd = ref.timestep_embedding(np.array([2.0]), 9)
    assert odd.shape == (1, 9) and odd[0, 8] == 0, "an odd width ends with one zero"
    np.testing.assert_allclose(odd[0, :8], emb[1])
    even = ref.timestep_embedding(np.array([2.0]), 6)
    assert even.shape == (1, 6) and np.all(even[0] != 0), "an even width has no padding"
    # computed in float64, returned in the float dtype of t — or float64 for integer timesteps, never truncated
    assert ref.timestep_embedding(np.array([2.0], np.float32), 8).dtype == np.float32
    whole = ref.timestep_embedding(np.array([2]), 8)
    assert whole.dtype == np.float64 and np.array_equal(whole, emb[1:])


def test_lora_bgmv_gives_each_sample_its_own_adapter():
    x, y = rng.standard_normal((3, 5, 6)), rng.standard_normal((3, 5, 4))
    a, b, scales = rng.standard_normal((2, 2, 6)), rng.standard_normal((2, 4, 2)), np.array([0.5, 2.0])
    out = ref.lora_bgmv(x, y, a, b, scales, np.array([1, -1, 0]))
    np.testing.assert_allclose(out[0], y[0] + 2.0 * x[0] @ (b[1] @ a[1]).T)
    np.testing.assert_allclose(out[1], y[1])
    np.testing.assert_allclose(out[2], y[2] + 0.5 * x[2] @ (b[0] @ a[0]).T)
    # no index: row i takes adapter i; no scales: each at 1
    plain = ref.lora_bgmv(x[:2], y[:2], a, b, None, None)
    np.testing.assert_allclose(plain, y[:2] + np.stack([x[i] @ (b[i] @ a[i]).T for i in range(2)]))


def _double(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("op", ["attention", "flow_sde_step", "rope_3d", "modulated_layer_norm", "lora_bgmv"])
def test_torch_ops_are_differentiable(op):
    torch.manual_seed(0)
    calls = {
        "attention": (lambda q, k, v: torch_ops.attention(q, k, v, torch.tensor([[[[True, True, False]]]])),
                      (_double(1, 1, 2, 4), _double(1, 1, 3, 4), _double(1, 1, 3, 4))),
        "flow_sde_step": (lambda x, v: torch_ops.flow_sde_step(x, v, 0.5, 0.25, noise=torch.ones(2, 3))[3],
                          (_double(2, 3), _double(2, 3))),
        "rope_3d": (lambda x: torch_ops.rope_3d(x, (1, 2, 2)), (_double(1, 1, 4, 12),)),
        "modulated_layer_norm": (torch_ops.modulated_layer_norm,
                                 (_double(2, 3, 8), _double(2, 1, 8), _double(2, 1, 8))),
        "lora_bgmv": (lambda x, a, b: torch_ops.lora_bgmv(x, torch.zeros(2, 3, dtype=torch.float64), a, b,
                                                          torch.tensor([1.0, 0.5], dtype=torch.float64),
                                                          torch.tensor([1, 0])),
                      (_double(2, 4), _double(2, 2, 4), _double(2, 3, 2))),
    }
    fn, inputs = calls[op]
    assert torch.autograd.gradcheck(fn, inputs)


def test_linear_with_gelu_fused_for_inference_equals_the_differentiable_path():
    """On a CPU the tanh-GELU runs in oneDNN's epilogue when nothing needs a gradient; with one to take the op
    falls back to the autograd path, and both give the reference within float32 rounding."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 16), torch.randn(24, 16) / 4, torch.randn(24)
    expected = ref.linear(x.double().numpy(), w.double().numpy(), b.double().numpy(), "gelu_tanh")
    with torch.inference_mode():
        assert torch_ops.fusable_on_cpu(x, w, b) == torch_ops.has_onednn_linear()
        fused = torch_ops.linear(x, w, b, "gelu_tanh")
        # bf16 fuses only where oneDNN has bf16 kernels for this CPU; elsewhere it must still compute
        bf16 = torch_ops.linear(x.bfloat16(), w.bfloat16(), b.bfloat16(), "gelu_tanh")
    np.testing.assert_allclose(bf16.float().numpy(), expected, atol=0.1)
    trained = torch_ops.linear(x, w.requires_grad_(), b, "gelu_tanh")
    trained.sum().backward()
    assert trained.grad_fn is not None and w.grad is not None and w.grad.abs().sum() > 0
    np.testing.assert_allclose(fused.numpy(), expected, atol=1e-5)
    np.testing.assert_allclose(trained.detach().numpy(), expected, atol=1e-5)
    with pytest.raises(ValueError, match="unknown activation"):
        torch_ops.linear(x, w, b, "relu")
