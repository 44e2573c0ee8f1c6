"""Cells for AMD's AVX-512 cores (Zen 4 on: avx512_bf16 on an AuthenticAMD CPU), where the avx512_bf16 tier's
choices, measured on Intel machines, are slow: there ATen's float32 products go to MKL, which on a CPU that is not
Intel's takes its AVX2 code, while oneDNN picks its kernels by instruction set and runs AVX-512.

Measured on a 2-core Zen 5 EPYC (fashion-base's shapes: 2,048 rows, medians of 100 calls): a float32 linear
128 → 512 takes 1.33 ms through `F.linear` and 0.61 ms through oneDNN; in bfloat16, the product and the FFN's tanh
GELU fused by oneDNN take 0.52 ms against 1.67 ms for the product and ATen's GELU apart. Attention over fashion-base's
16 tokens written out as two batched products and a softmax: a 64-image loop of 0.40–0.46 s against 0.51–0.59 s with
the fused (flash) kernel in float32, 0.33–0.34 against 0.42–0.43 s in bfloat16 (processes of one precision, the other
cells these) — for a few dozen tokens the score matrix is a few kilobytes a head, so the fused kernel saves no memory.
The Intel avx512_bf16 machines measured the reverse (the fused kernel 2.5–3.6× faster in float32), so these cells stay
off that tier. oneDNN costs more per call than MKL on small products (17.8 against 10.1 µs for 32 rows of 128 → 128;
MKL is faster up to about 8,192 outputs), which made a one-image loop 10–20% slower with these cells. A small product
goes to MKL where that gives oneDNN's bits — tried once per shape: so for every product of at most 128 inputs on the
Zen 5, never for 256 or more, which the two libraries block differently — so a request alone still gets the bits it
gets in a batch (C2): a one-image float32 loop 0.045–0.055 s against 0.051–0.065 (minima of 15 runs, four alternated
pairs of processes).

Zen 4's AVX-512 units run a 512-bit instruction as two 256-bit halves, so there oneDNN's float32 products gain
little over MKL's AVX2 code (2-core Zen 4, 2,048 rows: 1.29 against 1.36 ms for 128 → 512) and still cost more per
call: fashion-base's forward with this float32 `linear` against the avx512_bf16 tier's, alternated in one process,
4.10 against 3.57 ms for one image with CFG, 13.6 against 12.8 for 16, 40.6 against 41.9 for 64. So that `linear` is
the zen5 tier's (family 26 on, full-width units); the rest here is both tiers'.
"""

from __future__ import annotations

import torch

from cardtool.backends import cpu_bf16, torch_ops
from cardtool.backends.reference import check_activation

__all__ = ["attention", "attention_bf16", "linear", "linear_bf16", "lora_bgmv"]

SHORT = 4096  # query × key tokens at most (64 × 64): where the score matrix is small enough to write out


def _onednn(x, weight, bias, activation):
    mode = ("gelu", [], "tanh") if activation == "gelu_tanh" else ("none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, *mode)


class _Product(torch.autograd.Function):
    """x·Wᵀ + b through oneDNN, with a backward (oneDNN's op has none): the input's gradient g·W through oneDNN too,
    the weight's gᵀ·x and the bias's by ATen — oneDNN would need both of gᵀ·x's operands copied transposed first.
    A fashion-base forward and backward on 64 images in float32: 63 against 80 ms with ATen's products."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias, None)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = _onednn(grad, weight.t().contiguous(), None, None) if ctx.needs_input_grad[0] else None
        grad_w = rows.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


SMALL = 8192  # rows × outputs up to which oneDNN's cost per call outweighs its faster code (module docstring)
_SAME_BITS: dict[tuple, bool] = {}  # per product shape: whether MKL gives oneDNN's bits for it on this machine


def _mkl_gives_its_bits(x, weight, bias) -> bool:
    """Whether this small product may go to MKL: where its sum is blocked as oneDNN's (every product of at most 128
    inputs here; none of 256 or more), the two give the same bits, so which library computed a row cannot show and a
    request alone still gets the bits it gets in a batch (C2). Tried once per shape, layout and thread count, on
    seeded numbers: the kernels either library picks depend on those, not on the values. Only for a contiguous
    input (a strided one, an expanded one, may take other kernels)."""
    if not x.is_contiguous():
        return False
    key = (tuple(x.shape), x.data_ptr() % 64, tuple(weight.shape), weight.stride(), bias is not None,
           torch.get_num_threads())
    same = _SAME_BITS.get(key)
    if same is None:
        generator = torch.Generator().manual_seed(0)
        probe = torch.empty(x.shape, dtype=x.dtype).normal_(generator=generator)
        same = probe.data_ptr() % 64 == key[1] and torch.equal(
            torch.nn.functional.linear(probe, weight, bias), _onednn(probe, weight, bias, None))
        _SAME_BITS[key] = same
    return same


def linear(x, weight, bias=None, activation=None):
    """x·Wᵀ + b, then `activation`, through oneDNN wherever it can compute it: fused with the GELU where there is no
    gradient to take, else the product with its own backward (float32 outside autocast; autocast's bfloat16
    products are oneDNN's already); elsewhere the generic cell. A small float32 product with nothing to fuse goes to
    MKL where MKL gives oneDNN's bits for it (`_mkl_gives_its_bits`)."""
    check_activation(activation)
    if torch_ops.fusable_on_cpu(x, weight, bias):
        if (activation is None and x.dtype == torch.float32 and x.numel() // x.shape[-1] * weight.shape[0] <= SMALL
                and _mkl_gives_its_bits(x, weight, bias)):
            return torch.nn.functional.linear(x, weight, bias)
        return _onednn(x, weight, bias, activation)
    if x.dtype == torch.float32 and torch_ops.onednn_can_compute(x, weight) and (bias is None or bias.dtype == x.dtype):
        y = _Product.apply(x, weight, bias)
        return y if activation is None else torch_ops.gelu_tanh(y)
    return torch_ops.linear(x, weight, bias, activation)


def linear_bf16(x, weight, bias=None, activation=None):
    """The product in bfloat16 (the weights were rounded once at load; x rounded as autocast would), with the tanh
    GELU in oneDNN's epilogue, handing on bfloat16 as autocast's product does."""
    check_activation(activation)
    if weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != torch.bfloat16):
        return cpu_bf16.linear(x, weight, bias, activation)
    with torch.autocast("cpu", enabled=False):  # autocast would make oneDNN's inputs float32 again
        rounded = x.to(torch.bfloat16)
        if not torch_ops.fusable_on_cpu(rounded, weight, bias):  # e.g. no bfloat16 oneDNN on this CPU
            return cpu_bf16.linear(rounded, weight, bias, activation)
        return _onednn(rounded, weight, bias, activation)


def lora_bgmv(x, y, lora_a, lora_b, scales, index):
    """The generic kernel's LoRA with the down-projection computed transposed, A·xᵀ (r × tokens per row): MKL, which
    runs its AVX2 code on AMD's cores, is 1.4–1.6× faster at that than at x·Aᵀ, whose rank-wide output it computes
    with a skinny kernel (2-core Zen 5, 8 rows of 128–256 tokens, 128 or 512 inputs → rank 8). A is read by rows,
    (N, r, in), the layout a LoraPlan stores for this kernel (`a_by_rows`)."""
    if lora_a.shape[0] == 0:
        return y
    if index is not None or scales is not None:
        lora_a, lora_b = torch_ops.lora_per_row(lora_a, lora_b, scales, index, x.device)
    tokens = x.reshape(x.shape[0], -1, x.shape[-1])
    h = torch.bmm(torch_ops.as_dtype(lora_a, x.dtype), tokens.transpose(1, 2)).transpose(1, 2)  # (N, L, r), a view
    return torch_ops.add_lora_delta(y, h, lora_b)


lora_bgmv.a_by_rows = True


def _short(q, k) -> bool:
    return q.shape[-2] * k.shape[-2] <= SHORT


def attention(q, k, v, mask=None):
    """Scaled dot-product attention, written out for short sequences (rows with nothing to attend to give zeros)."""
    if not _short(q, k):
        return torch_ops.attention(q, k, v, mask)
    return torch_ops.attention_matmul(q, k, v, None if mask is None else torch.as_tensor(mask, dtype=torch.bool))


def attention_bf16(q, k, v, mask=None):
    """Attention at bfloat16 accuracy: short sequences written out in float32 (exact, and as fast here as with the
    products in bfloat16: 0.342 against 0.339 s a 64-image loop), longer ones as the avx512_bf16 tier's cell."""
    if not _short(q, k):
        return cpu_bf16.attention(q, k, v, mask)
    with torch.autocast("cpu", enabled=False):  # autocast would run the products in bfloat16
        return attention(q.float(), k.float(), v.float(), mask).to(q.dtype)
