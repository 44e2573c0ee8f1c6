"""Atomic writes: the target is replaced whole or not at all."""

from __future__ import annotations

import os
import re

import pytest
from helpers import EXAMPLE_CARDS, fsynced, race

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


def test_what_is_not_a_file_is_never_replaced(tmp_path):
    """A rename over a device would swap it for a file — as root, /dev/null itself (an `eval --out /dev/null` did)."""
    from cardtool.atomic import replaceable_file
    from cardtool.errors import BadInput

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(OSError, match="not a regular file"):
        write_atomic(pipe, b"report")
    with pytest.raises(BadInput, match="--out .*pipe is not a regular file"):
        replaceable_file(pipe, "--out")
    assert pipe.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
    (tmp_path / "link").symlink_to(pipe)  # a link is replaced itself, its target untouched
    write_atomic(tmp_path / "link", b"report")
    assert (tmp_path / "link").read_bytes() == b"report" and pipe.is_fifo()


def test_a_durable_write_flushes_the_data_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    flushed = fsynced(monkeypatch)
    write_atomic(tmp_path / "image.png", b"cheap to make again")
    assert flushed == [], "images and caches skip the cost"
    write_atomic(tmp_path / "last.safetensors", b"hours of training", durable=True)
    temporary, folder = (p.rsplit("/", 1)[-1] for p in flushed)
    assert re.fullmatch(rf"\.last\.safetensors\.{os.getpid()}-\d+\.tmp", temporary) and folder == tmp_path.name


def test_threads_writing_one_target_at_once_each_write_a_whole_file(tmp_path):
    target = tmp_path / "image.png"

    def write(k):
        for _ in range(50):
            write_atomic(target, bytes([k]) * 4096)

    assert race(write) == [], "the threads shared one temporary name: one renamed it away under another"
    data = target.read_bytes()
    assert len(set(data)) == 1 and len(data) == 4096
    assert [p.name for p in tmp_path.iterdir()] == ["image.png"]


def test_a_writer_killed_mid_write_leaves_a_temporary_the_next_write_into_its_folder_removes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom cardtool.atomic import atomic_path\n"
        f"with atomic_path({str(tmp_path / 'step-000100.safetensors')!r}) as t:\n"
        "    t.write_bytes(b'half a checkpoint')\n    print('written', flush=True)\n    time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "written\n"
    writer.send_signal(signal.SIGKILL)  # its cleanup never runs
    writer.wait()
    [leftover] = tmp_path.glob(f".step-000100.safetensors.{writer.pid}-*.tmp")
    earlier = tmp_path / ".step-000050.safetensors.999999998.tmp"  # as versions before 2026-12-03 named them
    earlier.write_bytes(b"half a checkpoint")
    live = tmp_path / f".image.png.{os.getppid()}.tmp"  # a running writer's (our parent's pid stands for it)
    live.write_bytes(b"still being written")
    recent = tmp_path / ".other.png.999999999.tmp"  # no such process, but written just now: perhaps on another host
    recent.write_bytes(b"x")
    old = time.time() - 3600
    for path in (leftover, earlier, live):
        os.utime(path, (old, old))
    minute_ago = tmp_path / ".image.png.999999997-0.tmp"  # a minute and a half since its last write: abandoned
    minute_ago.write_bytes(b"x")
    os.utime(minute_ago, (time.time() - 90, time.time() - 90))
    write_atomic(tmp_path / "step-000200.safetensors", b"next")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, recent.name, "step-000200.safetensors"])


def test_a_temporary_whose_pid_no_process_can_have_is_left_alone(tmp_path):
    """A pid past what `kill` takes (a name from elsewhere, or made up) is not ours to judge: kept, and no crash."""
    import time

    from cardtool.atomic import running

    odd = tmp_path / f".x.png.{2 ** 70}-0.tmp"
    odd.write_bytes(b"?")
    os.utime(odd, (time.time() - 3600, time.time() - 3600))
    write_atomic(tmp_path / "y.png", b"y")
    assert odd.exists() and running(2 ** 70) is True


def test_a_running_writers_temporary_is_kept_and_the_writer_left_alone(tmp_path):
    """Whether a pid runs is asked with signal 0, which sends nothing."""
    import subprocess
    import time

    from cardtool.atomic import running

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        held = tmp_path / f".x.png.{sleeper.pid}-0.tmp"
        held.write_bytes(b"being written")
        os.utime(held, (time.time() - 3600, time.time() - 3600))
        write_atomic(tmp_path / "y.png", b"y")
        assert held.exists() and running(sleeper.pid)
        time.sleep(0.2)
        assert sleeper.poll() is None, "the check signalled the writer"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not running(sleeper.pid)


def test_an_atomic_file_is_readable_by_all_and_a_folder_that_cannot_sync_is_left(tmp_path, monkeypatch):
    import errno
    import stat

    from cardtool.atomic import synced

    write_atomic(tmp_path / "card.yaml", b"id: x\n")
    assert stat.S_IMODE((tmp_path / "card.yaml").stat().st_mode) == 0o644
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EINVAL, "no sync here")))
    synced(tmp_path)  # some network file systems refuse to sync a folder
    with pytest.raises(OSError, match="no sync here"):
        synced(tmp_path / "card.yaml")  # a file's data not reaching the disk is an error


def test_a_failing_disk_under_safetensors_is_the_oserror_it_is(tmp_path):
    import errno

    import torch

    from cardtool.atomic import save_tensors

    with pytest.raises(OSError) as info:  # the Rust writer's own error type, which no handler knew
        save_tensors(tmp_path / "missing-folder" / "w.safetensors", {"w": torch.zeros(2)})
    assert info.value.errno == errno.ENOENT and info.value.filename.endswith("w.safetensors")
    with pytest.raises(OSError) as info:
        with atomic_path(tmp_path / "gone" / "x.bin") as temporary:
            temporary.parent.rmdir()
            temporary.write_bytes(b"x")
    assert info.value.filename == str(tmp_path / "gone" / "x.bin"), "named by the target, not the temporary file"


def test_the_same_tensors_and_metadata_make_the_same_file_bytes(tmp_path):
    """safetensors writes the header's metadata in its hash map's order, another on each write: a run made again
    would have had files of other sha256 (a LoRA's rank, alpha, format and config). Key order, the offsets kept."""
    import json

    import torch
    from safetensors import safe_open

    from cardtool.atomic import save_tensors

    tensors = {"b.lora_A.weight": torch.arange(6.0).reshape(2, 3), "a": torch.ones(3, dtype=torch.float16)}
    metadata = {"rank": "8", "format": "pt", "alpha": "8.0", "lora_adapter_metadata": json.dumps({"r": 8, "é": 1}),
                "note": 'a "quoted"\\ line\nand\ttab\x01 ✓ 𝄞'}
    for i in range(6):
        save_tensors(tmp_path / f"{i}.safetensors", tensors, metadata)
    files = {(tmp_path / f"{i}.safetensors").read_bytes() for i in range(6)}
    assert len(files) == 1, "one file, whatever order the writer took"
    [data] = files
    header = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    assert list(header["__metadata__"]) == sorted(metadata) and header["__metadata__"] == metadata
    with safe_open(str(tmp_path / "0.safetensors"), "pt") as f:
        assert f.metadata() == metadata and all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


def test_a_disk_filling_mid_write_is_named_by_the_target(tmp_path):
    """write() on a full disk raises ENOSPC naming no file (open() names one): `eval --out` said only "No space left
    on device"."""
    import errno

    target = tmp_path / "report.json"
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        with pytest.raises(OSError) as info:
            with atomic_path(target):
                raise OSError(code, os.strerror(code))
        assert (info.value.errno, info.value.filename) == (code, str(target))
    with pytest.raises(OSError) as info:  # not a write's error: not said of the target
        with atomic_path(target):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
    assert info.value.filename is None
    assert list(tmp_path.iterdir()) == []


def test_names_at_the_file_systems_limit_are_written_and_names_past_it_refused_up_front(tmp_path):
    """A 255-byte name is written atomically (its temporary's name, longer by `.PID-N.tmp`, was refused by the file
    system); a longer one is bad input before the work — not an exit 1 after it — as a file or as a folder."""
    from typer.testing import CliRunner

    from cardtool.atomic import replaceable_file, writable_folder
    from cardtool.cli import app
    from cardtool.errors import BadInput

    for name in ("a" * 254, "a" * 255):  # a temporary keeps as much of its target's name as fits
        with atomic_path(tmp_path / "ascii" / name) as temporary:
            assert len(temporary.name) == 255 and temporary.name.startswith("." + "a" * 200)
            temporary.write_bytes(b"data")
    at_limit = tmp_path / ("é" * 125 + "a.bin")  # 255 bytes in UTF-8
    write_atomic(at_limit, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ascii", at_limit.name] and at_limit.read_bytes() == b"data"
    past = tmp_path / ("a" * 256)
    for check, what in ((replaceable_file, "--out"), (writable_folder, "the output folder")):
        with pytest.raises(BadInput, match="File name too long"):
            check(past, what)
    card = str(EXAMPLE_CARDS / "tiny-base")
    result = CliRunner().invoke(app, ["generate", card, "-p", "a bag", "--out", f"{past}.png", "--json"])
    assert result.exit_code == 2 and "File name too long" in result.stdout


def test_a_folder_a_peer_removes_between_its_making_and_the_proof_is_made_again(tmp_path, monkeypatch):
    """Two torchrun ranks check one run folder at once (`keep=False`): one's proof may remove the folder it made while
    the other is about to write its probe there. The other makes it again and proves it, not 'No such file'."""
    import shutil
    import tempfile

    from cardtool.atomic import writable_folder

    real, removed = tempfile.NamedTemporaryFile, []

    def peer_removes_it_first(*args, **kwargs):
        if not removed:
            removed.append(kwargs["dir"])
            shutil.rmtree(kwargs["dir"])  # as the peer's own proof cleans up after itself
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", peer_removes_it_first)
    assert writable_folder(tmp_path / "runs" / "distill", "the run folder", keep=False) == tmp_path / "runs" / "distill"
    assert removed == [tmp_path / "runs" / "distill"] and not (tmp_path / "runs").exists(), "made, proven, removed"


def test_a_folder_on_a_full_disk_is_refused_with_what_to_do(tmp_path, monkeypatch):
    import errno
    import tempfile

    from cardtool.atomic import writable_folder
    from cardtool.errors import BadInput

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", full)
    with pytest.raises(BadInput, match=r"^cannot write to the run folder .*run: No space left on device — free space "
                                       r"on its disk$"):
        writable_folder(tmp_path / "run", "the run folder", keep=False)
    assert not (tmp_path / "run").exists()
