"""float32 variants for the AVX2 CPU tier: the same values, computed the way that is fastest there."""

from __future__ import annotations

import torch.nn.functional as F

from cardtool.backends import torch_ops
from cardtool.backends.reference import check_activation

__all__ = ["linear", "lora_bgmv"]


def linear(x, weight, bias=None, activation=None):
    """x·Wᵀ + b, then `activation` apart from the product: oneDNN's fused GELU epilogue, cheap on the avx512 tiers,
    here costs as much as the product it follows (the DiT's FFN 128 → 512 on 2,048 rows, 2-core AVX2 EPYC, medians of
    25 rounds: 6.7 ms fused against 4.9 ms for the product, 3.3 ms, and `gelu_tanh` apart)."""
    check_activation(activation)
    y = F.linear(x, weight, bias)
    return y if activation is None else torch_ops.gelu_tanh(y)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """The generic kernel with A laid out as (N, r, in), rows along the input, whatever layout it came in: its
    down-projection x·Aᵀ is then 2× faster here (99 against 197 µs for 8 blocks of 256 × 128 → 8) than from Aᵀ
    contiguous, the layout the avx512 Xeon prefers by 20–45%. The zen4 tier takes it too, MKL running its AVX2 code
    there (2-core Zen 5 EPYC, 8 blocks of 128 × 128 → 8: 28 against 55 µs; of 128 × 512 → 8: 95 against 255 µs). A
    LoraPlan stores A so for this kernel (`a_by_rows`), so the copy is only made for other callers."""
    return torch_ops.lora_bgmv(x, y, lora_a.contiguous(), lora_b, scales, index)


lora_bgmv.a_by_rows = True
