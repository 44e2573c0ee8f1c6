"""Control images for ControlNet requests: read from disk, turned into the control signal by a preprocessor
registered by name (numpy only, so a request's control is the same on every platform)."""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool.core.sampling.control_names import PREPROCESSORS as NAMES
from cardtool.core.sampling.images import DAMAGED, open_image
from cardtool.errors import BadInput
from cardtool.files import read_small_file_bytes
from cardtool.paths import home_expanded

__all__ = ["PREPROCESSORS", "ControlImage", "silhouette", "edges", "pixels_digest", "read_grey", "parse_control"]

INK = 32  # a pixel brighter than this is garment, not background (Fashion-MNIST backgrounds are 0)


def silhouette(image: np.ndarray) -> np.ndarray:
    """The binarised shape of a garment (…, H, W): pixels above INK, with the holes enclosed by them filled (a dark
    pattern on a shirt is still shirt), 255 inside and 0 outside."""
    ink = image > INK
    outside = np.zeros_like(ink)
    for edge in ((..., 0, slice(None)), (..., -1, slice(None)), (..., slice(None), 0), (..., slice(None), -1)):
        outside[edge] = ~ink[edge]
    while True:  # flood the background from the border through 4-connected non-ink pixels
        grown = outside.copy()
        grown[..., 1:, :] |= outside[..., :-1, :]
        grown[..., :-1, :] |= outside[..., 1:, :]
        grown[..., :, 1:] |= outside[..., :, :-1]
        grown[..., :, :-1] |= outside[..., :, 1:]
        grown &= ~ink
        if np.array_equal(grown, outside):
            return np.where(outside, 0, 255).astype(np.uint8)
        outside = grown


def edges(image: np.ndarray) -> np.ndarray:
    """Sobel gradient magnitude, thresholded at a quarter of its largest value: 255 on edges, 0 elsewhere."""
    x = np.pad(image.astype(np.float64), 1, mode="edge")
    gx = (x[:-2, 2:] + 2 * x[1:-1, 2:] + x[2:, 2:]) - (x[:-2, :-2] + 2 * x[1:-1, :-2] + x[2:, :-2])
    gy = (x[2:, :-2] + 2 * x[2:, 1:-1] + x[2:, 2:]) - (x[:-2, :-2] + 2 * x[:-2, 1:-1] + x[:-2, 2:])
    magnitude = np.hypot(gx, gy)
    peak = magnitude.max()
    return np.where(magnitude > 0.25 * peak, 255, 0).astype(np.uint8) if peak > 0 else np.zeros_like(image)


PREPROCESSORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silhouette": silhouette, "edges": edges, "none": lambda image: image.astype(np.uint8)}
assert tuple(PREPROCESSORS) == NAMES


@dataclass(frozen=True)
class ControlImage:
    """A request's control: the preprocessed image (H, W) uint8, and its content hash (what caches and PNG
    metadata name it by)."""

    image: np.ndarray = field(compare=False, repr=False)
    preprocessor: str
    digest: str
    source: str = ""

    @classmethod
    def make(cls, image: np.ndarray, preprocessor: str, source: str = "") -> ControlImage:
        if preprocessor not in PREPROCESSORS:
            raise BadInput(f"unknown control preprocessor '{preprocessor}'; choose one of: {', '.join(PREPROCESSORS)}")
        image = np.asarray(image)
        if image.ndim != 2 or image.dtype != np.uint8:
            raise BadInput(f"a control image is a file, a PIL image or a grey uint8 (H, W) array, got {image.dtype} "
                           f"{image.shape}")
        processed = np.ascontiguousarray(PREPROCESSORS[preprocessor](image))
        return cls(processed, preprocessor, pixels_digest(processed), source)


def pixels_digest(pixels: np.ndarray) -> str:
    """The content hash an image is named by in caches, PNG metadata and settings tags: its bytes and shape."""
    return hashlib.sha256(pixels.tobytes() + str(pixels.shape).encode()).hexdigest()


def read_grey(path: Path, size: int, what: str = "control image") -> np.ndarray:
    """An image file (a control image, an image to start from) as grey uint8 (size, size): any of `READ_FORMATS`, turned
    upright as its EXIF orientation says (a camera's photo is stored sideways), converted to grey and resized; `what`
    names it in the error for a file that cannot be read."""
    data, reason = read_small_file_bytes(path, limit=64 << 20)
    if reason:
        raise BadInput(f"cannot read {what}: {reason}")
    try:
        with open_image(data) as image:  # its size checked before decoding
            return grey_resized(image, size)
    except DAMAGED as e:  # open_image: ValueError for a declared bomb, UnidentifiedImageError for another format
        raise BadInput(f"cannot read {what} {path}: {type(e).__name__}: {str(e)[:200]}")


def is_pil_image(value) -> bool:
    """Whether `value` is a Pillow image (a script's, or a diffusers pipeline's output); Pillow is not imported
    for the question."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def pil_pixels(image, size: int, what: str) -> np.ndarray:
    """A Pillow image (a script's, a diffusers pipeline's) as grey uint8 (size, size), as its file would be read;
    BadInput for an empty one or one whose mode Pillow cannot convert (LAB), as for a file."""
    if 0 in image.size:
        raise BadInput(f"the {what} is an empty image ({image.size[0]}×{image.size[1]} pixels)")
    try:
        return grey_resized(image, size)
    except DAMAGED as e:
        raise BadInput(f"cannot use {what} ({image.mode} image): {type(e).__name__}: {str(e)[:200]}") from None


def grey_resized(image, size: int) -> np.ndarray:
    """A Pillow image as a file is read: upright by its EXIF orientation, grey by its mode's range, resized to
    (size, size)."""
    from PIL import Image, ImageOps

    image = _grey(ImageOps.exif_transpose(image))
    if image.size != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    return np.asarray(image, dtype=np.uint8).copy()


def _grey(image):
    """An image of any mode as 8-bit grey by its mode's own range, where Pillow's convert("L") clips or truncates:
    16-bit grey scaled by 255/65535 (clipped, a 16-bit mask read all white), float grey taken as [0, 1] (truncated,
    it read all black); and transparency composited onto black, Fashion-MNIST's background, so that a cut-out
    garment's transparent surround is background whatever colour its pixels hold."""
    from PIL import Image

    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        values = np.asarray(image, dtype=np.float64)
        values = np.nan_to_num(values * 255.0 if image.mode == "F" else values / 257.0, nan=0.0)
        return Image.fromarray(np.clip(np.rint(values), 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        grey, alpha = image.convert("LA").split()
        return Image.fromarray(np.rint(np.asarray(grey, dtype=np.float64) * np.asarray(alpha) / 255.0)
                               .astype(np.uint8), "L")
    return image.convert("L")


def parse_control(text: str) -> tuple[Path, str | None]:
    """`IMAGE[:PREPROCESSOR]` as typed after --control (the preprocessor defaults to the ControlNet's own)."""
    path, sep, name = text.rpartition(":")
    if sep and name in PREPROCESSORS:
        return Path(home_expanded(path)), name
    if sep and "/" not in name and "." not in name and name:
        raise BadInput(f"--control {text}: unknown preprocessor '{name}'; choose one of: {', '.join(PREPROCESSORS)}")
    return Path(home_expanded(text)), None
