"""bfloat16 variants for CPUs without bf16 compute (the avx2 tier), for a sampler running at bfloat16 precision:
there ATen's bfloat16 matrix products take a slow generic path — 4.1 ms against float32's 0.38 ms for the DiT's
linears on a 2-core AVX2 EPYC, which made a bf16 generation 4.6× slower than float32. These compute the product of the
bf16-rounded operands in float32 — every product of two bf16 numbers is exact in float32 and the sums run in float32,
as a bf16 GEMM accumulates — and round the result to bfloat16, as autocast's product would be. The other ops reuse
the avx512_bf16 tier's variants: the norms in float32, attention in float32 below 56 keys (every sequence of the
built-in cards) but in bf16 above, and the GELU in bf16 — correct here, though not emulated (not measured here
against float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cardtool.backends import torch_ops
from cardtool.backends.cpu_bf16 import attention, gelu_tanh, modulated_layer_norm, rms_norm

__all__ = ["attention", "gelu_tanh", "linear", "lora_bgmv", "modulated_layer_norm", "rms_norm"]


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def linear(x, weight, bias=None, activation=None):
    """x·Wᵀ + b at bfloat16 accuracy, computed in float32; the GELU (erf form, as the avx512_bf16 tier's) on the
    float32 product before the one rounding."""
    with torch.autocast("cpu", enabled=False):
        y = F.linear(_rounded(x), _rounded(weight), None if bias is None else _rounded(bias))
        if activation is not None:
            y = F.gelu(y)
    return y.to(torch.bfloat16)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """Mixed-adapter LoRA on bf16-rounded operands, computed in float32; the delta rounded to bfloat16 and added to
    the base output in its dtype (as the avx512_bf16 tier's)."""
    with torch.autocast("cpu", enabled=False):
        delta = torch_ops.lora_bgmv(_rounded(x), torch.zeros(y.shape, dtype=torch.float32, device=y.device),
                                    _rounded(lora_a), _rounded(lora_b), None if scales is None else _rounded(scales),
                                    index)
    return y + delta.to(torch.bfloat16).to(y.dtype)
