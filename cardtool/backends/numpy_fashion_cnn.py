"""The numpy reference forward of the judge's classifier (backends/training.py FashionCNN), over the same
safetensors state dict: what `parity --card` holds the torch judge's logits and FID features to."""

from __future__ import annotations

import numpy as np

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.backends.numpy_conv_vae import conv2d, group_norm
from cardtool.backends.numpy_wan_dit import silu
from cardtool.backends.reference import linear

__all__ = ["NumpyFashionCNN"]

# (conv, norm) indices in the torch module's `conv` Sequential; a 2×2 max-pool follows the second of each pair
_STAGES = (((0, 1), (3, 4)), ((7, 8), (10, 11)))


def _max_pool(x):
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).max(axis=(3, 5))


class NumpyFashionCNN:
    """embed(images (B, 1, 28, 28) in [−1, 1]) → penultimate features (B, features); head(features) → logits;
    calling it gives the logits of images. Dropout is the identity, as in the torch module's eval mode."""

    def __init__(self, config: FashionCNNConfig, state: dict[str, np.ndarray]):
        self.config, self.state = config, state

    def embed(self, images):
        h, s = images, self.state
        for stage in _STAGES:
            for conv, norm in stage:
                h = conv2d(h, s[f"conv.{conv}.weight"], s[f"conv.{conv}.bias"])
                h = silu(group_norm(h, 8, s[f"conv.{norm}.weight"], s[f"conv.{norm}.bias"]))
            h = _max_pool(h)
        flat = h.reshape(len(h), s["features.2.weight"].shape[1])  # (B, C·7·7), as Flatten
        return silu(linear(flat, s["features.2.weight"], s["features.2.bias"]))

    def head(self, features):
        return linear(features, self.state["head.1.weight"], self.state["head.1.bias"])

    def __call__(self, images):
        return self.head(self.embed(images))
