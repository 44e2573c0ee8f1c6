"""PNG files: one image with its generation metadata in text chunks, and a labelled grid."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic

__all__ = ["DAMAGED", "IMAGE_SUFFIXES", "MAX_PIXELS", "READ_FORMATS", "open_image", "png_bytes", "read_png",
           "read_png_metadata", "save_png", "grid_image"]

MAX_PIXELS = 1 << 24  # an image or a grid cardtool writes is far smaller
# The formats photos, scans and masks come in (PPM: Netpbm's PBM/PGM/PPM). Pillow's other decoders — ICNS, DDS, EPS,
# and a dozen more — are seldom what a user means, and on a damaged file raise errors of their own (SyntaxError,
# NotImplementedError) besides Pillow's usual ones.
READ_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".pbm", ".pgm", ".ppm")  # theirs
# What decoding a damaged file in those formats raises (SyntaxError: Pillow's PNG chunk reader)
DAMAGED = (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError)


def png_bytes(pixels: np.ndarray, metadata: dict[str, str] | None = None) -> bytes:
    """Grey uint8 pixels (H, W) as PNG bytes (PNG spec, 3rd ed.: IHDR, one uncompressed-text iTXt chunk per
    metadata entry in UTF-8, IDAT with filter 0 on each row, IEND). Written directly with zlib: Pillow's import
    alone is a measurable part of a one-image `generate`."""
    image = np.ascontiguousarray(pixels, dtype=np.uint8)
    if image.ndim != 2:
        raise ValueError(f"a grey image is (H, W), got shape {image.shape}")
    height, width = image.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8), image], axis=1)  # each scanline starts with filter 0
    chunks = [_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))]
    for key, value in (metadata or {}).items():
        keyword = key.encode("latin-1")
        if not 1 <= len(keyword) <= 79 or b"\0" in keyword:
            raise ValueError(f"a PNG text keyword is 1-79 Latin-1 characters without NUL, got {key!r}")
        chunks.append(_chunk(b"iTXt", keyword + b"\0\0\0\0\0" + value.encode("utf-8")))
    chunks += [_chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)), _chunk(b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def save_png(path: Path, pixels: np.ndarray, metadata: dict[str, str] | None = None) -> None:
    write_atomic(path, png_bytes(pixels, metadata))


def read_png_metadata(path: Path) -> dict[str, str]:
    return read_png(path, pixels=False)[1]


def read_png(path: Path, pixels: bool = True) -> tuple[np.ndarray | None, dict[str, str]]:
    """A PNG's grey pixels (None unless `pixels`) and its text chunks. Read as a regular file of bounded size (never
    blocking on a FIFO that stands where an image should); OSError when it is not one, ValueError when it declares
    more than MAX_PIXELS (`open_image`)."""
    from cardtool.files import read_small_file_bytes

    data, reason = read_small_file_bytes(Path(path), limit=64 << 20)
    if reason:
        raise OSError(reason)
    with open_image(data, ("PNG",)) as image:
        return (np.asarray(image.convert("L")).copy() if pixels else None), dict(getattr(image, "text", {}))


def open_image(data: bytes, formats: tuple[str, ...] = READ_FORMATS):
    """Pillow's image of `data` in one of `formats`, opened but not decoded: ValueError where it declares more than
    MAX_PIXELS (a small file can declare billions), Pillow's bomb error among them; UnidentifiedImageError (an
    OSError) naming the formats read for any other file; Pillow's own errors otherwise (`DAMAGED`)."""
    import io
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():  # Pillow's bomb warning: every image it warns of is refused below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=list(formats))
    except Image.DecompressionBombError as e:
        raise ValueError(str(e)) from None
    except Image.UnidentifiedImageError:  # Pillow's message names the BytesIO object
        raise Image.UnidentifiedImageError(f"not a {', '.join(formats[:-1])} or {formats[-1]} image"
                                           if len(formats) > 1 else f"not a {formats[0]} image") from None
    if image.width * image.height > MAX_PIXELS:
        image.close()
        raise ValueError(f"{image.width} × {image.height} pixels, more than {MAX_PIXELS:,}")
    return image


def grid_image(rows: list[tuple[str, list[np.ndarray]]], scale: int = 3) -> np.ndarray:
    """Rows of images, each under its label, enlarged `scale`× (nearest) so 28-pixel images are legible."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    label_height, pad = 14, 4
    cell = max(img.shape[0] for _, imgs in rows for img in imgs) * scale
    columns = max(len(imgs) for _, imgs in rows)
    width = pad + columns * (cell + pad)
    canvas = Image.new("L", (max(width, 160), len(rows) * (label_height + cell + pad) + pad), color=255)
    draw = ImageDraw.Draw(canvas)
    y = pad
    for label, images in rows:
        draw.text((pad, y), label[:width // 6], fill=0, font=font)
        y += label_height
        for i, img in enumerate(images):
            big = Image.fromarray(img).resize((img.shape[1] * scale, img.shape[0] * scale), Image.NEAREST)
            canvas.paste(big, (pad + i * (cell + pad), y))
        y += cell + pad
    return np.asarray(canvas)
