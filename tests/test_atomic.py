"""Atomic writes: the target is replaced whole or not at all."""

from __future__ import annotations

import pytest

from cardtool.atomic import atomic_path, write_atomic


def test_write_replaces_whole(tmp_path):
    target = tmp_path / "out" / "a.bin"
    write_atomic(target, b"first")
    write_atomic(target, b"second")
    assert target.read_bytes() == b"second"
    assert [p.name for p in target.parent.iterdir()] == ["a.bin"], "no temporary file is left"


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path):
    target = tmp_path / "a.bin"
    write_atomic(target, b"good")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as temporary:
            temporary.write_bytes(b"half")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"good"
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]
