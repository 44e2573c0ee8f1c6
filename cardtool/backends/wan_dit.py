"""The Wan2.1 DiT (arXiv 2503.20314) in torch, with diffusers' `WanTransformer3DModel` state-dict keys.

Shared time modulation `e0 = Linear(SiLU(e))` (B, 6, D), plus each block's learned bias (1, 6, D); gated
self-attention with qk-RMSNorm and 3D RoPE; ungated cross-attention to the projected text states; gated
FFN; a head modulated by e plus its own bias. Every primitive op (attention, norms, modulation, RoPE,
timestep embedding, GELU) comes from the platform's kernel table, so a faster kernel changes no code here.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cardtool.backends.platform import Platform
from cardtool.backends.registry import KERNELS
from cardtool.backends.wan_config import WanDiTConfig

__all__ = ["MIN_ROWS", "WanDiT", "Kernels", "TextContext", "name_linears", "patchify", "product"]

OPS = ("attention", "rms_norm", "modulated_layer_norm", "rope_3d", "timestep_embedding", "gelu_tanh", "lora_bgmv",
       "linear")
MIN_ROWS = 16  # the fewest rows a product is computed with (`product`)


class Kernels:
    """The resolved kernel ops a module calls, looked up once per platform (a dict lookup in the hot loop)."""

    def __init__(self, platform: Platform, variant: str = "default"):
        for op in OPS:
            setattr(self, op, KERNELS.resolve(op, platform, variant)[1])


def _random_table(rows: int, dim: int) -> torch.Tensor:
    """A modulation table's init, N(0, 1/dim). On the meta device (weights about to be assigned) it stays
    uninitialised: random ops on meta tensors run through torch._refs, whose first use imports torch._dynamo
    (~1 s of a one-image `generate`)."""
    table = torch.empty(1, rows, dim)
    return table if table.is_meta else torch.randn(1, rows, dim) / dim**0.5


class _Weight(nn.Module):
    """A learned per-channel weight (the RMSNorm gain), kept as a module for diffusers' key names."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class _MLP(nn.Module):
    """linear_1 → activation → linear_2 (diffusers' TimestepEmbedding and PixArtAlphaTextProjection)."""

    def __init__(self, d_in: int, d_out: int, activation, ops: Kernels):
        super().__init__()
        self.linear_1, self.linear_2, self.activation = nn.Linear(d_in, d_out), nn.Linear(d_out, d_out), activation
        self.ops = ops

    def forward(self, x, lora=None):
        return _linear(self.ops, self.linear_2, self.activation(_linear(self.ops, self.linear_1, x, lora)), lora)


class _ConditionEmbedder(nn.Module):
    def __init__(self, c: WanDiTConfig, ops: Kernels):
        super().__init__()
        self.time_embedder = _MLP(c.freq_dim, c.dim, F.silu, ops)
        self.time_proj = nn.Linear(c.dim, 6 * c.dim)
        self.text_embedder = _MLP(c.text_dim, c.dim, ops.gelu_tanh, ops)


class _Attention(nn.Module):
    def __init__(self, c: WanDiTConfig, ops: Kernels):
        super().__init__()
        self.heads, self.eps, self.ops = c.heads, c.eps, ops
        self.to_q, self.to_k, self.to_v = (nn.Linear(c.dim, c.dim) for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(c.dim, c.dim)])
        self.norm_q, self.norm_k = _Weight(c.dim), _Weight(c.dim)

    def keys_values(self, source, lora=None):
        """Keys (RMS-normed) and values of `source`, (B, H, L, Dh) each."""
        k = self.ops.rms_norm(_linear(self.ops, self.to_k, source, lora), self.norm_k.weight, self.eps)
        v = _linear(self.ops, self.to_v, source, lora)
        return tuple(t.unflatten(2, (self.heads, -1)).transpose(1, 2) for t in (k, v))

    def forward(self, x, kv=None, grid=None, mask=None, lora=None):
        """Self-attention with RoPE over `grid` when `kv` is None, else attention to the given keys and values."""
        q = self.ops.rms_norm(_linear(self.ops, self.to_q, x, lora), self.norm_q.weight, self.eps)
        q = q.unflatten(2, (self.heads, -1)).transpose(1, 2)
        k, v = self.keys_values(x, lora) if kv is None else kv
        if grid is not None:
            q, k = self.ops.rope_3d(q, grid), self.ops.rope_3d(k, grid)
        out = self.ops.attention(q, k, v, None if mask is None else mask[:, None, None, :])
        return _linear(self.ops, self.to_out[0], out.transpose(1, 2).flatten(2), lora)


class _FeedForward(nn.Module):
    def __init__(self, c: WanDiTConfig, ops: Kernels):
        super().__init__()
        self.ops = ops
        up = nn.Module()
        up.proj = nn.Linear(c.dim, c.ffn_dim)
        self.net = nn.ModuleList([up, nn.Identity(), nn.Linear(c.ffn_dim, c.dim)])

    def forward(self, x, lora=None):
        hidden = _linear(self.ops, self.net[0].proj, x, lora, activation="gelu_tanh")
        return _linear(self.ops, self.net[2], hidden, lora)


class _Block(nn.Module):
    def __init__(self, c: WanDiTConfig, ops: Kernels):
        super().__init__()
        self.eps, self.ops = c.eps, ops
        self.attn1, self.attn2 = _Attention(c, ops), _Attention(c, ops)
        self.norm2 = nn.LayerNorm(c.dim, eps=c.eps) if c.cross_attn_norm else None
        self.ffn = _FeedForward(c, ops)
        self.scale_shift_table = nn.Parameter(_random_table(6, c.dim))

    def forward(self, x, text_kv, modulation, grid, text_mask, lora=None):
        """`text_kv`: the cross-attention's (keys, values), or the projected text states to compute them from here
        (inside the block's own forward, where a sharded block has its weights gathered)."""
        if not isinstance(text_kv, tuple):
            text_kv = self.attn2.keys_values(text_kv, lora)
        shift, scale, gate, c_shift, c_scale, c_gate = (self.scale_shift_table + modulation).chunk(6, dim=1)
        x = x + self.attn1(self.ops.modulated_layer_norm(x, shift, scale, self.eps), grid=grid, lora=lora) * gate
        # an affine LayerNorm is adaLN with shift = bias and scale = weight − 1
        normed = x if self.norm2 is None else \
            self.ops.modulated_layer_norm(x, self.norm2.bias, self.norm2.weight - 1, self.eps)
        x = x + self.attn2(normed, text_kv, mask=text_mask, lora=lora)
        return x + self.ffn(self.ops.modulated_layer_norm(x, c_shift, c_scale, self.eps), lora) * c_gate


class WanDiT(nn.Module):
    """Velocity model v(x_t, t, text): latents (B, C, F, H, W), timesteps t (B,) in [0, 1000], text states
    (B, Lt, text_dim) zero beyond each prompt, and the boolean mask (B, Lt) of real tokens — which cross-attention
    uses only when the config says `text_mask: true`; by default it attends to every token, as Wan2.1 does.
    `text_context`, from `text_context(text)`, skips recomputing the text's keys and values.

    Per-row adapters (DESIGN.md invariant 7): `lora`, a LoraPlan, adds each row's own LoRA delta to every linear
    layer it names; `control`, a list of ControlRows, adds a ControlNet's residuals to the rows it conditions."""

    def __init__(self, config: WanDiTConfig, platform: Platform, variant: str = "default"):
        super().__init__()
        self.config, self.ops = config, Kernels(platform, variant)
        c = config
        self.patch_embedding = nn.Conv3d(c.in_channels, c.dim, kernel_size=c.patch, stride=c.patch)
        self.condition_embedder = _ConditionEmbedder(c, self.ops)
        self.blocks = nn.ModuleList([_Block(c, self.ops) for _ in range(c.depth)])
        self.proj_out = nn.Linear(c.dim, c.out_channels * math.prod(c.patch))
        self.scale_shift_table = nn.Parameter(_random_table(2, c.dim))
        nn.init.zeros_(self.proj_out.weight)  # the head starts at zero: an untrained model predicts v = 0
        nn.init.zeros_(self.proj_out.bias)
        name_linears(self)

    def text_context(self, text, lora=None) -> TextContext:
        """The projected text states and every block's cross-attention keys and values for the text states
        (B, Lt, text_dim): they do not change over a denoising run, so a sampler computes them once and passes
        them to each step's forward."""
        context = self.condition_embedder.text_embedder(text, lora)
        return TextContext(context, [block.attn2.keys_values(context, lora) for block in self.blocks])

    def embed(self, x, t, lora=None):
        """Patch tokens (B, L, D) in (f, h, w) order, the time embedding (B, D) and the blocks' modulation
        (B, 6, D)."""
        c, embedder = self.config, self.condition_embedder
        h = patchify(self.ops, self.patch_embedding, x)
        freq = self.ops.timestep_embedding(t, c.freq_dim).to(embedder.time_embedder.linear_1.weight.dtype)
        temb = embedder.time_embedder(freq, lora)
        modulation = _linear(self.ops, embedder.time_proj, F.silu(temb), lora).unflatten(1, (6, c.dim))
        return h, temb, modulation

    def grid(self, x) -> tuple[int, int, int]:
        pt, ph, pw = self.config.patch
        return x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw

    def forward(self, x, t, text, text_mask=None, text_context=None, lora=None, control=None):
        c = self.config
        text_mask = text_mask if c.text_mask else None  # Wan2.1 attends to every (zero-padded) token
        batch, _, frames, height, width = x.shape
        pt, ph, pw = c.patch
        grid = self.grid(x)
        h, temb, modulation = self.embed(x, t, lora)
        if text_context is None:  # each block computes its own keys and values from the projected text
            context = self.condition_embedder.text_embedder(text, lora)
            text_context = TextContext(context, [context] * len(self.blocks))
        residuals = [branch(h, modulation, text_context.context, grid, text_mask) for branch in control or ()]
        for i, (block, kv) in enumerate(zip(self.blocks, text_context.keys_values, strict=True)):
            h = block(h, kv, modulation, grid, text_mask, lora)
            for rows, outputs in residuals:
                if i < len(outputs):
                    h = h.index_add(0, rows, outputs[i].to(h.dtype))
        shift, scale = (self.scale_shift_table + temb[:, None]).chunk(2, dim=1)
        h = _linear(self.ops, self.proj_out, self.ops.modulated_layer_norm(h, shift, scale, c.eps), lora)
        h = h.reshape(batch, *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return h.reshape(batch, -1, frames, height, width)


class TextContext(NamedTuple):
    context: torch.Tensor  # the projected text states (B, Lt, D)
    keys_values: list  # each block's cross-attention (k, v)

    def rows(self, index: torch.Tensor) -> TextContext:
        """The context of the text rows `index` picks, laid out as if computed for them: keys and values gathered
        in their (B, L, H, Dh) order and transposed back, with the strides attention sees for computed ones."""
        def pick(t):
            return t.transpose(1, 2)[index].transpose(1, 2)

        return TextContext(self.context[index], [tuple(map(pick, kv)) for kv in self.keys_values])


def name_linears(model: nn.Module) -> None:
    """Give each linear layer its state-dict module name, the key a LoRA plan looks its weights up by."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.lora_name = name


def product(ops: Kernels, x, weight, bias=None, activation=None):
    """The kernel table's linear, batch-invariant where the BLAS is for large products: one of fewer than MIN_ROWS
    rows (the time embedding of a few requests) is zero-padded to MIN_ROWS, since BLAS libraries compute small
    products with other kernels (GEMV, small-M paths) that round differently — without it a request's modulation,
    and so its image, depends on how many requests share its forward (the parity ladder's C2)."""
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return ops.linear(x, weight, bias, activation)
    padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, MIN_ROWS - rows))
    return ops.linear(padded, weight, bias, activation)[:rows].reshape(*x.shape[:-1], weight.shape[0])


def patchify(ops: Kernels, conv: nn.Conv3d, x):
    """Tokens (B, L, D) in (f, h, w) order of a Conv3d whose kernel is its stride (the patch embedding), computed
    as one product over the patches: the convolution's value, but oneDNN's convolution rounds differently for
    different batch sizes and the product does not (C2)."""
    b, channels, f, h, w = x.shape
    pt, ph, pw = conv.kernel_size
    patches = x.reshape(b, channels, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return product(ops, patches.reshape(b, -1, channels * pt * ph * pw), conv.weight.reshape(conv.out_channels, -1),
                   conv.bias)


def _linear(ops: Kernels, layer: nn.Linear, x, lora, activation=None):
    """`layer` through the kernel table's linear, with each row's LoRA delta added before the activation. A row
    whose stack has no LoRA here gets the bits it gets in a batch with none (C2): the table's linear may fuse the
    activation into its product, which rounds differently from the activation apart."""
    if lora is None or not getattr(lora, "touches", lambda _: True)(layer.lora_name):
        return product(ops, x, layer.weight, layer.bias, activation)
    y = lora(layer.lora_name, x, product(ops, x, layer.weight, layer.bias))
    if activation is None:
        return y
    y, plain = ops.gelu_tanh(y), getattr(lora, "plain_rows", lambda _: None)(layer.lora_name)
    if plain is None:
        return y
    return y.index_copy(0, plain, product(ops, x.index_select(0, plain), layer.weight, layer.bias, activation))
