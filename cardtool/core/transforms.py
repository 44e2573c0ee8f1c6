"""Image transforms a recipe can apply to its training images (`data.transform`), the effects the built-in LoRAs
learn: uint8 (…, H, W) in, uint8 out."""

from __future__ import annotations

import numpy as np

from cardtool.errors import BadInput

__all__ = ["TRANSFORMS", "transform", "dilate", "mirror", "brighten"]


def dilate(images: np.ndarray) -> np.ndarray:
    """Grey dilation with a plus-shaped element: each pixel becomes the maximum of itself and its four neighbours
    (strokes grow a pixel each way). The 3×3 square grew the diagonals too and blurred garments' class cues: the
    judge reads square-dilated test images at 0.83, plus-dilated at 0.85 (undilated 0.935; 2,000 test images)."""
    padded = np.pad(images, [(0, 0)] * (images.ndim - 2) + [(1, 1), (1, 1)])
    h, w = images.shape[-2:]
    return np.max([padded[..., i:i + h, j:j + w] for i, j in ((1, 1), (0, 1), (2, 1), (1, 0), (1, 2))], axis=0)


def mirror(images: np.ndarray) -> np.ndarray:
    """Left–right mirror: Fashion-MNIST's shoes all point left; mirrored, they point right."""
    return images[..., ::-1]


def brighten(images: np.ndarray) -> np.ndarray:
    """Gamma 0.5 on intensity, 255·(x/255)^0.5: the mid-greys of a garment's texture lift (64 → 128), the ink area
    over 127 grows from 0.32 to 0.41 of the pixels, and the judge still reads the class (0.93 on brightened test
    images, 0.935 as they are) — where a dilation, which also thickens, takes it to 0.85 (2,000 test images)."""
    table = np.round(255 * np.sqrt(np.arange(256) / 255)).astype(np.uint8)
    return table[images]


TRANSFORMS = {"none": lambda images: images, "invert": lambda images: 255 - images, "bold": dilate,
              "mirror": mirror, "bright": brighten}


def transform(name: str, images: np.ndarray) -> np.ndarray:
    if not isinstance(name, str) or name not in TRANSFORMS:
        raise BadInput(f"unknown data.transform {name!r}; choose one of: {', '.join(TRANSFORMS)}")
    return TRANSFORMS[name](images).astype(np.uint8)
