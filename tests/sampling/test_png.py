"""cardtool's own PNG writer: Pillow (an independent decoder) reads back the exact pixels and every metadata entry."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from cardtool.core.sampling.images import png_bytes


def test_pixels_and_utf8_metadata_round_trip_through_pillow():
    pixels = np.random.default_rng(0).integers(0, 256, (28, 31), dtype=np.uint8)
    metadata = {"prompt": "a ünïcode shirt ✓", "seed": "7", "card": "fashion-base"}
    data = png_bytes(pixels, metadata)
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        assert image.mode == "L" and image.size == (31, 28)
        np.testing.assert_array_equal(np.asarray(image), pixels)
        assert image.text == metadata
    assert png_bytes(pixels, metadata) == data, "the same image writes the same bytes"


def test_every_chunk_carries_a_valid_crc():
    data = png_bytes(np.zeros((4, 4), np.uint8), {"k": "v"})
    offset, kinds = 8, []
    while offset < len(data):
        length = int.from_bytes(data[offset:offset + 4], "big")
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        assert int.from_bytes(data[offset + 8 + length:offset + 12 + length], "big") == zlib.crc32(kind + body)
        kinds.append(kind)
        offset += 12 + length
    assert kinds == [b"IHDR", b"iTXt", b"IDAT", b"IEND"]


@pytest.mark.parametrize(("pixels", "metadata"), [(np.zeros((2, 2, 3), np.uint8), {}),
                                                  (np.zeros((2, 2), np.uint8), {"": "x"}),
                                                  (np.zeros((2, 2), np.uint8), {"k" * 80: "x"})])
def test_bad_images_and_keywords_are_refused(pixels, metadata):
    with pytest.raises(ValueError):
        png_bytes(pixels, metadata)
