"""The IDX reader: Fashion-MNIST from Debian's package, any IDX folder, and clear errors otherwise."""

from __future__ import annotations

import gzip
import struct

import numpy as np
import pytest

from cardtool.core.data import CLASS_NAMES, DEFAULT_DATA, load_split, provenance, read_idx
from cardtool.errors import BadInput


def write_idx(path, array, compress=False):
    payload = b"\0\0\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


def make_folder(folder, n=5, compress=True):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    for stem, count in (("train", n), ("t10k", n + 1)):
        write_idx(folder / f"{stem}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8),
                  compress)
        write_idx(folder / f"{stem}-labels-idx1-ubyte{suffix}", np.arange(count, dtype=np.uint8) % 10, compress)
    return folder


def test_debian_fashion_mnist_is_the_default(fashion_mnist):
    test = load_split("test")
    assert test.images.shape == (10000, 28, 28) and test.images.dtype == np.uint8
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert test.class_names[9] == "ankle boot" and len(CLASS_NAMES) == 10


def test_a_cards_recorded_data_is_fashion_mnist_by_its_content_wherever_it_lies(fashion_mnist, tmp_path):
    for split in ("train", "test"):
        assert provenance(load_split(split), split) == {"dataset": "fashion-mnist", "split": split}
    copy = tmp_path / "copy"  # uncompressed, elsewhere: the same images
    copy.mkdir()
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        copy.joinpath(name).write_bytes(gzip.decompress((DEFAULT_DATA / f"{name}.gz").read_bytes()))
    assert provenance(load_split("train", copy), "train") == {"dataset": "fashion-mnist", "split": "train"}
    images = bytearray(copy.joinpath("train-images-idx3-ubyte").read_bytes())
    images[-1] ^= 1  # one pixel of one image: no longer Fashion-MNIST's
    copy.joinpath("train-images-idx3-ubyte").write_bytes(bytes(images))
    other = load_split("train", copy)
    assert provenance(other, "train") == {"dataset": "idx", "split": "train", "images": 60000,
                                          "digest": other.digest()}
    assert provenance(load_split("train"), "test")["dataset"] == "idx", "the train split is no test split"


@pytest.mark.parametrize("compress", [True, False])
def test_any_idx_folder_gzipped_or_not(tmp_path, compress):
    folder = make_folder(tmp_path / "idx", compress=compress)
    train = load_split("train", folder)
    assert train.images.shape == (5, 28, 28) and train.labels.tolist() == [0, 1, 2, 3, 4]
    assert len(load_split("test", folder)) == 6


def test_cardtool_data_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("CARDTOOL_DATA", str(make_folder(tmp_path / "env")))
    assert len(load_split("train")) == 5
    monkeypatch.setenv("CARDTOOL_DATA", str(tmp_path / "gone"))  # set once and forgotten: the message says where
    with pytest.raises(BadInput, match=r"^no Fashion-MNIST data at \S+gone \(CARDTOOL_DATA\): "):
        load_split("train")
    with pytest.raises(BadInput, match=r"^no Fashion-MNIST data at \S+elsewhere: "):
        load_split("train", tmp_path / "elsewhere")


def test_missing_folder_says_how_to_install(tmp_path):
    with pytest.raises(BadInput, match="apt-get install -y dataset-fashion-mnist"):
        load_split("train", tmp_path / "nowhere")


def test_missing_file_bad_magic_and_truncation_are_clear(tmp_path):
    folder = make_folder(tmp_path / "idx")
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(BadInput, match="has no t10k-labels-idx1-ubyte"):
        load_split("test", folder)
    bad = tmp_path / "bad-idx"
    bad.write_bytes(b"PK\x03\x04junk")
    with pytest.raises(BadInput, match="not an unsigned-byte IDX file"):
        read_idx(bad)
    short = tmp_path / "short-idx"
    short.write_bytes(b"\0\0\x08\x01" + struct.pack(">I", 10) + b"\x01\x02")
    with pytest.raises(BadInput, match="truncated"):
        read_idx(short)
    damaged = tmp_path / "damaged-idx.gz"  # a sound gzip header over deflate data a disk damaged: zlib's error
    whole = bytearray(gzip.compress(b"\0\0\x08\x01" + struct.pack(">I", 4000) + bytes(range(250)) * 16))
    whole[20:-12] = bytes(b ^ 0xFF for b in whole[20:-12])
    damaged.write_bytes(bytes(whole))
    with pytest.raises(BadInput, match=f"cannot read {damaged}"):
        read_idx(damaged)


def test_unknown_split(tmp_path):
    with pytest.raises(BadInput, match="unknown split"):
        load_split("validation", make_folder(tmp_path / "idx"))


def test_a_file_that_inflates_past_its_shape_is_refused_without_reading_it_all(tmp_path, monkeypatch):
    """A small gzip can hold gigabytes: the reader stops one byte past the declared shape."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(b"\0\0\x08\x03" + struct.pack(">3I", 2, 28, 28) + bytes(10 * 2 * 28 * 28))
    asked = []
    real_open = gzip.open

    def spying_open(*args, **kwargs):
        handle = real_open(*args, **kwargs)
        read = handle.read
        handle.read = lambda n=-1: asked.append(n) or read(n)
        return handle

    monkeypatch.setattr(gzip, "open", spying_open)
    with pytest.raises(BadInput, match="holds more bytes than its shape"):
        read_idx(path)
    assert -1 not in asked and max(asked) == 2 * 28 * 28 + 1


@pytest.mark.parametrize(("shape", "message"), [((2**31, 28, 28), "declares shape"),  # past the cap
                                                 ((3_000_000, 28, 28), "is truncated"),  # 2.4 GB under it
                                                 ((1 << 16, 1 << 8, 1 << 8), "is truncated"),  # the cap exactly: 4 GiB
                                                 ((1 << 16, 1 << 8, 257), "declares shape")])  # past it
def test_a_header_declaring_gigabytes_over_a_short_file_allocates_what_the_file_holds(tmp_path, shape, message):
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(b"\0\0\x08\x03" + struct.pack(">3I", *shape) + bytes(5 * 28 * 28)))
    import tracemalloc

    tracemalloc.start()
    with pytest.raises(BadInput, match=message):  # was a MemoryError (or gigabytes taken) for one read of it all
        read_idx(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 << 20


def _folder_of(tmp_path, images: np.ndarray):
    """An IDX folder whose two splits hold `images`, labelled 0, 1, 2, …"""
    folder = tmp_path / "idx"
    folder.mkdir()
    for stem in ("train", "t10k"):
        write_idx(folder / f"{stem}-images-idx3-ubyte", images)
        write_idx(folder / f"{stem}-labels-idx1-ubyte", np.arange(len(images), dtype=np.uint8))
    return folder


def test_images_of_another_size_are_bad_input(tmp_path):
    with pytest.raises(BadInput, match="10×12 pixels; the components take 28×28"):
        load_split("train", _folder_of(tmp_path, np.zeros((3, 10, 12), dtype=np.uint8)))


def test_a_split_without_images_is_bad_input(tmp_path):
    """Every command reading a split needs its images: an empty one is said so, not a failure deep in training."""
    with pytest.raises(BadInput, match="the test split holds no images"):
        load_split("test", _folder_of(tmp_path, np.zeros((0, 28, 28), dtype=np.uint8)))


@pytest.mark.parametrize(("images", "labels", "message"), [
    ((4, 28, 28), (3,), r"train images \(4, 28, 28\) and labels \(3,\) do not match"),
    ((3, 28, 28), (3, 1), r"labels \(3, 1\) do not match"),
    ((3, 784), (3,), r"images \(3, 784\) and labels \(3,\) do not match")])
def test_images_and_labels_that_do_not_pair_up_are_bad_input(tmp_path, images, labels, message):
    folder = make_folder(tmp_path / "idx")
    write_idx(folder / "train-images-idx3-ubyte.gz", np.zeros(images, dtype=np.uint8), compress=True)
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.zeros(labels, dtype=np.uint8), compress=True)
    with pytest.raises(BadInput, match=message):
        load_split("train", folder)


def test_labels_past_the_ten_classes_are_bad_input(tmp_path):
    """Label 9 (ankle boot) is the last class; a 10 would index past the class names and the judge's outputs."""
    folder = make_folder(tmp_path / "idx")
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([0, 9, 9, 1, 2], dtype=np.uint8), compress=True)
    assert load_split("train", folder).labels.tolist() == [0, 9, 9, 1, 2]
    write_idx(folder / "train-labels-idx1-ubyte.gz", np.array([0, 10, 9, 1, 2], dtype=np.uint8), compress=True)
    with pytest.raises(BadInput, match="train labels go up to 10, Fashion-MNIST has 10 classes"):
        load_split("train", folder)


def test_a_labelled_split_serves_where_classes_are_needed(tmp_path):
    split = load_split("test", make_folder(tmp_path / "idx"))
    assert split.classes("the eval") is split
