"""bfloat16 variants for CPUs with avx512_bf16 (and AMX), for a sampler running at bfloat16 precision (torch
autocast): each computes its op at bfloat16 accuracy the fastest way this tier allows, and hands on the dtype its
consumer computes in, so no tensor is cast twice: the norms that feed matrix products return bfloat16 (the
rounding autocast would apply before each product, done once instead of once per product), the ones that feed
RoPE return float32 (RoPE computes in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cardtool.backends import torch_ops

__all__ = ["attention", "lora_bgmv", "gelu_tanh", "linear", "modulated_layer_norm", "rms_norm"]

# Below this many keys oneDNN's bfloat16 flash attention loses to float32's (measured on the 2-core
# avx512_bf16 machine, 4 heads 32 wide, bf16 speed over float32: 0.69× at 16 keys, 0.79× at 49 — fashion-base's
# 7×7 tokens — 1.24× at 64, 2× at 256).
SHORT_KEYS = 56


def attention(q, k, v, mask=None):
    """Scaled dot-product attention at bfloat16 accuracy: products in bfloat16, except for short key sequences,
    which run in float32 (faster there, and exact)."""
    if k.shape[-2] < SHORT_KEYS:
        with torch.autocast("cpu", enabled=False):  # autocast would send SDPA back to bfloat16
            return torch_ops.attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
    bf16 = torch.bfloat16
    return torch_ops.attention(q.to(bf16), k.to(bf16), v.to(bf16), mask).to(q.dtype)


def modulated_layer_norm(x, shift, scale, eps=1e-6):
    """adaLN in float32, rounded once to bfloat16 for the products it feeds (q, k, v; the FFN; the head)."""
    return torch_ops.modulated_layer_norm(x.float(), shift, scale, eps).to(torch.bfloat16)


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm in float32, kept in float32 for RoPE (which computes in float32) and attention."""
    return torch_ops.rms_norm(x.float(), weight, eps)


def gelu_tanh(x):
    """The tanh-form GELU at bfloat16 accuracy, computed with the erf form: the two differ by at most 4.7e-4,
    a sixteenth of one bfloat16 rounding step at the size (|x| ≈ 2) where they differ most, and PyTorch's erf
    GELU is ~4× faster than its tanh form on this tier."""
    return F.gelu(x.to(torch.bfloat16)).to(x.dtype)


def linear(x, weight, bias=None, activation=None):
    """The product in bfloat16 (autocast's rounding; the weights were rounded once at load), then this tier's
    GELU. oneDNN's fused product-and-GELU, 2.6× faster than float32's unfused tanh GELU layer, measured no faster
    than this in bfloat16."""
    y = F.linear(x, weight, bias)
    return y if activation is None else gelu_tanh(y)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """Mixed-adapter LoRA with the two low-rank products in bfloat16, added to the base output in its dtype."""
    bf16 = torch.bfloat16
    delta = torch_ops.lora_bgmv(x.to(bf16), torch.zeros_like(y, dtype=bf16), lora_a.to(bf16), lora_b.to(bf16),
                                scales if scales is None else scales.to(bf16), index)
    return y + delta.to(y.dtype)
