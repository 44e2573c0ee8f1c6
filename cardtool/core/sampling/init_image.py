"""Image-to-image (SDEdit, Meng et al. 2022, in the rectified-flow form): requests that start from a given image,
encoded by the card's VAE, re-noised to the first grid σ at or below `strength` — x = (1 − σ)·x0 + σ·ε, with each
request's own seed — and denoised from there. The image is named by its content hash in the PNG metadata and in the
settings tag, as a control image is, so another image to start from is another file and `--like` finds the one used."""

from __future__ import annotations

import hashlib
import json
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool.errors import BadInput

__all__ = ["DEFAULT_STRENGTH", "InitImage", "init_images"]

DEFAULT_STRENGTH = 0.8  # diffusers' img2img default: most of the grid runs again, the image's layout stays


@dataclass(frozen=True)
class InitImage:
    """The image requests start from, grey uint8 (H, W), the σ it is re-noised to, its content hash and where it
    came from (a file's path as given; empty for an array)."""

    image: np.ndarray = field(compare=False, repr=False)
    strength: float
    digest: str
    source: str = ""

    def metadata(self) -> dict[str, str]:
        """What a PNG records of it beside the request's `strength`."""
        return {"image": json.dumps({"sha256": self.digest, "source": self.source})}


def init_images(image, strength, size: int, prompts: int) -> list[InitImage] | None:
    """The image each prompt's requests start from — one for all (a file, or a grey uint8 (H, W) array), or a list
    or tuple of one per prompt —, files resized to the card's `size`, at `strength` (default DEFAULT_STRENGTH); None
    without an image. BadInput for a strength without one, or one outside (0, 1): at 1 the image would be re-noised
    away entirely."""
    if image is None:
        if strength is not None:
            raise BadInput("--strength is how far --image is re-noised; give --image IMAGE to start from")
        return None
    if strength is None:
        strength = DEFAULT_STRENGTH
    if not isinstance(strength, numbers.Real) or isinstance(strength, bool) or not 0 < strength < 1:
        raise BadInput(f"--strength must be a number in (0, 1) — the σ the image is re-noised to; 1 would forget "
                       f"it — got {strength!r}"[:300])
    if not isinstance(image, (list, tuple)):
        return [_one(image, float(strength), size)] * prompts
    if len(image) != prompts:
        raise BadInput(f"give one image to start from for all prompts or one per prompt: {len(image)} images for "
                       f"{prompts} prompt{'' if prompts == 1 else 's'}")
    return [_one(each, float(strength), size) for each in image]


def _one(image, strength: float, size: int) -> InitImage:
    if isinstance(image, (str, os.PathLike)):
        from cardtool.core.sampling.control import read_grey

        pixels, source = read_grey(Path(image), size, "the image to start from"), str(image)
    else:
        pixels, source = np.asarray(image), ""
        if pixels.ndim != 2 or pixels.dtype != np.uint8:
            raise BadInput(f"an image to start from is a file or a grey uint8 (H, W) array, got {pixels.dtype} "
                           f"{pixels.shape}"[:300])
        if pixels.shape != (size, size):
            raise BadInput(f"the card takes {size}×{size} images; the image to start from is "
                           f"{pixels.shape[1]}×{pixels.shape[0]} (a file is resized, an array is not)")
    pixels = np.ascontiguousarray(pixels)
    digest = hashlib.sha256(pixels.tobytes() + str(pixels.shape).encode()).hexdigest()
    return InitImage(pixels, strength, digest, source)
