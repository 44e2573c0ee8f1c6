"""Atomic writes (DESIGN.md invariant 8): write a temporary file beside the target, then rename over it,
so a reader never sees half a file and a killed run never leaves one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_atomic"]


@contextmanager
def atomic_path(target: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success it replaces `target`, on error it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        yield temporary
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def write_atomic(target: Path | str, data: bytes) -> None:
    with atomic_path(target) as temporary:
        temporary.write_bytes(data)
