"""The numpy reference of every kernel op: plain, loop-where-clearer code that is the oracle
`cardtool parity` measures every other cell against (DESIGN.md invariant 4).

Conventions shared by every implementation of an op:
- σ runs from 1 (noise) to 0 (data); `sigma`, `sigma_next`, guidance `scale` are scalars or (B,) arrays.
- attention takes (B, H, L, D) and a boolean mask broadcastable to (B, H, Lq, Lk), True = attend; a row
  with nothing to attend to gives zeros.
- rope_3d takes (B, H, L, D) with the L tokens in (frame, row, column) order over `grid` = (F, H, W).
"""

from __future__ import annotations

import numpy as np

__all__ = ["flow_match_step", "flow_sde_step", "flow_renoise_step", "flow_dpm_step",
           "cfg_combine", "attention", "rms_norm", "modulated_layer_norm",
           "rope_3d", "rope_angles", "timestep_embedding", "lora_bgmv", "gelu_tanh", "linear"]


ACTIVATIONS = (None, "gelu_tanh")  # what a `linear` may apply after its product


def _per_sample(value, x: np.ndarray) -> np.ndarray:
    """A scalar or (B,) value shaped to broadcast against x (B, …)."""
    a = np.asarray(value, dtype=x.dtype)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim)) if a.ndim else a


def flow_match_step(x, v, sigma, sigma_next):
    """Euler step of the flow-matching ODE: x + (σ_next − σ)·v."""
    return x + (_per_sample(sigma_next, x) - _per_sample(sigma, x)) * v


def flow_sde_step(x, v, sigma, sigma_next, noise=None, prev_sample=None, eta=0.7):
    """Flow-GRPO SDE step (arXiv 2505.05470): returns (sample, mean, std (B,), log-prob (B,)).

    The sample is mean + std·noise, or `prev_sample` when given (to score a recorded step)."""
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    dt = s_next - s
    std_t = eta * np.sqrt(s / (1 - np.where(s == 1, s_next, s)))  # at σ = 1 the grid's next σ stands in
    mean = x + (v + std_t**2 / (2 * s) * (x + (1 - s) * v)) * dt
    std = std_t * np.sqrt(-dt)
    sample = mean + std * noise if prev_sample is None else prev_sample
    logp = -((sample - mean) ** 2) / (2 * std**2) - np.log(std) - 0.5 * np.log(2 * np.pi)
    reduce = tuple(range(1, x.ndim))
    return sample, mean, np.broadcast_to(std, logp.shape).mean(axis=reduce), logp.mean(axis=reduce)


def flow_renoise_step(x, v, sigma, sigma_next, noise):
    """The few-step sampling rule of DMD2's multi-step generators (arXiv 2405.14867, "backward simulation"; the
    LCM-style multistep rule): the clean estimate x̂0 = x − σ·v, re-noised to the next grid point with fresh
    noise: (1 − σ_next)·x̂0 + σ_next·ε. The last step (σ_next = 0) returns x̂0."""
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    return (1 - s_next) * (x - s * v) + s_next * noise


def flow_dpm_step(x, v, sigma, sigma_next, x0_prev, c):
    """DPM-Solver++(2M) step in the flow's parametrisation (Lu et al. 2022, arXiv 2211.01095, its multistep
    second-order update; α = 1 − σ): x̂0 = x − σ·v, D = (1 + c)·x̂0 − c·x̂0_prev, x' = (σ'/σ)·x + (1 − σ'/σ)·D.
    c = h / (2·h_prev) over the log-SNR steps λ = log((1 − σ)/σ) (the caller's grid arithmetic); c = 0 is the
    first-order step, Euler's in exact arithmetic. Returns (x', x̂0): x̂0 is the next step's x̂0_prev."""
    s, s_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    x0 = x - s * v
    ratio = s_next / s
    c = _per_sample(c, x)
    return ratio * x + (1 - ratio) * ((1 + c) * x0 - c * x0_prev), x0


def cfg_combine(v_uncond, v_cond, scale):
    """Classifier-free guidance: v_u + w·(v_c − v_u)."""
    return v_uncond + _per_sample(scale, v_cond) * (v_cond - v_uncond)


def gelu_tanh(x):
    """GELU in its tanh form (Hendrycks & Gimpel 2016, eq. 3), the FFN activation of Wan2.1:
    ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def check_activation(activation) -> None:
    """Refuse an activation a `linear` cell does not apply (every cell takes the same ones)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; one of {ACTIVATIONS}")


def linear(x, weight, bias=None, activation=None):
    """A linear layer x·Wᵀ + b (W: (out, in)), then `activation`: None, or "gelu_tanh" (the FFN's first layer)."""
    check_activation(activation)
    y = x @ np.swapaxes(weight, -1, -2) + (0 if bias is None else bias)
    return y if activation is None else gelu_tanh(y)


def attention(q, k, v, mask=None):
    """Scaled dot-product attention softmax(q·kᵀ/√d)·v, with an optional boolean mask."""
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        scores = np.where(mask, scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(peak), peak, 0))
    total = weights.sum(axis=-1, keepdims=True)
    return (weights @ v) / np.where(total == 0, 1, total)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm: x / √(mean(x²) + eps) · weight, over the last dim."""
    out = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    return out * weight if weight is not None else out


def modulated_layer_norm(x, shift, scale, eps=1e-6):
    """adaLN: LayerNorm without affine, then ·(1 + scale) + shift (DiT / Wan2.1 modulation)."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * (1 + scale) + shift


def rope_angles(grid, dim, theta=10000.0):
    """(L, dim/2) rotation angles of Wan2.1's 3D RoPE: the head dim splits into d − 4⌊d/6⌋ channels
    for frames and 2⌊d/6⌋ each for rows and columns, each axis with its own frequency ladder."""
    frames, rows, cols = grid
    split_hw = 2 * (dim // 6)
    parts = []
    for axis, (length, n) in enumerate(((frames, dim - 2 * split_hw), (rows, split_hw), (cols, split_hw))):
        freqs = 1.0 / theta ** (np.arange(0, n, 2, dtype=np.float64) / n)
        angles = np.outer(np.arange(length, dtype=np.float64), freqs)  # (length, n/2)
        shape = [1, 1, 1, n // 2]
        shape[axis] = length
        parts.append(np.broadcast_to(angles.reshape(shape), (frames, rows, cols, n // 2)))
    return np.concatenate(parts, axis=-1).reshape(frames * rows * cols, dim // 2)


def rope_3d(x, grid, theta=10000.0):
    """Rotate consecutive channel pairs (x[2i], x[2i+1]) of x (B, H, L, D) by the 3D RoPE angles."""
    angles = rope_angles(grid, x.shape[-1], theta)
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def timestep_embedding(t, dim, max_period=10000.0):
    """Sinusoidal timestep embedding, cos half first (Wan2.1: flip_sin_to_cos, no frequency shift)."""
    half = dim // 2
    freqs = np.exp(-np.log(max_period) * np.arange(half, dtype=np.float64) / half)
    args = np.asarray(t, dtype=np.float64)[:, None] * freqs[None]
    emb = np.concatenate([np.cos(args), np.sin(args)], axis=-1)
    if dim % 2:
        emb = np.concatenate([emb, np.zeros_like(emb[:, :1])], axis=-1)
    return emb.astype(np.asarray(t).dtype if np.asarray(t).dtype.kind == "f" else np.float64)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """Mixed-adapter LoRA (Punica BGMV): y[i] + scale_a·x[i]·A_aᵀ·B_aᵀ with a = index[i], −1 = no adapter.

    x (N, …, Din), y (N, …, Dout) the base output, lora_a (n, r, Din), lora_b (n, Dout, r), scales (n,).
    Adapters of smaller rank are zero-padded to r, which changes nothing. With `index` None, sample i uses
    adapter i (weights gathered once for many calls); `scales` None means 1."""
    out = y.copy()
    rows = range(len(x)) if index is None else np.asarray(index)
    for i, a in enumerate(rows):
        if a >= 0:
            scale = 1.0 if scales is None else scales[a]
            out[i] = out[i] + scale * ((x[i] @ lora_a[a].T) @ lora_b[a].T)
    return out
