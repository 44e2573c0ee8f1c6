"""The image transforms the built-in LoRAs learn (`data.transform`)."""

from __future__ import annotations

import numpy as np
import pytest

from cardtool.core.transforms import transform
from cardtool.errors import BadInput


def test_bold_grows_a_stroke_by_a_pixel_each_way_but_not_diagonally():
    image = np.zeros((1, 5, 5), np.uint8)
    image[0, 2, 2] = 200
    bold = transform("bold", image)[0]
    assert bold[2, 2] == bold[1, 2] == bold[3, 2] == bold[2, 1] == bold[2, 3] == 200
    assert bold[1, 1] == bold[3, 3] == 0 and bold.sum() == 5 * 200 and bold.dtype == np.uint8
    batch = np.zeros((2, 3, 5, 5), np.uint8)  # every leading axis is a batch axis, kept as it is
    batch[1, 2, 0, 4] = 9
    bolder = transform("bold", batch)
    assert bolder.shape == batch.shape and bolder[1, 2, :2, 3:].tolist() == [[9, 9], [0, 9]] and bolder.sum() == 27


def test_mirror_and_invert():
    image = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    assert np.array_equal(transform("mirror", image)[:, :, 0], image[:, :, 3])
    assert np.array_equal(transform("mirror", transform("mirror", image)), image)
    assert np.array_equal(transform("invert", image), 255 - image)
    with pytest.raises(BadInput, match="choose one of: none, invert, bold, mirror, bright"):
        transform("flip", image)


def test_bright_lifts_the_mid_greys_with_gamma_one_half_and_keeps_black_and_white():
    image = np.array([[[0, 64, 128, 255]]], np.uint8)
    bright = transform("bright", image)
    assert bright.tolist() == [[[0, 128, 181, 255]]] and bright.dtype == np.uint8
    every = np.arange(256, dtype=np.uint8)
    assert np.all(np.diff(transform("bright", every).astype(int)) >= 0)  # monotone: the order of greys is kept
