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
    # IHDR: 31 × 28, 8 bits, grey, deflate (the only compression PNG defines), filter set 0, not interlaced
    assert data[8:29] == b"\0\0\0\x0dIHDR" + bytes.fromhex("0000001f0000001c0800000000")


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


def test_an_image_of_up_to_2_to_the_24_pixels_is_opened_and_a_larger_one_refused_unread():
    from cardtool.core.sampling.images import MAX_PIXELS, open_image

    for width, height in ((4096, 4096), (4097, 4096)):
        data = png_bytes(np.zeros((height, width), np.uint8))
        if width * height <= MAX_PIXELS:
            with open_image(data) as image:
                assert image.size == (width, height)
        else:
            with pytest.raises(ValueError, match=f"4097 × 4096 pixels, more than {MAX_PIXELS:,}"):
                open_image(data)
    assert MAX_PIXELS == 4096 * 4096


def test_a_grid_lays_out_each_row_under_its_label_at_three_times_the_size():
    from cardtool.core.sampling.images import grid_image

    rows = [("a bag", [np.full((28, 28), 10 * k, np.uint8) for k in range(1, 4)]),
            ("a coat", [np.full((28, 28), 100 + k, np.uint8) for k in range(2)])]
    grid = grid_image(rows)
    cell, pad, label = 84, 4, 14
    assert grid.shape == (2 * (label + cell + pad) + pad, pad + 3 * (cell + pad))
    for r, (_, images) in enumerate(rows):
        top = pad + r * (label + cell + pad) + label
        for i, image in enumerate(images):
            left = pad + i * (cell + pad)
            assert (grid[top:top + cell, left:left + cell] == image[0, 0]).all(), (r, i)
            assert grid[top + cell, left] == 255 and grid[top - 1, left + cell] == 255, "white between cells"
    assert (grid[pad:pad + label, pad:pad + 40] < 128).any(), "the first row's label is drawn above it"


def test_a_grid_is_at_least_160_pixels_wide_and_a_png_read_back_at_most_64_mib(tmp_path):
    from cardtool.core.sampling.images import grid_image, read_png

    assert grid_image([("a", [np.zeros((28, 28), np.uint8)])]).shape == (4 + 14 + 84 + 4, 160)
    (tmp_path / "huge.png").write_bytes(png_bytes(np.zeros((2, 2), np.uint8)) + b"\0" * (64 << 20))
    with pytest.raises(OSError, match=f"is larger than {64 << 20} bytes"):
        read_png(tmp_path / "huge.png")
