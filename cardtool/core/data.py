"""Fashion-MNIST (or any IDX image/label folder, or an image folder with captions: image_folder.py): reading the IDX
files, the class names, where they live.

IDX is LeCun's format: a magic of two zero bytes, a type code (0x08 = unsigned byte) and the number of
dimensions, then one big-endian uint32 per dimension, then the data. Files may be gzipped.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cardtool.errors import BadInput, raise_if_the_machines
from cardtool.files import unlistable
from cardtool.paths import home_expanded

__all__ = ["CLASS_NAMES", "DEFAULT_DATA", "IMAGE_SIZE", "Split", "data_dir", "load_split", "provenance", "read_idx",
           "unit_images"]

DEFAULT_DATA = Path("/usr/share/datasets/fashion-mnist")  # Debian's dataset-fashion-mnist
IMAGE_SIZE = 28  # Fashion-MNIST's: what the judge's classifier and the family's VAE take
MAX_IDX_BYTES = 1 << 32  # Fashion-MNIST's training images are 47 MB; EMNIST's largest split under 1 GB
CLASS_NAMES = ("T-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
               "ankle boot")
FASHION_MNIST = {"1f243a60b4b748a4": "train", "9a494dc49efeb996": "test"}  # Split.digest() of its two splits
_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_HOW = ("install Debian's package (apt-get install -y dataset-fashion-mnist), or give a folder holding "
        "train-/t10k- images and labels IDX files (or images with captions in metadata.jsonl, for training) with "
        "--data DIR or CARDTOOL_DATA")


@dataclass(frozen=True)
class Split:
    """One split: uint8 images (N, 28, 28) and int64 labels (N,) — or, from an image folder with captions
    (image_folder.py), each image's caption and no class (labels −1)."""

    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...] = CLASS_NAMES
    captions: tuple[str, ...] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def digest(self) -> str:
        """A short hash of the images and labels or captions (25 ms for Fashion-MNIST's 47 MB of training images
        here)."""
        import hashlib

        h = hashlib.sha256(np.ascontiguousarray(self.images).data)
        h.update(np.ascontiguousarray(self.labels).data)
        if self.captions is not None:
            h.update(json.dumps(self.captions).encode())
        return h.hexdigest()[:16]

    def classes(self, what: str) -> Split:
        """This split, where `what` needs class labels: BadInput for captioned images, which have none."""
        if self.captions is not None:
            raise BadInput(f"{what} needs class-labelled images (an IDX folder such as Fashion-MNIST's); an image "
                           "folder with captions has no classes")
        return self


def data_dir(explicit: str | Path | None = None) -> Path:
    """The data folder: --data, else CARDTOOL_DATA (a leading ~ is the home folder in either), else Debian's
    fashion-mnist folder."""
    if isinstance(explicit, str) and not explicit.strip():  # `--data "$UNSET"` is a mistake, not the default
        raise BadInput(f"--data {explicit!r} names no folder; give one, or leave --data out for CARDTOOL_DATA or "
                       "Fashion-MNIST")
    folder = Path(home_expanded(str(explicit or os.environ.get("CARDTOOL_DATA") or DEFAULT_DATA)))
    if not folder.is_dir():
        source = " (CARDTOOL_DATA)" if not explicit and os.environ.get("CARDTOOL_DATA") else ""
        raise BadInput(f"no Fashion-MNIST data at {folder}{source}: {_HOW}")
    why = unlistable(folder)
    if why:  # said of the folder, not of the first file in it the data is looked for by
        raise BadInput(f"the data folder {folder} cannot be read: {why}")
    return folder


def provenance(split: Split, name: str) -> dict:
    """What a card's `recipe.data` records of the `name` split it was trained on: Fashion-MNIST's, known by its
    content wherever its files lie; any other IDX folder's or image folder's by kind, size and digest."""
    digest = split.digest()
    if split.captions is None and FASHION_MNIST.get(digest) == name:
        return {"dataset": "fashion-mnist", "split": name}
    return {"dataset": "idx" if split.captions is None else "image-folder", "split": name, "images": len(split),
            "digest": digest}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (gzipped or not) as a numpy array of its declared shape."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            header = f.read(4)
            if len(header) < 4 or header[:2] != b"\0\0" or header[2] != 0x08:
                raise BadInput(f"{path} is not an unsigned-byte IDX file (bad magic {header.hex()}): {_HOW}")
            ndim = header[3]
            shape = struct.unpack(f">{ndim}I", f.read(4 * ndim))
            if math.prod(shape) > MAX_IDX_BYTES:
                raise BadInput(f"{path} declares shape {shape}, {math.prod(shape):,} bytes: more than the "
                               f"{MAX_IDX_BYTES:,} an IDX file read here may hold: {_HOW}")
            data = _read_at_most(f, math.prod(shape) + 1)  # no further: a small gzip can inflate to gigabytes
    except (OSError, EOFError, struct.error, zlib.error) as e:  # zlib's: gzip data damaged past its header
        if isinstance(e, OSError):
            raise_if_the_machines(e)
        raise BadInput(f"cannot read {path}: {e}: {_HOW}") from None
    if len(data) != math.prod(shape):
        state = "is truncated" if len(data) < math.prod(shape) else "holds more bytes than its shape"
        raise BadInput(f"{path} {state}: {len(data):,} bytes of data for shape {shape}: {_HOW}")
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


def _read_at_most(f, size: int, chunk: int = 16 << 20) -> bytearray:
    """Up to `size` bytes, read in chunks into one growing buffer: a header declaring gigabytes over a short file costs
    what the file holds, not an allocation of what it declares (one read of `size` asks for it all at once), and a
    long file is held once, not twice (its parts, then their join)."""
    data = bytearray()
    while len(data) < size:
        part = f.read(min(chunk, size - len(data)))
        if not part:
            break
        data += part
    return data


def load_split(split: str = "train", folder: str | Path | None = None, image_size: int = IMAGE_SIZE) -> Split:
    """The `train` or `test` split of the IDX folder (Fashion-MNIST by default): square images of `image_size`."""
    if split not in _FILES:
        raise BadInput(f"unknown split '{split}'; choose train or test")
    root = data_dir(folder)
    from cardtool.core.image_folder import is_image_folder, load_captioned

    if is_image_folder(root):
        images, captions = load_captioned(split, root, image_size)
        return Split(images, np.full(len(images), -1, dtype=np.int64), captions=captions)
    if not any((root / name).is_file() for stem in _FILES[split] for name in (stem, stem + ".gz")) \
            and _holds_images(root):
        raise BadInput(f"{root} holds images but no metadata.jsonl, which captioned images need: one JSON line per "
                       'image, such as {"file_name": "bags/red.png", "text": "a red bag"} (the README\'s "Your own '
                       'images")')
    images, labels = (read_idx(_find(root, stem)) for stem in _FILES[split])
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise BadInput(f"{root}: {split} images {images.shape} and labels {labels.shape} do not match: {_HOW}")
    if len(images) == 0:
        raise BadInput(f"{root}: the {split} split holds no images: {_HOW}")
    if images.shape[1:] != (image_size, image_size):
        raise BadInput(f"{root}: {split} images are {images.shape[1]}×{images.shape[2]} pixels; the components take "
                       f"{image_size}×{image_size}" + (" (Fashion-MNIST's size)" if image_size == IMAGE_SIZE else ""))
    if labels.max(initial=0) >= len(CLASS_NAMES):
        raise BadInput(f"{root}: {split} labels go up to {labels.max()}, Fashion-MNIST has {len(CLASS_NAMES)} classes")
    return Split(images, labels.astype(np.int64))


def _holds_images(root: Path, looked_at: int = 1000) -> bool:
    """Whether `root` or one of its subfolders holds image files, from at most `looked_at` entries."""
    import itertools

    from cardtool.core.sampling.images import IMAGE_SUFFIXES

    try:
        entries = list(itertools.islice(os.scandir(root), looked_at))
        inside = [e for e in entries if e.is_dir(follow_symlinks=False)][:20]
        entries += [f for d in inside for f in itertools.islice(os.scandir(d.path), looked_at // 20)]
    except OSError:
        return False
    return any(e.name.lower().endswith(IMAGE_SUFFIXES) for e in entries)


def _find(root: Path, stem: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise BadInput(f"{root} has no {stem}(.gz): {_HOW}")


def unit_images(images: np.ndarray) -> np.ndarray:
    """uint8 (B, H, W) → float32 (B, 1, H, W) in [−1, 1], the numbers the VAE and the classifier train on, computed in
    place: one float copy, not three."""
    unit = images.astype(np.float32)
    unit /= 127.5
    unit -= 1.0
    return unit[:, None]
