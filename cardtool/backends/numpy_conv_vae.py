"""The numpy reference forward of the conv VAE (encode and decode), over the same safetensors state dict as
conv_vae.py."""

from __future__ import annotations

import numpy as np

from cardtool.backends.numpy_wan_dit import silu
from cardtool.backends.vae_config import ConvVAEConfig

__all__ = ["NumpyConvVAE", "conv2d", "group_norm"]


def conv2d(x, weight, bias, padding=1, stride=1):
    """2D convolution (cross-correlation, as torch) of x (B, Cin, H, W) by weight (Cout, Cin, k, k): the windows
    every `stride` pixels of the zero-padded input."""
    k = weight.shape[-1]
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (k, k), axis=(2, 3))  # (B, Cin, H, W, k, k)
    windows = windows[:, :, ::stride, ::stride]
    return np.einsum("bchwij,ocij->bohw", windows, weight, optimize=True) + bias[None, :, None, None]


def group_norm(x, groups, weight, bias, eps=1e-5):
    b, c, h, w = x.shape
    g = x.reshape(b, groups, c // groups * h * w)  # not −1: an empty batch has no size to infer it from
    g = (g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + eps)
    return g.reshape(b, c, h, w) * weight[None, :, None, None] + bias[None, :, None, None]


class NumpyConvVAE:
    """encode(images (B, 1, 28, 28)) → (mean, logvar) of the posterior, decode(latents (B, C, 8, 8)) → images;
    unscaled latents, as ConvVAE."""

    def __init__(self, config: ConvVAEConfig, state: dict[str, np.ndarray]):
        self.config, self.state = config, state

    def _conv(self, name, x, stride=1):
        return conv2d(x, self.state[f"{name}.weight"], self.state[f"{name}.bias"], stride=stride)

    def _norm(self, name, x):
        channels = x.shape[1]
        return group_norm(x, min(8, channels), self.state[f"{name}.weight"], self.state[f"{name}.bias"])

    def _res(self, name, x):
        h = self._conv(f"{name}.conv1", silu(self._norm(f"{name}.norm1", x)))
        return x + self._conv(f"{name}.conv2", silu(self._norm(f"{name}.norm2", h)))

    def encode(self, images):
        c = self.config
        low = (c.padded_size - c.image_size) // 2
        high = c.padded_size - c.image_size - low
        h = self._conv("encoder.conv_in", np.pad(images, ((0, 0), (0, 0), (low, high), (low, high)),
                                                 constant_values=-1.0))  # −1 is the background
        for i in range(len(c.channels) - 1):
            h = self._conv(f"encoder.down.{i}.downsample", self._res(f"encoder.down.{i}.res", h), stride=2)
        h = self._conv("encoder.conv_out", silu(self._norm("encoder.norm_out", self._res("encoder.mid", h))))
        mean, logvar = np.split(h, 2, axis=1)
        return mean, np.clip(logvar, -30.0, 20.0)

    def decode(self, latents):
        c = self.config
        h = self._res("decoder.mid", self._conv("decoder.conv_in", latents))
        for i in range(len(c.channels) - 1):
            h = h.repeat(2, axis=2).repeat(2, axis=3)  # nearest-neighbour ×2
            h = self._res(f"decoder.up.{i}.res", self._conv(f"decoder.up.{i}.conv", h))
        h = self._conv("decoder.conv_out", silu(self._norm("decoder.norm_out", h)))
        low = (c.padded_size - c.image_size) // 2
        return h[..., low:low + c.image_size, low:low + c.image_size]
