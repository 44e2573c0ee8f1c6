"""bfloat16 variants of the matmul-heavy ops for CPUs with avx512_bf16, where oneDNN runs bf16 matmuls
about twice as fast as float32. Inputs and outputs keep their dtype; the products run in bfloat16."""

from __future__ import annotations

import torch

from cardtool.backends import torch_ops

__all__ = ["attention", "lora_bgmv"]


def attention(q, k, v, mask=None):
    """Scaled dot-product attention computed in bfloat16."""
    bf16 = torch.bfloat16
    return torch_ops.attention(q.to(bf16), k.to(bf16), v.to(bf16), mask).to(q.dtype)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """Mixed-adapter LoRA with the two low-rank products in bfloat16, added to the base output in its dtype."""
    bf16 = torch.bfloat16
    delta = torch_ops.lora_bgmv(x.to(bf16), torch.zeros_like(y, dtype=bf16), lora_a.to(bf16), lora_b.to(bf16),
                                scales, index)
    return y + delta.to(y.dtype)
