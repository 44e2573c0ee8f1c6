"""PNG files: one image with its generation metadata in text chunks, and a labelled grid."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from cardtool.atomic import write_atomic

__all__ = ["png_bytes", "read_png_metadata", "save_png", "grid_image"]


def png_bytes(pixels: np.ndarray, metadata: dict[str, str] | None = None) -> bytes:
    """Grey uint8 pixels (H, W) as PNG bytes with each metadata entry in its own iTXt chunk (UTF-8)."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    for key, value in (metadata or {}).items():
        info.add_itxt(key, value)
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8), mode="L").save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def save_png(path: Path, pixels: np.ndarray, metadata: dict[str, str] | None = None) -> None:
    write_atomic(path, png_bytes(pixels, metadata))


def read_png_metadata(path: Path) -> dict[str, str]:
    from PIL import Image

    with Image.open(path) as image:
        return dict(image.text)


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
