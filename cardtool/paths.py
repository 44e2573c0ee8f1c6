"""Paths as people write them and as the system and its libraries take them: `~` where no shell expanded it, what
no file name can hold, and a file whose name is not UTF-8 given to safetensors (UTF-8 paths only)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["home_expanded", "opened_by_utf8_name", "unnamable", "utf8_name"]


def home_expanded(text: str) -> str:
    """Paths a user writes where no shell expands them: `--out=~/x` (bash expands `~` only at a word's start or after
    the `=` of a variable assignment), a quoted `~` in a CI file's or a Dockerfile's environment, a workflow's paths:
    `text` with a leading `~` or `~USER` made that home folder, as pip and huggingface_hub take their paths: left
    literal, it would make a folder named `~` in the working folder, a trap for a later `rm -rf ~`. As a shell does,
    the text is kept as written where there is no such user or no home folder."""
    return os.path.expanduser(text) if text.startswith("~") else text


def unnamable(path) -> str | None:
    """What in `path` no file name can hold — a NUL byte, or a lone surrogate that is no undecodable byte of the
    command line's (os.fsencode's surrogateescape) — said for a message; None for a path the system can be given.
    Only the Python API's callers can give these; Python's file calls raise a bare ValueError for them."""
    text = os.fspath(path)
    if "\0" in text:
        return "a NUL byte"
    try:
        os.fsencode(text)
    except UnicodeEncodeError as e:
        return f"{text[e.start]!r}, a lone surrogate"
    return None


def utf8_name(path) -> bool:
    """Whether `path` is UTF-8 text (no byte of it left undecoded), as safetensors takes paths."""
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@contextlib.contextmanager
def opened_by_utf8_name(path: Path | str) -> Iterator[str]:
    """A UTF-8 name for the file at `path` that safetensors can read: the path itself where it is UTF-8, else the
    file's descriptor under /proc/self/fd (/dev/fd elsewhere), open for the block — a Linux file name may hold any
    byte, and safetensors refuses such a path ("not valid UTF-8") where Python's own calls take it."""
    if utf8_name(path):
        yield os.fspath(path)
        return
    descriptor = os.open(path, os.O_RDONLY)
    try:
        folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
        yield f"{folder}/{descriptor}"
    finally:
        os.close(descriptor)
