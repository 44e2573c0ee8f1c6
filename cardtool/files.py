"""Reading small files that a user names (manifests' neighbours, prompt lists, encoder configs) without reading a
device, blocking on a FIFO where no pipe is meant, or reading without bound."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from cardtool.errors import raise_if_the_machines

__all__ = ["file_stamp", "is_regular_file", "parse_json", "read_json_object", "read_small_file",
           "read_small_file_bytes", "read_stream", "unlistable"]


def file_stamp(path: Path) -> tuple[int, int, int, int]:
    """What changes when a file is written (git's index keeps the same): its size, mtime, inode (a file renamed over
    it) and ctime — size and mtime alone miss a rewrite in place whose timestamp was put back (`cp --preserve`,
    `rsync -t`, `touch -r`), while the ctime, which no user call sets, moves with any change. OSError where it
    cannot be stat'ed."""
    info = path.stat()
    return info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns


def unlistable(folder: Path | str) -> str | None:
    """Why this user may not list `folder` (another user's, kept private by its mode), or None: also where it is no
    folder or is gone, which callers say in their own words."""
    try:
        os.scandir(folder).close()
    except PermissionError as e:
        return e.strerror or str(e)
    except OSError:
        pass
    return None


def is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def read_small_file_bytes(path: Path, limit: int, *, pipe: bool = False) -> tuple[bytes, str]:
    """(bytes, "") of a regular file of at most `limit` bytes, else (b"", why not) — never reading a device, nor a
    FIFO unless `pipe` (a `<(…)` argument: read to its writer's end, as far as the limit)."""
    if not (is_regular_file(path) or pipe and _is_fifo(path)):
        return b"", f"{path} {_not_a_file(path)}"
    try:
        with path.open("rb") as f:
            return _bounded(f.read(limit + 1), str(path), limit)
    except OSError as e:
        raise_if_the_machines(e)
        return b"", f"cannot read {path}: {e.strerror}"


def read_stream(stream, what: str, limit: int) -> tuple[str, str]:
    """(text, "") of a binary stream's UTF-8 (standard input) up to `limit` bytes, else ("", why not)."""
    return _text(*_bounded(stream.read(limit + 1), what, limit), what)


def _bounded(data: bytes, what: str, limit: int) -> tuple[bytes, str]:
    return (b"", f"{what} is larger than {limit} bytes") if len(data) > limit else (data, "")


def _text(data: bytes, reason: str, what: str) -> tuple[str, str]:
    if reason:
        return "", reason
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError:
        return "", f"{what} is not UTF-8 text"


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def _not_a_file(path: Path) -> str:
    """Why `path`, which is not a regular file, cannot be read as one."""
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():  # a dangling link: where it points is what is missing
            return f"is a link to {os.readlink(path)}, which does not exist"
        return "does not exist"
    except (OSError, ValueError) as e:
        if isinstance(e, OSError):
            raise_if_the_machines(e)
        return f"cannot be read: {getattr(e, 'strerror', None) or e}"
    return "is not a regular file (a folder, a device or a pipe)"


def read_small_file(path: Path, limit: int = 1 << 20, *, pipe: bool = False) -> tuple[str, str]:
    """(text, "") of a regular UTF-8 file of at most `limit` bytes (or a FIFO, with `pipe`), else ("", why not) —
    never reading a device."""
    return _text(*read_small_file_bytes(path, limit, pipe=pipe), str(path))


def parse_json(text: str | bytes):
    """`json.loads(text)`, where what the parser refuses beyond the grammar — nesting deeper than its recursion limit
    (a hostile file's `[[[[…`), an integer past int()'s 4,300 digits — is a JSONDecodeError like any other malformed
    JSON, not the RecursionError or plain ValueError no caller expects."""
    import json

    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except (RecursionError, ValueError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0].lower()
        raise json.JSONDecodeError(why, text if isinstance(text, str) else "", 0) from None


def read_json_object(path: Path) -> tuple[dict, str]:
    """A small JSON file's object, or ({}, why not)."""
    text, reason = read_small_file(path)
    if reason:
        return {}, reason
    try:
        value = parse_json(text)
    except ValueError as e:
        return {}, f"{path} is not JSON: {e}"
    return (value, "") if isinstance(value, dict) else ({}, f"{path} is not a JSON object")
