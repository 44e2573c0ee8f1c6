"""Image-to-image (SDEdit, Meng et al. 2022, in the rectified-flow form): requests that start from a given image,
encoded by the card's VAE, re-noised to the first grid σ at or below `strength` — x = (1 − σ)·x0 + σ·ε, with each
request's own seed — and denoised from there. With a mask, inpainting: after every step the latent cells the mask
keeps are set back to the image's own latent at the new σ, (1 − σ')·x0 + σ'·ε with the request's starting noise ε (the
blended-latent form of RePaint, Lugmayr et al. 2022), so only the masked part is generated, in keeping with the rest.
Images and masks are named by their content hash in the PNG metadata and in the settings tag, as a control image is,
so another image is another file and `--like` finds the ones used."""

from __future__ import annotations

import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool.core.sampling.control import is_pil_image, pil_pixels, pixels_digest, read_grey
from cardtool.errors import BadInput

__all__ = ["DEFAULT_STRENGTH", "InitImage", "Picture", "init_images"]

DEFAULT_STRENGTH = 0.8  # diffusers' img2img default: most of the grid runs again, the image's layout stays


@dataclass(frozen=True)
class Picture:
    """A grey uint8 (H, W) image given as a file, a PIL image or an array: its pixels, content hash and path (empty:
    not a file)."""

    pixels: np.ndarray = field(compare=False, repr=False)
    digest: str
    source: str = ""

    def record(self) -> str:
        return json.dumps({"sha256": self.digest, "source": self.source})


@dataclass(frozen=True)
class InitImage:
    """What a request starts from: the image, the σ it is re-noised to, and the mask of what to generate anew (white)
    and what to keep (black) — None: the whole image is re-noised and denoised."""

    image: Picture
    strength: float
    mask: Picture | None = None

    def metadata(self) -> dict[str, str]:
        """What a PNG records of it beside the request's `strength`."""
        return {"image": self.image.record(), **({"mask": self.mask.record()} if self.mask else {})}


def init_images(image, strength, size: int | None, prompts: int, mask=None) -> list[InitImage] | None:
    """What each prompt's requests start from — an image (and a mask) for all of them (a file, a PIL image or a grey
    uint8 (H, W) array), or a list or tuple of one per prompt —, files resized to the card's `size`, at `strength`
    (default DEFAULT_STRENGTH, with a mask 1: the masked part generated from noise); None without an image. BadInput for
    a strength or mask without an image, or a strength outside (0, 1) — at 1 an image with no mask would be re-noised
    away entirely —, with a mask (0, 1]."""
    if image is None:
        if strength is not None or mask is not None:
            raise BadInput(f"--{'strength' if strength is not None else 'mask'} applies to the image to start from; "
                           "give --image IMAGE")
        return None
    if strength is None:
        strength = 1.0 if mask is not None else DEFAULT_STRENGTH
    number = isinstance(strength, numbers.Real) and not isinstance(strength, bool)
    if not number or not (0 < strength <= 1 if mask is not None else 0 < strength < 1):
        limits = "(0, 1]" if mask is not None else "(0, 1) — 1 would forget the image; with --mask 1 is allowed —"
        raise BadInput(f"--strength must be a number in {limits} (the σ the image is re-noised to), got "
                       f"{strength!r}"[:300])
    images = _per_prompt(image, prompts, size, "image to start from")
    masks = _per_prompt(mask, prompts, size, "mask") if mask is not None else [None] * prompts
    return [InitImage(i, float(strength), m) for i, m in zip(images, masks, strict=True)]


def _per_prompt(value, prompts: int, size: int, what: str) -> list[Picture]:
    if not isinstance(value, (list, tuple)):
        return [_picture(value, size, what)] * prompts
    if len(value) != prompts:
        raise BadInput(f"give one {what} for all prompts or one per prompt: {len(value)} given for {prompts} "
                       f"prompt{'' if prompts == 1 else 's'}")
    return [_picture(each, size, what) for each in value]


def _picture(value, size: int, what: str) -> Picture:
    if isinstance(value, (str, os.PathLike)):
        pixels, source = read_grey(Path(value), size, f"the {what}"), str(value)
    elif is_pil_image(value):  # made grey and resized as a file is
        pixels, source = pil_pixels(value, size, f"the {what}"), ""
    else:
        pixels, source = np.asarray(value), ""
        if pixels.ndim != 2 or pixels.dtype != np.uint8:
            raise BadInput(f"the {what} must be a file, a PIL image or a grey uint8 (H, W) array, got {pixels.dtype} "
                           f"{pixels.shape}"[:300])
        if pixels.shape != (size, size):
            raise BadInput(f"the card takes {size}×{size} images; the {what} is {pixels.shape[1]}×{pixels.shape[0]} "
                           "(a file is resized, an array is not)")
    pixels = np.ascontiguousarray(pixels)
    return Picture(pixels, pixels_digest(pixels), source)
