"""Device-generic, differentiable torch implementations of the kernel ops (conventions: reference.py).

Numerically sensitive ops (the SDE step, norms, RoPE, timestep embedding) compute in float32 when given
float16/bfloat16, as diffusers and Flow-GRPO do, and return the input dtype.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from cardtool.backends.reference import check_activation, rope_angles

__all__ = ["flow_match_step", "flow_sde_step", "flow_renoise_step", "flow_dpm_step",
           "cfg_combine", "attention", "rms_norm", "modulated_layer_norm",
           "rope_3d", "timestep_embedding", "lora_bgmv", "gelu_tanh", "linear"]

_LOW = (torch.float16, torch.bfloat16)


_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def _compute(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in _LOW else x.dtype


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, without a call where it is already (a cost per call in the hot loop)."""
    return t if t.dtype == dtype else t.to(dtype)


def _per_sample(value, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a = torch.as_tensor(value, dtype=dtype, device=x.device)
    return a.reshape(a.shape + (1,) * (x.ndim - a.ndim)) if a.ndim else a


def flow_match_step(x, v, sigma, sigma_next):
    """Euler step of the flow-matching ODE: x + (σ_next − σ)·v."""
    return x + (_per_sample(sigma_next, x, x.dtype) - _per_sample(sigma, x, x.dtype)) * v


def flow_sde_step(x, v, sigma, sigma_next, noise=None, prev_sample=None, eta=0.7):
    """Flow-GRPO SDE step (arXiv 2505.05470): returns (sample, mean, std (B,), log-prob (B,))."""
    dtype = _compute(x)
    xc, vc = x.to(dtype), v.to(dtype)
    s, s_next = _per_sample(sigma, x, dtype), _per_sample(sigma_next, x, dtype)
    dt = s_next - s
    std_t = eta * torch.sqrt(s / (1 - torch.where(s == 1, s_next, s)))
    mean = xc + (vc + std_t**2 / (2 * s) * (xc + (1 - s) * vc)) * dt
    std = std_t * torch.sqrt(-dt)
    sample = mean + std * noise.to(dtype) if prev_sample is None else prev_sample.to(dtype)
    logp = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    reduce = tuple(range(1, x.ndim))
    std_b = std.expand_as(logp).mean(dim=reduce)
    return sample.to(x.dtype), mean.to(x.dtype), std_b.to(x.dtype), logp.mean(dim=reduce).to(x.dtype)


def flow_renoise_step(x, v, sigma, sigma_next, noise):
    """x̂0 = x − σ·v re-noised to σ_next: (1 − σ_next)·x̂0 + σ_next·ε (DMD2's few-step rule)."""
    s, s_next = _per_sample(sigma, x, x.dtype), _per_sample(sigma_next, x, x.dtype)
    return (1 - s_next) * (x - s * v) + s_next * noise.to(x.dtype)


def flow_dpm_step(x, v, sigma, sigma_next, x0_prev, c):
    """DPM-Solver++(2M) step (see the reference): returns (x', x̂0), computed in float32 at least (three terms
    that mostly cancel, where bfloat16 would round each)."""
    dtype = _compute(x)
    xc = x.to(dtype)
    s, s_next = _per_sample(sigma, x, dtype), _per_sample(sigma_next, x, dtype)
    x0 = xc - s * v.to(dtype)
    ratio = s_next / s
    c = _per_sample(c, x, dtype)
    out = ratio * xc + (1 - ratio) * ((1 + c) * x0 - c * x0_prev.to(dtype))
    return out.to(x.dtype), x0.to(x.dtype)


def cfg_combine(v_uncond, v_cond, scale):
    """Classifier-free guidance: v_u + w·(v_c − v_u)."""
    return v_uncond + _per_sample(scale, v_cond, v_cond.dtype) * (v_cond - v_uncond)


_GELU_LINEAR = 2 * math.sqrt(2 / math.pi)  # ½(1 + tanh z) = σ(2z), z = √(2/π)·(x + 0.044715·x³)
_GELU_CUBIC = _GELU_LINEAR * 0.044715


def gelu_tanh(x):
    """GELU in its tanh form (the reference's formula). A float CPU tensor with no gradient to take gets the same
    function as x·σ(2z), in place on one temporary made by the first pass (c₁ + c₃·x·x, one addcmul): ATen's tanh
    GELU is ~1.5× slower (2.1 against 1.4 ms for a 2048 × 512 activation on the 2-core AVX2 EPYC) and about as
    accurate (largest error from float64 on a million N(0, 1) values 4.0e-7 against 4.3e-7); the addcmul saves two of
    six passes (133 against 163 µs for 1024 × 512 on the 2-core Zen 5)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or (
            torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate="tanh")
    return torch.addcmul(_gelu_linear(x.dtype), x, x, value=_GELU_CUBIC).mul_(x).sigmoid_().mul_(x)


@functools.cache
def _gelu_linear(dtype: torch.dtype) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor, whichever mode first asks for it
        return torch.tensor(_GELU_LINEAR, dtype=dtype)


def linear(x, weight, bias=None, activation=None):
    """x·Wᵀ + b, then `activation`. On a CPU, with nothing to differentiate, the tanh-GELU runs in oneDNN's
    product epilogue: ATen's own is the slowest op of a float32 DiT forward (~3 ms for a 2048×512 activation on
    the 2-core avx512 machine, against ~0.4 ms fused). Not on the AVX2 tier (`cpu_avx2.linear`)."""
    check_activation(activation)
    if activation is not None and fusable_on_cpu(x, weight, bias):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], "tanh")
    y = F.linear(x, weight, bias)
    return y if activation is None else gelu_tanh(y)


def onednn_can_compute(x, weight) -> bool:
    """Whether oneDNN's linear can compute this product: a CPU tensor in weight's dtype, outside autocast (which
    would change the dtype). bfloat16 only where oneDNN has bf16 kernels for this CPU (avx512_bf16 / AMX):
    elsewhere it cannot build the primitive."""
    return x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _onednn_linear_dtypes() \
        and not torch.is_autocast_enabled("cpu")


def fusable_on_cpu(x, weight, bias=None) -> bool:
    """Whether oneDNN's fused linear can compute this product (`onednn_can_compute`) with no gradient to take: the
    fused op has no backward."""
    return onednn_can_compute(x, weight) and not (torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))


@functools.cache
def has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _onednn_linear_dtypes() -> tuple:
    if not has_onednn_linear():
        return ()
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _short_on_cpu_training(q, k, v) -> bool:
    """Many short sequences on the CPU, with a backward to come: plain matmuls beat the fused kernel, whose
    backward is ~10× slower there for 16-token sequences (measured on the DiT's training step). Without a
    backward the fused kernel wins (2.5–3.6× on the sampler's shapes)."""
    return q.device.type == "cpu" and q.shape[-2] * k.shape[-2] <= 4096 and torch.is_grad_enabled() and \
        (q.requires_grad or k.requires_grad or v.requires_grad)


def attention_matmul(q, k, v, mask=None):
    """Attention written out: softmax(q·kᵀ/√d, masked)·v, in float32 for low-precision inputs; rows with nothing to
    attend to give zeros. Only those rows are zeroed (their softmax is NaN): a NaN from the inputs — a LoRA scale that
    overflows, weights gone bad in training — stays NaN, as in the numpy reference, so that it is caught, not hidden."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores.to(_compute(scores)), dim=-1)
    if mask is not None:
        weights = weights.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return weights.to(v.dtype) @ v


def attention(q, k, v, mask=None):
    """Scaled dot-product attention (fused SDPA, or matmuls for short CPU sequences in training); rows with
    nothing to attend to give zeros."""
    if mask is not None:
        mask = torch.as_tensor(mask, device=q.device, dtype=torch.bool)
    if _short_on_cpu_training(q, k, v):
        return attention_matmul(q, k, v, mask)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    anything = mask.any(dim=-1, keepdim=True)
    if anything.all():  # the usual case (every prompt has tokens): no zeroing pass
        return out
    return torch.where(anything, out, torch.zeros((), dtype=out.dtype, device=out.device))


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last dim."""
    if x.dtype in _LOW:
        return rms_norm(x.float(), weight, eps).to(x.dtype)
    out = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return out if weight is None else out * as_dtype(weight, out.dtype)


def modulated_layer_norm(x, shift, scale, eps=1e-6):
    """adaLN: LayerNorm without affine, then ·(1 + scale) + shift."""
    if x.dtype in _LOW:
        return modulated_layer_norm(x.float(), shift, scale, eps).to(x.dtype)
    return torch.addcmul(as_dtype(shift, x.dtype), F.layer_norm(x, x.shape[-1:], eps=eps), 1 + as_dtype(scale, x.dtype))


@functools.lru_cache(maxsize=64)
def _rope_rotations(grid: tuple[int, int, int], dim: int, theta: float, device: str, dtype: torch.dtype):
    """e^{iθ} per token and channel pair, (L, dim/2) complex; normal tensors even when first asked for under
    inference_mode, since training reuses the cached table."""
    with torch.inference_mode(False):
        angles = torch.from_numpy(rope_angles(grid, dim, theta))  # float64, computed once per grid
        return torch.polar(torch.ones_like(angles), angles).to(device=device, dtype=_COMPLEX[dtype])


def rope_3d(x, grid, theta=10000.0):
    """Wan2.1 3D RoPE on x (B, H, L, D): channel pairs (2i, 2i+1) as complex numbers, times e^{iθ} per token."""
    dtype = _compute(x)
    rotations = _rope_rotations(tuple(int(g) for g in grid), x.shape[-1], float(theta), str(x.device), dtype)
    pairs = x.to(dtype).unflatten(-1, (-1, 2))
    if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # view_as_complex needs pairs at even offsets
    return torch.view_as_real(torch.view_as_complex(pairs) * rotations).flatten(-2).to(x.dtype)


def timestep_embedding(t, dim, max_period=10000.0):
    """Sinusoidal timestep embedding, cos half first."""
    dtype = _compute(t) if t.is_floating_point() else torch.float32
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half)
    args = t.to(dtype)[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb.to(t.dtype) if t.is_floating_point() else emb


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """Mixed-adapter LoRA in one batched call: gather each sample's A, B and scale by index (−1 = none); with
    `index` None the weights are already one per sample (a plan gathered them once for many calls). The scale is
    folded into B and the delta accumulated into the base output by one batched multiply-add — in place under
    inference mode, where `y` is the caller's temporary (a linear layer's output)."""
    if lora_a.shape[0] == 0:
        return y
    lora_a, b = lora_per_row(lora_a, lora_b, scales, index, x.device)
    h = torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), lora_a.transpose(1, 2).to(x.dtype))  # (N, L, r)
    return add_lora_delta(y, h, b)


def lora_per_row(lora_a, lora_b, scales, index, device):
    """Each row's A (N, r, in) and B (N, out, r) times its scale: gathered by `index` (−1: an all-zero delta),
    or as given where `index` is None."""
    if index is not None:
        index = torch.as_tensor(index, device=device)
        picked = index.clamp(min=0)
        scales = torch.where(index >= 0, scales[picked], torch.zeros((), dtype=scales.dtype, device=device))
        lora_a, lora_b = lora_a[picked], lora_b[picked]
    return lora_a, lora_b if scales is None else lora_b * scales.to(lora_b.dtype)[:, None, None]


def add_lora_delta(y, h, lora_b):
    """y + h·Bᵀ per row, h (N, L, r) the down-projected input: in place on a sampler's temporary (inference mode),
    else a new tensor that autograd can differentiate."""
    rows, h, b = y.reshape(h.shape[0], -1, y.shape[-1]), as_dtype(h, y.dtype), as_dtype(lora_b.transpose(1, 2), y.dtype)
    if torch.is_inference_mode_enabled() and y.is_inference():
        return rows.baddbmm_(h, b).reshape(y.shape)
    return torch.baddbmm(rows, h, b).reshape(y.shape)
