"""Atomic writes (DESIGN.md invariant 8): write a temporary file beside the target, then rename over it,
so a reader never sees half a file and a killed run never leaves one — and never over what is not a file (a device
such as /dev/null, a pipe, a folder), which the rename would replace."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["TEMPORARY", "atomic_path", "refuse_stream", "replaceable_file", "running", "save_tensors", "synced",
           "write_atomic", "writable_folder"]

# a killed writer's temporary is left alone this long after its last write: on a folder shared between machines a
# pid means nothing here, and a writer elsewhere still writing touches its file far more often than this
ABANDONED_SECONDS = 60
_swept: set[Path] = set()
_WRITING = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # what only a write raises
_written = itertools.count()
# a temporary's name (`_temporary_name`), its writer's pid in group 1; `.NAME.PID.tmp` as versions before
# 2026-12-03 named them
TEMPORARY = re.compile(r"\..+\.(\d+)(?:-\d+)?\.tmp")


@contextmanager
def atomic_path(target: Path | str, *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target`, on error it is removed.

    `durable`: the file's data reaches the disk before the rename and the rename before returning (`synced`), so
    a power loss leaves the old file or the new one, never an empty one where the data had not been written yet —
    for what hours of work went into (checkpoints, cards); images and caches skip the cost."""
    target = Path(target)
    if _special(target):  # the rename would swap it for a file: as root, /dev/null itself
        raise OSError(errno.EINVAL, "not a regular file (a device, a pipe, a folder); only a file is replaced",
                      str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep(target.parent)
    temporary = target.with_name(_temporary_name(target.name))
    try:
        yield temporary
        os.chmod(temporary, 0o644)
        if durable:
            synced(temporary)
        os.replace(temporary, target)
        if durable:
            synced(target.parent)
    except OSError as e:  # a full disk, say: named by the file the user knows, not by our temporary one
        # a failed write() names no file: a full disk or quota mid-write is this file's too
        if e.filename != str(temporary) and not (e.filename is None and e.errno in _WRITING):
            raise
        raise OSError(e.errno, e.strerror, str(target)) from None
    finally:
        temporary.unlink(missing_ok=True)


def _temporary_name(name: str, limit: int = 255) -> str:
    """`.NAME.PID-N.tmp`, N this process's count of temporaries (threads writing one target each get their own),
    NAME shortened to keep it within the file system's `limit` bytes a name (NAME_MAX): a target named near the limit
    is still written atomically."""
    suffix = f".{os.getpid()}-{next(_written)}.tmp"
    while len(os.fsencode(f".{name}{suffix}")) > limit and len(name) > 1:
        name = name[:-1]
    return f".{name}{suffix}"


def replaceable_file(path: Path | str, what: str) -> Path:
    """`path`, where writing it atomically replaces at most a file: BadInput naming it as `what` ("--out") where a
    device such as /dev/null, a pipe or a folder stands, or a name the file system cannot hold — found before the
    work whose result it is to hold."""
    from cardtool.errors import BadInput

    path = Path(path)
    try:
        os.lstat(path)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise BadInput(f"{what} {path}: {e.strerror}") from None
    if _special(path):
        raise BadInput(f"{what} {path} is not a regular file (a folder, a device such as /dev/null, a pipe); "
                       "give a file name")
    return path


def _special(path: Path) -> bool:
    """Whether something other than a file (or a link, which a rename replaces, not its target) stands at `path`."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISLNK(mode))


def _sweep(folder: Path) -> None:
    """Remove the temporaries writers killed mid-write left in `folder` (kill -9, the OOM killer, a power loss: their
    cleanup never ran) — a checkpoint's can be gigabytes. Once per folder and process (one listing, not one per
    image); only a file whose pid is not running here and that nothing has written for a minute."""
    key = folder.resolve()
    if key in _swept:
        return
    _swept.add(key)
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        match = TEMPORARY.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid() or running(int(match[1])):
            continue
        try:
            if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > ABANDONED_SECONDS:
                os.unlink(entry.path)
        except OSError:
            pass  # gone already, or not ours to remove


def running(pid: int) -> bool:
    """Whether process `pid` exists here (another user's counts: its files are not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def write_atomic(target: Path | str, data: bytes, *, durable: bool = False) -> None:
    with atomic_path(target, durable=durable) as temporary:
        temporary.write_bytes(data)


def save_tensors(path: Path | str, tensors: dict, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, a failing disk raised as the OSError it is: the Rust writer raises its own error
    type, which would otherwise reach the user as a traceback instead of "No space left on device"."""
    from safetensors import SafetensorError
    from safetensors.torch import save, save_file

    from cardtool.paths import utf8_name

    try:
        if utf8_name(path):
            save_file(tensors, str(path), metadata=metadata)
        else:  # safetensors takes UTF-8 paths only, and writes beside the path (no descriptor of ours will do)
            Path(path).write_bytes(save(tensors, metadata=metadata))
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None
    if metadata and len(metadata) > 1:
        _metadata_in_key_order(path)


def _metadata_in_key_order(path: Path | str) -> None:
    """safetensors writes a header's metadata in its hash map's order, which changes from write to write: the
    same tensors and metadata (a LoRA's rank, alpha and format) made files of other bytes and sha256 — a run made
    again could not be checked by its files' digests. Rewritten in place in key order: the header keeps its length,
    so the tensors' offsets hold; a header the JSON here would not write at that length is left as written."""
    with open(path, "r+b") as file:
        length = int.from_bytes(file.read(8), "little")
        written = file.read(length)
        header = json.loads(written)
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        ordered = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(ordered) == len(written.rstrip(b" ")):  # the rest of the header is its padding
            file.seek(8)
            file.write(ordered)


def synced(path: Path | str) -> None:
    """fsync a file, or a folder (which makes the renames in it durable); a file system that cannot sync a
    folder (some network ones refuse) is left as it is."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError:
        if not os.path.isdir(path):
            raise
    finally:
        os.close(descriptor)


_PROBES = 5  # tries at proving a folder writable while other processes make and remove it


def writable_folder(folder: Path | str, what: str, *, keep: bool = True) -> Path:
    """Make `folder` (and its parents) and prove a file can be created in it, before any work whose result goes
    there: BadInput naming it as `what` ("the output folder") otherwise. A real write, not os.access: root passes
    access checks on /proc and on read-only mounts. `keep=False`: the folders made for the proof are removed again —
    a check before work that may yet be refused leaves no empty folders; the write itself makes them."""
    import tempfile

    from cardtool.errors import BadInput, creating_said

    folder, made = Path(folder), []
    try:  # inside: a name too long for the file system fails even the exists()
        if folder.exists() and not folder.is_dir():
            raise BadInput(f"cannot write to {what} {folder}: it is a file, not a folder")
        made = [] if keep else [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
        for attempt in range(_PROBES):
            try:
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=folder, prefix=".cardtool-probe-"):
                    break
            except FileNotFoundError:  # another process's proof (a torchrun peer's) removed the folder it had made
                if attempt == _PROBES - 1:
                    raise
    except OSError as e:
        blocking = next((p for p in reversed(folder.parents) if p.is_file()), None)  # the outermost: the first met
        why = f"{blocking} is a file, not a folder" if blocking is not None else creating_said(e, folder)
        raise BadInput(f"cannot write to {what} {folder}: {why}") from None
    finally:  # also where the proof failed
        for path in made:
            try:
                path.rmdir()  # only while empty: another process may have begun to use it
            except OSError:
                break
    return folder


def refuse_stream(path, what: str, kind: str = "a folder", alternative: str = "", option: str = "--out") -> None:
    """BadInput where `path` is `-` — the shell's "standard output", which would otherwise be a file or folder named
    '-' — given as an output `option`; `what` says how the output is written. Once a path, './-' is '-' too: one named
    '-' is given by its whole path. Also where it holds what no file name can (`unnamable`)."""
    from cardtool.errors import BadInput
    from cardtool.paths import unnamable

    held = unnamable(path)
    if held is not None:
        raise BadInput(f"{option} {str(path)!r} holds {held}, which no file name can"[:300])
    if str(path) == "-":
        raise BadInput(f"{option} -: {what}, not to standard output; give {kind} ({os.path.abspath('-')} for one "
                       f"named '-'){alternative}; --json prints the report on standard output")
