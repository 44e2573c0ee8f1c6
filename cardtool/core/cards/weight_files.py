"""Weight files on disk: safetensors only (pickle formats can run code when loaded), sha256 verified."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

__all__ = ["PICKLE_SUFFIXES", "format_problem", "sha256_file", "tensor_digest"]

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".pickle")

_digests: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, remembered per (path, size, mtime) so a process hashes each file once."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def format_problem(path: Path) -> str | None:
    """Why `path` is not a safetensors file we will load, or None if its header looks right."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return f"'{path.name}' is a pickle checkpoint format ({path.suffix}); only safetensors are loaded"
    if path.suffix.lower() != ".safetensors":
        return f"'{path.name}' is not a .safetensors file"
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(9)
    if head[:1] == b"\x80" or head[:4] == b"PK\x03\x04":
        return f"'{path.name}' is named .safetensors but holds a pickle/zip checkpoint"
    if len(head) < 9:
        return f"'{path.name}' is truncated ({size} bytes): too short for a safetensors header"
    (header_len,) = struct.unpack("<Q", head[:8])
    if header_len == 0 or 8 + header_len > size or head[8:9] != b"{":
        return f"'{path.name}' does not have a valid safetensors header (truncated or corrupt)"
    return None


_versions: dict[tuple[str, int, int], str] = {}


def tensor_digest(path: Path) -> str:
    """A content hash of the tensors in a safetensors file (names, dtypes, shapes, bytes), blind to its
    metadata and tensor order: the weights version used in cache keys. Read from the raw layout, so any
    dtype (bf16 included) hashes without a framework."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _versions:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            start = 8 + header_len
            digest = hashlib.sha256()
            for name in sorted(k for k in header if k != "__metadata__"):
                entry = header[name]
                begin, end = entry["data_offsets"]
                f.seek(start + begin)
                digest.update(f"{name}|{entry['dtype']}|{entry['shape']}|".encode())
                digest.update(f.read(end - begin))
        _versions[key] = digest.hexdigest()
    return _versions[key]
