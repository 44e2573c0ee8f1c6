"""Image transforms a recipe can apply to its training images (`data.transform`), the effects the built-in LoRAs
learn: uint8 (…, H, W) in, uint8 out."""

from __future__ import annotations

import numpy as np

from cardtool.errors import BadInput

__all__ = ["TRANSFORMS", "transform", "dilate"]


def dilate(images: np.ndarray) -> np.ndarray:
    """Grey dilation with a 3×3 square: each pixel becomes its neighbourhood's maximum (strokes grow a pixel)."""
    padded = np.pad(images, [(0, 0)] * (images.ndim - 2) + [(1, 1), (1, 1)])
    h, w = images.shape[-2:]
    return np.max([padded[..., i:i + h, j:j + w] for i in range(3) for j in range(3)], axis=0)


TRANSFORMS = {"none": lambda images: images, "invert": lambda images: 255 - images, "bold": dilate}


def transform(name: str, images: np.ndarray) -> np.ndarray:
    if name not in TRANSFORMS:
        raise BadInput(f"unknown data.transform '{name}'; choose one of: {', '.join(TRANSFORMS)}")
    return TRANSFORMS[name](images).astype(np.uint8)
