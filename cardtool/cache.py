"""Where cardtool keeps what it can recompute — encoded prompts (`text/`), weights digests (`digests.json`) and FID's
reference features (`features/`) — and what it holds, and clearing it. Only cardtool's own files are counted or
removed, whatever else shares the folder."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from cardtool.atomic import TEMPORARY
from cardtool.errors import BadInput, creating_said
from cardtool.paths import home_expanded

__all__ = ["DEFAULT_LIMIT", "NoCacheFolder", "cache_dir", "clear", "limit", "parse_size", "problem", "prune", "usage"]

DEFAULT_LIMIT = 5 * 10**9  # bytes of encoded prompts kept; the least recently used go beyond it (as ccache does)
# decimal units, binary with an i; the B may be left out (`5G`, `500M`, `2Gi`, as ccache and du write them)
_UNITS = {"": 1, "B": 1, **{f"{prefix}{i}{b}": (2**(10 * n) if i else 10**(3 * n))
                            for n, prefix in enumerate("KMGT", 1) for i in ("", "I") for b in ("", "B")}}
_TEXT_ENTRY = re.compile(r"[0-9a-f]{64}\.npz")  # a key's file: an encoded prompt, reference features
_FLOORS_ENTRY = re.compile(r"[0-9a-f]{64}\.json")  # an eval's floors


class NoCacheFolder(BadInput):
    """`cache_dir()` has no folder to give: no home folder, and neither CARDTOOL_CACHE nor XDG_CACHE_HOME set."""


def cache_dir() -> Path:
    """CARDTOOL_CACHE (a leading ~ is the home folder), else $XDG_CACHE_HOME/cardtool, else ~/.cache/cardtool. A
    relative XDG_CACHE_HOME is ignored, as the XDG spec says: it would put a cache in every working folder. Without a
    home folder (HOME unset, a user id the password database does not know: a container run as an arbitrary user),
    NoCacheFolder — runs then keep their encoded prompts in memory only, never in a guessed shared folder another user
    could have filled."""
    if os.environ.get("CARDTOOL_CACHE"):
        return Path(home_expanded(os.environ["CARDTOOL_CACHE"]))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return Path(xdg) / "cardtool"
    try:
        # HOME empty (the root folder, to Python) or relative (the working folder): the password database's home
        if not os.path.isabs(os.environ.get("HOME", "/")):
            import pwd

            return Path(pwd.getpwuid(os.getuid()).pw_dir) / ".cache" / "cardtool"
        return Path.home() / ".cache" / "cardtool"
    except (RuntimeError, KeyError):  # pathlib's "Could not determine home directory"
        raise NoCacheFolder("no folder for cardtool's cache: HOME is not set and this user has no home folder in the "
                            "password database; set CARDTOOL_CACHE (or XDG_CACHE_HOME) to a folder") from None


def parse_size(text: str) -> int:
    """Bytes of a size such as `5GB`, `500 MB`, `2GiB`, `1.5G` or `123456` (decimal units, binary with an i)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in _UNITS:
        raise BadInput(f"{text!r} is not a size (for example 5GB, 500MB, 2GiB or a number of bytes)"[:300])
    if len(match[1]) > 40:  # Fraction() would pass Python's 4,300-digit limit; bytes below 2⁶³ need 19
        raise BadInput(f"{text.strip()[:40]!r}… has {len(match[1])} digits: more bytes than a file system holds, "
                       "or more decimals than a byte has (for example 5GB, 500MB or 2GiB)")
    from fractions import Fraction

    if match[2].upper() in ("", "B") and Fraction(match[1]).denominator != 1:  # `0.5` meant 0.5GB, not 0 bytes
        raise BadInput(f"{text.strip()!r} is a fraction of a byte: a size without a unit is a number of bytes; give a "
                       "unit (0.5GB, 500MB)"[:300])
    size = int(Fraction(match[1]) * _UNITS[match[2].upper()])  # exact for any length of digits
    if size >= 2**63:
        raise BadInput(f"{text[:40]!r} is more bytes than a file system holds (at most 2⁶³ − 1)")
    return size


def limit() -> int:
    """CARDTOOL_CACHE_MAX (a size; 0 keeps no encoded prompt on disk), else DEFAULT_LIMIT."""
    text = os.environ.get("CARDTOOL_CACHE_MAX", "")
    if not text:
        return DEFAULT_LIMIT
    try:
        return parse_size(text)
    except BadInput as e:
        raise BadInput(f"CARDTOOL_CACHE_MAX: {e}") from None


def _files(root: Path) -> dict[str, list[os.DirEntry]]:
    """cardtool's files in the cache by kind, symlinks never followed: `text` the encoded prompts (text/XX/KEY.npz),
    `digests` the weights digests, `features` FID's reference features and an eval's floors (features/KEY.npz,
    KEY.json), `temporary` what interrupted writes left."""
    found: dict[str, list[os.DirEntry]] = {"text": [], "digests": [], "features": [], "temporary": []}

    def scan(folder: Path) -> list[os.DirEntry]:
        try:
            with os.scandir(folder) as entries:
                return list(entries)
        except OSError:  # not there, not a folder, not readable: nothing of ours
            return []

    for entry in scan(root):
        if entry.name == "digests.json" and entry.is_file(follow_symlinks=False):
            found["digests"].append(entry)
        elif TEMPORARY.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            found["temporary"].append(entry)
    for entry in scan(root / "features"):
        if entry.is_file(follow_symlinks=False):
            kind = "features" if _TEXT_ENTRY.fullmatch(entry.name) or _FLOORS_ENTRY.fullmatch(entry.name) else \
                "temporary" if TEMPORARY.fullmatch(entry.name) else None
            if kind:
                found[kind].append(entry)
    for shard in scan(root / "text"):
        if re.fullmatch(r"[0-9a-f]{2}", shard.name) and shard.is_dir(follow_symlinks=False):
            for entry in scan(Path(shard.path)):
                if entry.is_file(follow_symlinks=False):
                    kind = "text" if _TEXT_ENTRY.fullmatch(entry.name) else \
                        "temporary" if TEMPORARY.fullmatch(entry.name) else None
                    if kind:
                        found[kind].append(entry)
    return found


def _unreadable(root: Path) -> list[str]:
    """The folders of cardtool's this user may not look into — `features/`, `text/` or a text shard, made by another
    user whose umask keeps them private, on a shared cache — each with why: what they hold is neither counted nor
    removable here."""
    from cardtool.files import unlistable

    features = [f"{root / 'features'}: {why}"] if (why := unlistable(root / "features")) else []
    if why := unlistable(root / "text"):
        return [*features, f"{root / 'text'}: {why}"]
    try:
        with os.scandir(root / "text") as found:
            shards = [s.path for s in found if re.fullmatch(r"[0-9a-f]{2}", s.name) and s.is_dir(follow_symlinks=False)]
    except OSError:  # none yet
        return features
    return features + sorted(f"{shard}: {why}" for shard in shards if (why := unlistable(shard)))


def _size(entry: os.DirEntry) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_size
    except OSError:  # removed meanwhile
        return 0


def _used(entry: os.DirEntry) -> float:
    """When an entry was last written or read (a hit touches it)."""
    try:
        return entry.stat(follow_symlinks=False).st_mtime
    except OSError:
        return 0.0


def problem(root: Path | None = None) -> str | None:
    """Why runs cannot keep anything in the cache folder (each then encodes its prompts again), or None."""
    root = cache_dir() if root is None else root
    folder = root
    try:
        while not folder.exists() and folder != folder.parent:  # created on first use: the first that exists decides
            folder = folder.parent
        if not folder.is_dir():
            return f"{folder} is not a folder"
        if not os.access(folder, os.W_OK | os.X_OK):
            return f"{folder} is not writable"
        # root passes os.access everywhere, and a read-only mount or /proc refuses it anyway: try
        os.rmdir(tempfile.mkdtemp(prefix=".cardtool-probe-", dir=folder))
    except OSError as e:  # a name too long, a folder on the way that cannot be searched, or the try refused
        return f"{root} cannot be written ({creating_said(e, folder) if e.strerror else e})"
    return None


def usage() -> dict:
    """The cache's folder, why runs cannot write to it (`problem`, None when they can) and, per kind, how many files
    of cardtool's it holds and their bytes."""
    root = cache_dir()
    return {"path": str(root), "limit": limit(), "problem": problem(root),
            **{kind: {"files": len(entries), "bytes": sum(_size(e) for e in entries)}
               for kind, entries in _files(root).items()}, "unreadable": _unreadable(root)}


def prune(to: int | None = None, root: Path | None = None, strict: bool = False) -> dict:
    """Remove the least recently used encoded prompts in the cache (`root`, default `cache_dir()`) until those left
    take at most `to` bytes (default: `limit()`); what was removed and what is left. Entries another process removes
    meanwhile are skipped. One that cannot be removed (a read-only cache) stays; `strict` (the command) then raises
    RunFailed with the report, as `clear` does — a run holding the cache to its limit never fails for it."""
    from cardtool.errors import RunFailed

    root = cache_dir() if root is None else root
    to = limit() if to is None else to
    entries = sorted(((_used(e), _size(e), e.path) for e in _files(root)["text"]), reverse=True)  # newest first
    kept = files = removed = gone = 0
    refused = []
    full = False  # once an entry does not fit, every older one goes too: the order of use decides, not the sizes
    for _, size, path in entries:
        full = full or kept + size > to
        if not full:
            kept += size
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:  # another process removed it first
            gone += 1
            continue
        except OSError as e:
            refused.append(f"{path}: {e.strerror or e}")
            kept += size
            continue
        files, removed = files + 1, removed + size
    report = {"path": str(root), "limit": to, "removed": {"files": files, "bytes": removed},
              "text": {"files": len(entries) - files - gone, "bytes": kept}}
    if refused and strict:
        raise RunFailed(f"{len(refused)} of cardtool's cache files could not be removed, e.g. {refused[0]}", report)
    return report


def clear() -> dict:
    """Remove cardtool's files from the cache (and the text shards they leave empty); `usage()` of what was removed.
    A process using the cache meanwhile only recomputes what it misses."""
    from cardtool.errors import RunFailed

    root = cache_dir()
    removed, refused = {}, []
    for kind, entries in _files(root).items():
        files = size = 0
        for entry in entries:
            bytes_ = _size(entry)
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # another process cleared it first
                continue
            except OSError as e:
                refused.append(f"{entry.path}: {e.strerror or e}")
                continue
            files, size = files + 1, size + bytes_
        removed[kind] = {"files": files, "bytes": size}
    try:
        shards = sorted((root / "text").glob("[0-9a-f][0-9a-f]")) if (root / "text").is_dir() else []
    except OSError:  # a folder that cannot be there (a name too long) holds nothing to tidy
        shards = []
    for shard in shards:
        try:
            shard.rmdir()  # only when empty
        except OSError:
            pass
    refused += _unreadable(root)  # folders of entries that could not even be listed
    if refused:
        raise RunFailed(f"{len(refused)} of cardtool's cache files or folders could not be removed, e.g. "
                        f"{refused[0]}", {"path": str(root), **removed})
    return {"path": str(root), **removed}
