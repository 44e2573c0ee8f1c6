"""A small convolutional VAE (Kingma & Welling 2014) for 1×28×28 images in [−1, 1]: residual conv levels
down to a latent_channels×8×8 Gaussian posterior, and the mirrored decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cardtool.backends.vae_config import ConvVAEConfig

__all__ = ["ConvVAE"]


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(8, channels), channels)


class _Res(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm1, self.conv1 = _norm(channels), nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2, self.conv2 = _norm(channels), nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(x))))))


class _Encoder(nn.Module):
    def __init__(self, c: ConvVAEConfig):
        super().__init__()
        ch = c.channels
        self.conv_in = nn.Conv2d(c.image_channels, ch[0], 3, padding=1)
        self.down = nn.ModuleList()
        for i in range(len(ch) - 1):
            level = nn.Module()
            level.res, level.downsample = _Res(ch[i]), nn.Conv2d(ch[i], ch[i + 1], 3, stride=2, padding=1)
            self.down.append(level)
        self.mid, self.norm_out = _Res(ch[-1]), _norm(ch[-1])
        self.conv_out = nn.Conv2d(ch[-1], 2 * c.latent_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for level in self.down:
            h = level.downsample(level.res(h))
        return self.conv_out(F.silu(self.norm_out(self.mid(h))))


class _Decoder(nn.Module):
    def __init__(self, c: ConvVAEConfig):
        super().__init__()
        ch = c.channels
        self.conv_in = nn.Conv2d(c.latent_channels, ch[-1], 3, padding=1)
        self.mid = _Res(ch[-1])
        self.up = nn.ModuleList()
        for i in range(len(ch) - 1, 0, -1):
            level = nn.Module()
            level.conv, level.res = nn.Conv2d(ch[i], ch[i - 1], 3, padding=1), _Res(ch[i - 1])
            self.up.append(level)
        self.norm_out, self.conv_out = _norm(ch[0]), nn.Conv2d(ch[0], c.image_channels, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for level in self.up:
            h = level.res(level.conv(F.interpolate(h, scale_factor=2, mode="nearest")))
        return self.conv_out(F.silu(self.norm_out(h)))


class ConvVAE(nn.Module):
    """encode(images) → (mean, logvar) of the posterior; decode(latents) → images. Unscaled latents:
    multiply by `config.scaling_factor` before the DiT and divide after."""

    def __init__(self, config: ConvVAEConfig):
        super().__init__()
        self.config = config
        self.encoder, self.decoder = _Encoder(config), _Decoder(config)

    def _pad(self) -> tuple[int, int]:
        total = self.config.padded_size - self.config.image_size
        return total // 2, total - total // 2

    def encode(self, images):
        low, high = self._pad()
        padded = F.pad(images, (low, high, low, high), value=-1.0)  # −1 is the background
        mean, logvar = self.encoder(padded).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, latents):
        low, _ = self._pad()
        size = self.config.image_size
        return self.decoder(latents)[..., low:low + size, low:low + size]

    def forward(self, images, generator=None):
        """Reconstruct through a posterior sample: returns (reconstruction, mean, logvar)."""
        mean, logvar = self.encode(images)
        noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=mean.device)
        return self.decode(mean + (0.5 * logvar).exp() * noise), mean, logvar
