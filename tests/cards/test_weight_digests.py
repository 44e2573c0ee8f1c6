"""Weights versions (tensor digests) are remembered across processes by file identity, never past a change."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import race
from safetensors.torch import save_file

from cardtool.cache import cache_dir
from cardtool.core.cards import weight_files
from cardtool.core.cards.weight_files import DTYPE_SIZES, read_header, tensor_digest


def test_a_digest_is_read_back_in_a_new_process_and_recomputed_when_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3)}, str(path))
    first = tensor_digest(path)
    memo_file = cache_dir() / "digests.json"
    memo = json.loads(memo_file.read_text())
    assert memo[str(path.resolve())][-1] == first
    memo[str(path.resolve())][-1] = "remembered"  # what a new process would trust for the same file identity
    memo_file.write_text(json.dumps(memo))
    monkeypatch.setattr(weight_files, "_memo", None)  # a new process
    assert tensor_digest(path) == "remembered", "not hashed again"
    save_file({"a": torch.zeros(3)}, str(path))  # new content: new size/inode/times, so the entry is stale
    changed = tensor_digest(path)
    assert changed not in (first, "remembered") and len(changed) == 64
    memo_file.write_text("not json")
    monkeypatch.setattr(weight_files, "_memo", None)
    assert tensor_digest(path) == changed, "an unreadable memo is only a cache miss"


def test_a_process_that_moves_its_cache_reads_and_writes_the_new_one(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3)}, str(path))
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "first"))
    digest = tensor_digest(path)
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "second"))
    assert tensor_digest(path) == digest
    memo = json.loads((tmp_path / "second" / "digests.json").read_text())
    assert memo[str(path.resolve())][-1] == digest, "remembered where the process now keeps its cache"


def test_threads_hashing_files_at_once_share_the_memo_safely(tmp_path, monkeypatch):
    """LoadedCards built in several threads hash their weights at once: one thread's trim of the memo deleted an
    entry another had just deleted (KeyError), or its write met another's change (RuntimeError)."""
    import numpy as np

    paths = []
    for i in range(64):
        paths.append(tmp_path / f"w{i}.safetensors")
        save_file({"w": torch.full((4,), float(i))}, str(paths[-1]))
    monkeypatch.setattr(weight_files, "_MEMO_ENTRIES", 4)  # trimmed on every write

    def load(seed):
        for i in np.random.default_rng(seed).integers(0, 64, size=600):
            tensor_digest(paths[i])

    assert race(load) == []
    assert len(json.loads((cache_dir() / "digests.json").read_text())) == 4


def test_a_file_of_every_safetensors_dtype_has_a_sound_header(tmp_path):
    """Each dtype's bytes per element, as the header check counts them against the offsets safetensors writes: one
    size wrong and a sound file of that dtype reads as corrupt."""
    dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
              "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    assert set(dtypes) == set(DTYPE_SIZES)
    for name, dtype in dtypes.items():
        path = tmp_path / f"{name}.safetensors"
        save_file({"a": torch.zeros(3, 5, dtype=dtype), "b": torch.zeros(7, dtype=dtype)}, str(path))
        assert read_header(path) == ({"a": (name, (3, 5)), "b": (name, (7,))}, None), name


def raw_file(path, header: dict, data: bytes, length: int | None = None):
    """A safetensors file written by hand: its JSON header padded with spaces to `length` bytes."""
    text = json.dumps(header).encode()
    text += b" " * ((length or len(text)) - len(text))
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_a_header_up_to_16_mib_is_read_and_one_past_it_is_not(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    sound = raw_file(tmp_path / "sound.safetensors", header, b"\0" * 4, length=16 << 20)
    assert read_header(sound) == ({"a": ("F32", (1,))}, None)
    large = raw_file(tmp_path / "large.safetensors", header, b"\0" * 4, length=(16 << 20) + 1)
    assert read_header(large) == ({}, "'large.safetensors' does not have a valid safetensors header (truncated or "
                                      "corrupt)")


def test_a_tensor_entry_with_a_field_safetensors_does_not_define_is_refused(tmp_path):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "offset": 0}}
    path = raw_file(tmp_path / "w.safetensors", header, b"\0" * 4)
    assert read_header(path) == ({}, "'w.safetensors': tensor 'a' is not a {dtype, shape, data_offsets} entry")


@pytest.mark.parametrize(("entry", "problem"), [
    ({"shape": 3}, "has an invalid shape"), ({"shape": [1] * 9}, "has an invalid shape"),
    ({"shape": [-1]}, "has an invalid shape"), ({"shape": [True]}, "has an invalid shape"),
    ({"shape": [1.0]}, "has an invalid shape"), ({"shape": [2**48]}, "has an invalid shape"),
    ({"data_offsets": 4}, "has invalid data_offsets"), ({"data_offsets": [0, 4, 4]}, "has invalid data_offsets"),
    ({"data_offsets": [0, 4.0]}, "has invalid data_offsets"),
    ({"data_offsets": [False, 4]}, "has invalid data_offsets"),
    ({"data_offsets": [0, 2**48]}, "has invalid data_offsets"), ({"dtype": "F128"}, "has an unknown dtype"),
    ({"shape": [2]}, ": its byte range does not match its shape and dtype"),
])
def test_a_tensor_entry_that_safetensors_could_not_hold_is_refused(tmp_path, entry, problem):
    header = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], **entry}}
    path = raw_file(tmp_path / "w.safetensors", header, b"\0" * 4)
    assert read_header(path) == ({}, f"'w.safetensors': tensor 'a'{' ' if problem[0] != ':' else ''}{problem}")


def test_eight_dimensions_are_a_shape_and_a_long_tensor_name_is_cut_in_a_problem(tmp_path):
    path = raw_file(tmp_path / "w.safetensors", {"a": {"dtype": "F32", "shape": [1] * 8, "data_offsets": [0, 4]}},
                    b"\0" * 4)
    assert read_header(path) == ({"a": ("F32", (1,) * 8)}, None)
    for name, shown in (("n" * 80, "n" * 80), ("n" * 81, "n" * 77 + "...")):
        path = raw_file(tmp_path / "w.safetensors", {name: {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}},
                        b"\0" * 4)
        assert read_header(path)[1] == f"'w.safetensors': tensor '{shown}' has an unknown dtype"


def test_the_memo_keeps_the_thousand_digests_computed_last(tmp_path, monkeypatch):
    """A hit reads the memo and writes nothing (a file read per card load, not a write); a digest computed again, for
    a file that changed, counts as the newest."""
    monkeypatch.setattr(weight_files, "_memo", None)
    paths = [tmp_path / f"w{i}.safetensors" for i in range(1001)]
    for i, path in enumerate(paths):
        save_file({"a": torch.full((2,), float(i))}, str(path))
    for path in paths[:1000]:
        tensor_digest(path)
    save_file({"a": torch.full((2,), -1.0)}, str(paths[0]))  # changed: computed again
    tensor_digest(paths[0])
    tensor_digest(paths[1000])
    memo = json.loads((cache_dir() / "digests.json").read_text())
    assert list(memo) == [str(p.resolve()) for p in [*paths[2:1000], paths[0], paths[1000]]]


@pytest.mark.parametrize(("head", "problem"), [
    (b"\x80\x04\x95" + b"\0" * 20, "is named .safetensors but holds a pickle/zip checkpoint"),
    (b"PK\x03\x04" + b"\0" * 20, "is named .safetensors but holds a pickle/zip checkpoint"),
    (b"\0" * 8, "is truncated (8 bytes): too short for a safetensors header"),
    (struct.pack("<Q", 0) + b"{}", "does not have a valid safetensors header (truncated or corrupt)"),
    (struct.pack("<Q", 3) + b"{}", "does not have a valid safetensors header (truncated or corrupt)"),
    (struct.pack("<Q", 2) + b"[]", "does not have a valid safetensors header (truncated or corrupt)"),
    (struct.pack("<Q", 2) + b"{]", "has a safetensors header that is not valid JSON"),
])
def test_a_file_that_is_not_safetensors_is_named_for_what_it_is(tmp_path, head, problem):
    path = tmp_path / "w.safetensors"
    path.write_bytes(head)
    assert read_header(path) == ({}, f"'w.safetensors' {problem}")


def test_a_digest_is_of_each_tensor_s_name_dtype_shape_and_bytes_in_name_order(tmp_path, monkeypatch):
    """What a card's and an image's weights versions record: stable across versions, whatever the file's layout."""
    import hashlib

    monkeypatch.setattr(weight_files, "_memo", None)
    b, a = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1.5], dtype=torch.float16)
    c = torch.tensor([-1.0, 2.0])
    save_file({"b": b, "c": c, "a": a}, str(tmp_path / "w.safetensors"), metadata={"note": "ignored"})
    expected = hashlib.sha256(b"a|F16|[1]|" + a.numpy().tobytes() + b"b|F32|[2, 3]|" + b.numpy().tobytes()
                              + b"c|F32|[2]|" + c.numpy().tobytes())
    assert tensor_digest(tmp_path / "w.safetensors") == expected.hexdigest()


def test_weights_rewritten_in_place_with_their_old_mtime_are_hashed_again(examples):
    """A process checks a card's weights, then they are rewritten in place at the same size with their timestamp put
    back (`cp --preserve`, `rsync -t`, `touch -r`): the same process checking again must read them again — a memo
    keyed by size and mtime alone reported the old weights' sha256 and no NaN."""
    import os

    from helpers import put_timestamp_back

    from cardtool.core.cards.loader import load_card
    from cardtool.errors import CardValidationError

    load_card(examples / "tiny-base", checksums=True)
    weights = examples / "tiny-base" / "transformer.safetensors"
    before = weights.stat()
    with weights.open("r+b") as f:  # the last tensor's last four bytes: a float32 NaN, the size unchanged
        f.seek(-4, os.SEEK_END)
        f.write(struct.pack("<f", float("nan")))
    put_timestamp_back(weights, before)
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(CardValidationError, match="sha256 of 'transformer.safetensors' is"):
        load_card(examples / "tiny-base", checksums=True)
    assert weight_files.non_finite_tensors(weights), "and its NaN is found"
