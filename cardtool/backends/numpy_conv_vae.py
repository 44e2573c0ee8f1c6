"""The numpy reference decode of the conv VAE, over the same safetensors state dict as conv_vae.py."""

from __future__ import annotations

import numpy as np

from cardtool.backends.numpy_wan_dit import silu
from cardtool.backends.vae_config import ConvVAEConfig

__all__ = ["NumpyVAEDecoder", "conv2d", "group_norm"]


def conv2d(x, weight, bias, padding=1):
    """Stride-1 2D convolution (cross-correlation, as torch) of x (B, Cin, H, W) by weight (Cout, Cin, k, k)."""
    k = weight.shape[-1]
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(2, 3))  # (B, Cin, H, W, k, k)
    return np.einsum("bchwij,ocij->bohw", windows, weight, optimize=True) + bias[None, :, None, None]


def group_norm(x, groups, weight, bias, eps=1e-5):
    b, c, h, w = x.shape
    g = x.reshape(b, groups, -1)
    g = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    return g.reshape(b, c, h, w) * weight[None, :, None, None] + bias[None, :, None, None]


class NumpyVAEDecoder:
    """decode(latents (B, C, 8, 8)) → images (B, 1, 28, 28), unscaled latents as ConvVAE.decode."""

    def __init__(self, config: ConvVAEConfig, state: dict[str, np.ndarray]):
        self.config, self.state = config, state

    def _conv(self, name, x):
        return conv2d(x, self.state[f"{name}.weight"], self.state[f"{name}.bias"])

    def _norm(self, name, x):
        channels = x.shape[1]
        return group_norm(x, min(8, channels), self.state[f"{name}.weight"], self.state[f"{name}.bias"])

    def _res(self, name, x):
        h = self._conv(f"{name}.conv1", silu(self._norm(f"{name}.norm1", x)))
        return x + self._conv(f"{name}.conv2", silu(self._norm(f"{name}.norm2", h)))

    def decode(self, latents):
        c = self.config
        h = self._res("decoder.mid", self._conv("decoder.conv_in", latents))
        for i in range(len(c.channels) - 1):
            h = h.repeat(2, axis=2).repeat(2, axis=3)  # nearest-neighbour ×2
            h = self._res(f"decoder.up.{i}.res", self._conv(f"decoder.up.{i}.conv", h))
        h = self._conv("decoder.conv_out", silu(self._norm("decoder.norm_out", h)))
        low = (c.padded_size - c.image_size) // 2
        return h[..., low:low + c.image_size, low:low + c.image_size]
