"""ControlNet for the Wan DiT, PixArt / SD3 style (Zhang et al. 2023, arXiv 2302.05543; Chen et al. 2024,
PixArt-δ, arXiv 2401.05252): a trainable copy of the base's first N blocks whose input is the base's patch tokens
plus the control latent through a zero-initialised patch projection; after each branch block a zero-initialised
linear output, times `conditioning_scale`, is added to the base's hidden states after the same block. At init the
branch changes nothing; the base stays frozen."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import Kernels, WanDiT, _Block, name_linears, patchify

__all__ = ["WanControlNet", "ControlRows"]


class WanControlNet(nn.Module):
    """The branch: `control_embedding` (zero-init Conv3d patchifier of the control latent), `blocks` (copies of
    the base's first `depth` blocks) and `controlnet_blocks` (zero-init linear outputs), diffusers' SD3 names."""

    def __init__(self, config: WanDiTConfig, depth: int, platform: Platform, variant: str = "default"):
        super().__init__()
        self.config, self.depth = config, depth
        ops = Kernels(platform, variant)
        c = config
        self.control_embedding = nn.Conv3d(c.in_channels, c.dim, kernel_size=c.patch, stride=c.patch)
        self.blocks = nn.ModuleList([_Block(c, ops) for _ in range(depth)])
        self.controlnet_blocks = nn.ModuleList([nn.Linear(c.dim, c.dim) for _ in range(depth)])
        for module in [self.control_embedding, *self.controlnet_blocks]:
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)
        name_linears(self)

    @classmethod
    def from_base(cls, base: WanDiT, depth: int, platform: Platform) -> WanControlNet:
        """A branch whose blocks start as copies of the base's first `depth` blocks."""
        if not 1 <= depth <= len(base.blocks):
            raise ValueError(f"a ControlNet copies 1…{len(base.blocks)} blocks, not {depth}")
        net = cls(base.config, depth, platform).to(next(base.parameters()).device)
        for i in range(depth):
            net.blocks[i].load_state_dict(base.blocks[i].state_dict())
        return net

    def forward(self, h, control, modulation, context, grid, text_mask):
        """The residual after each branch block, (B, L, D) each, for base tokens `h` and control latents."""
        h = h + patchify(self.blocks[0].ops, self.control_embedding, control.to(h.dtype))
        outputs = []
        for block, out in zip(self.blocks, self.controlnet_blocks, strict=True):
            h = block(h, block.attn2.keys_values(context), modulation, grid, text_mask)
            outputs.append(out(h))
        return outputs


@dataclass
class ControlRows:
    """One ControlNet's work in a batch: the rows it conditions, their control latents (k, C, F, H, W) and
    conditioning scales (k,). Rows of other requests are untouched."""

    net: WanControlNet
    rows: torch.Tensor
    latents: torch.Tensor
    scales: torch.Tensor

    def __call__(self, h, modulation, context, grid, text_mask):
        mask = None if text_mask is None else text_mask[self.rows]
        outputs = self.net(h[self.rows], self.latents, modulation[self.rows], context[self.rows], grid, mask)
        scales = self.scales[:, None, None]
        return self.rows, [o * scales.to(o.dtype) for o in outputs]
