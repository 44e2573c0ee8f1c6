"""Your own images with captions as training data, in Hugging Face's ImageFolder layout: a folder holding the images
(PNG, JPEG, WebP, GIF, BMP, TIFF or Netpbm, in subfolders or not) and `metadata.jsonl` beside them, one JSON object a
line — `{"file_name": "bags/red.png", "text": "a red bag"}`, and `"split": "test"` for images held out from training.
With no test row, every tenth image (the 10th, 20th, … row) is held out, so the trainers' held-out loss still means
something. Each image is read as the family's grey square (upright by its EXIF orientation, transparency onto black,
resized), checked before decoding as `generate --image` checks its image; a `file_name` must stay inside the folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cardtool.errors import BadInput
from cardtool.files import parse_json, read_small_file

__all__ = ["METADATA", "MAX_METADATA_BYTES", "MAX_IMAGES", "is_image_folder", "load_captioned"]

METADATA = "metadata.jsonl"
MAX_METADATA_BYTES = 64 << 20
MAX_IMAGES = 200_000  # 157 MB of 28 × 28 images; their captions' token states are the larger part (see README)
_HOW = f"see {METADATA} in the README's Training section"


def is_image_folder(folder: Path) -> bool:
    return (folder / METADATA).exists() or (folder / METADATA).is_symlink()


def load_captioned(split: str, root: Path, size: int) -> tuple[np.ndarray, tuple[str, ...]]:
    """The `train` or `test` split's images (N, size, size) uint8 and their captions."""
    rows = _rows(root)
    tests = [r for r in rows if r[2] == "test"]
    if tests:
        chosen = tests if split == "test" else [r for r in rows if r[2] == "train"]
    else:
        chosen = [r for i, r in enumerate(rows) if (i % 10 == 9) == (split == "test")]
    if not chosen:
        have = "one image" if len(rows) == 1 else f"{len(rows)} images"
        raise BadInput(f"{root / METADATA}: the {split} split holds no images ({have}; with no \"split\": \"test\" "
                       "row every tenth image is held out, so give at least 10, or mark test rows)")
    from cardtool.core.sampling.control import read_grey

    images = np.stack([read_grey(path, size, f"training image (line {line} of {METADATA})")
                       for path, _, _, line in chosen])
    return images, tuple(caption for _, caption, _, _ in chosen)


def _rows(root: Path) -> list[tuple[Path, str, str, int]]:
    """(image path, caption, split, line number) of each row of the folder's metadata.jsonl."""
    text, reason = read_small_file(root / METADATA, limit=MAX_METADATA_BYTES)
    if reason:
        raise BadInput(f"cannot read the image folder's captions: {reason}")
    folder, rows = root.resolve(), []
    # a byte-order mark (Windows editors write one) is no content; splitlines takes CRLF line ends too
    for number, line in enumerate(text.removeprefix("\ufeff").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{root / METADATA}:{number}"
        try:
            row = parse_json(line)
        except ValueError as e:
            raise BadInput(f"{where}: not a JSON object ({e}); {_HOW}") from None
        if not isinstance(row, dict):
            raise BadInput(f"{where}: not a JSON object; {_HOW}")
        unknown = sorted(set(row) - {"file_name", "text", "split"})
        if unknown:
            raise BadInput(f"{where}: unknown key {', '.join(map(repr, unknown))}; a row has file_name, text and "
                           "split (optional)")
        name, caption, split = row.get("file_name"), row.get("text"), row.get("split", "train")
        if not isinstance(name, str) or not name or "\0" in name:
            raise BadInput(f"{where}: file_name must be the image's path inside the folder, got {name!r}"[:300])
        if not isinstance(caption, str):
            raise BadInput(f"{where}: text must be the image's caption (a string), got {caption!r}"[:300])
        if split not in ("train", "test"):
            raise BadInput(f"{where}: split must be train or test, got {split!r}"[:300])
        path = root / name
        try:
            inside = path.resolve().is_relative_to(folder)
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the system refuses
            inside = False
        if Path(name).is_absolute() or not inside:
            raise BadInput(f"{where}: file_name {name!r} leads outside the folder"[:300])
        rows.append((path, caption, split, number))
        if len(rows) > MAX_IMAGES:
            raise BadInput(f"{root / METADATA} lists more than {MAX_IMAGES:,} images")
    if not rows:
        raise BadInput(f"{root / METADATA} lists no images; {_HOW}")
    return rows
