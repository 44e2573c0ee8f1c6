"""Finding cards by id or path. Search order: explicit path, ./cards, CARDTOOL_PATH, the built-in cards."""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from cardtool.core.cards.source import MANIFEST_NAMES, display_path, peek_id, read_source
from cardtool.errors import AmbiguousCard, BadInput, CardNotFound, CardValidationError, raise_if_the_machines
from cardtool.files import unlistable
from cardtool.paths import home_expanded

__all__ = ["Root", "Entry", "builtin_dir", "installed_dir", "search_roots", "scan", "scans_once", "manifest_in",
           "locate", "bare_name", "unsearchable"]

# inside `scans_once`: each search's entries, by its roots — per thread (and task), so that a script's other thread
# writing a card and looking it up is never answered from this one's reading
_scans: ContextVar[dict | None] = ContextVar("cardtool_scans", default=None)


@dataclass(frozen=True)
class Root:
    """A folder whose subfolders are cards, and why it is searched."""

    path: Path
    origin: str  # "beside" | "./cards" | "CARDTOOL_PATH" | "builtin"


@dataclass(frozen=True)
class Entry:
    """A card folder found on a search root; `error` is set when its manifest cannot be read."""

    id: str | None
    file: Path
    origin: str
    error: CardValidationError | None = None

    @property
    def folder(self) -> Path:
        return self.file.parent


def builtin_dir() -> Path | None:
    """The built-in cards: `cardtool/cards` in an installed wheel, `cards/` beside the package in a checkout."""
    installed = installed_dir()
    if installed is not None:
        return installed
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file() and (checkout / "cards").is_dir():
        return checkout / "cards"
    return None


def installed_dir() -> Path | None:
    """The built-in cards of an installed wheel (`cardtool/cards`, inside the package); None in a checkout."""
    package = Path(__file__).resolve().parents[2]  # …/cardtool/core/cards/discovery.py → …/cardtool
    return package / "cards" if (package / "cards").is_dir() else None


def search_roots(near: Path | None = None) -> list[Root]:
    """The roots searched for a card id. `near` (the folder holding a card that names another card by
    id, in `extends` or `recipe.parents`) is searched first, so a family of cards can live together."""
    roots = [Root(near, "beside")] if near is not None else []
    roots.append(Root(Path.cwd() / "cards", "./cards"))
    entries = os.environ.get("CARDTOOL_PATH", "").split(os.pathsep)
    roots += [Root(Path(home_expanded(p)), "CARDTOOL_PATH") for p in entries if p]
    builtin = builtin_dir()
    if builtin is not None:
        roots.append(Root(builtin, "builtin"))
    return roots


def unsearchable(roots: list[Root]) -> list[str]:
    """Each root that finds nothing because it is not there or cannot be listed, with why: a mistyped CARDTOOL_PATH
    entry, another user's folder."""
    return [f"{display_path(r.path)} ({r.origin}{why})" for r in roots if (why := _absent(r))]


def _absent(root: Root) -> str:
    """What a search root named in CARDTOOL_PATH is when it is no folder (a mistyped entry finds nothing silently),
    and what any root is that this user may not list (searched as empty)."""
    if os.path.isdir(root.path):
        why = unlistable(root.path)
        return f": cannot be read, {why}" if why else ""
    if root.origin != "CARDTOOL_PATH":
        return ""
    return ": not a folder" if os.path.lexists(root.path) else ": no such folder"


def manifest_in(folder: Path) -> Path | None:
    """The manifest file of a card folder, None if there is none; both YAML and TOML is an error, and so is a
    manifest name held by anything but a file (a folder, a pipe, a link to nothing), which would read as no card."""
    found = [folder / name for name in MANIFEST_NAMES if (folder / name).is_file()]
    for name in MANIFEST_NAMES:
        path = folder / name
        if path not in found and os.path.lexists(path):
            raise CardValidationError.at(display_path(path), 1, 1, "", f"{display_path(path)} is not a file "
                                         f"({_kind(path)})", "make it the card's manifest, or remove it")
    if len(found) > 1:
        raise CardValidationError.at(display_path(found[1]), 1, 1, "",
                                     f"{display_path(folder)} holds both card.yaml and card.toml",
                                     "keep one manifest per card folder")
    return found[0] if found else None


def _kind(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError:
        return "a link to nothing"
    return "a folder" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode) else "a device or socket"


@contextmanager
def scans_once() -> Iterator[None]:
    """Within this block each search (the same roots) reads the card folders once. A command over many cards (`cards
    list`, `cards validate`) resolves each card's `extends` by id, and a fresh scan of every root per card read N²
    manifest headers: 300 cards extending one base took tens of seconds to list. A card written inside the block is
    not seen by a search made before it, so only commands that write no card use it."""
    token = _scans.set({} if _scans.get() is None else _scans.get())
    try:
        yield
    finally:
        _scans.reset(token)


def scan(roots: list[Root], *, ids_only: bool = False) -> list[Entry]:
    """Every card folder directly below the roots, in search order; a folder reached twice counts once. Hidden
    folders are not cards: among them the staging and swapped-out folders (`.ID.tmp-PID`, `.ID.old-PID`) that a run
    killed while writing its card leaves, which would otherwise declare the card's id a second time. With
    `ids_only` each manifest is read only as far as its id (`peek_id`): finding one card by id need not parse them
    all."""
    key, read = (tuple(roots), ids_only), _scans.get()
    if read is not None and key in read:
        return list(read[key])
    entries: list[Entry] = []
    seen: set[Path] = set()
    for root in roots:
        try:  # a root that is missing, not a folder, unreadable or not even a usable name is searched as empty
            folders = sorted(p for p in root.path.iterdir() if p.is_dir() and not p.name.startswith("."))
        except (OSError, ValueError):
            continue
        for folder in folders:
            if folder.resolve() in seen:
                continue
            file = None
            try:
                file = manifest_in(folder)
                if file is None:
                    continue
                seen.add(folder.resolve())
                if ids_only:
                    card_id = peek_id(file)
                else:
                    card_id = read_source(file).data.get("id")
                entries.append(Entry(card_id if isinstance(card_id, str) else None, file, root.origin))
            except CardValidationError as e:
                seen.add(folder.resolve())
                entries.append(Entry(None, file or folder / MANIFEST_NAMES[0], root.origin, e))
            except OSError as e:  # a folder this user may not read (another's, on a team disk): that card only
                raise_if_the_machines(e)
                seen.add(folder.resolve())
                file = file or folder / MANIFEST_NAMES[0]
                entries.append(Entry(None, file, root.origin, CardValidationError.at(
                    display_path(file), 1, 1, "", f"cannot read {display_path(file)}: {e.strerror or e}",
                    "ask its owner for read access, or take its folder off the search path")))
    if read is not None:
        read[key] = list(entries)
    return entries


def _as_path(name: str) -> Path | None:
    path = Path(home_expanded(name))
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except (OSError, ValueError) as e:  # a NUL byte, a name too long for the file system
        raise BadInput(f"not a usable card name or path: {name!r} ({e})")
    if is_file:
        return path
    if is_dir:
        file = manifest_in(path)
        if file is None and not bare_name(name):
            raise BadInput(f"{display_path(path)} is not a card folder: it holds no card.yaml or card.toml")
        return file  # None for an id that also names a folder here that is no card (a generate --out, say)
    if not bare_name(name) and os.path.lexists(path):  # a pipe, a device, a link to nothing: there, but no card
        raise BadInput(f"{display_path(path)} is {_kind(path)}, not a card folder or manifest file")
    if not bare_name(name):
        hub = hub_download(name)
        raise BadInput(f"no such card folder or manifest: {name}" + (
            f"; cardtool reads cards from disk and never downloads: a diffusers Wan transformer from the Hub becomes a "
            f"card once downloaded ({hub}; cardtool cards import DIR --base CARD --id ID)" if hub else ""))
    return None


def hub_download(name: str) -> str:
    """For a missing path written as a Hugging Face repository id (`owner/name`, no folder `owner` here: else a local
    path mistyped), the command that downloads it (a user who types one expects a download, which cardtool never
    makes); else ''."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) or os.path.lexists(name.split("/")[0]):
        return ""
    return f"huggingface-cli download {name} --local-dir DIR"


def bare_name(name: str) -> bool:
    """Whether `name` can be a card id: not written as a path (a separator, a leading dot, a manifest's suffix)."""
    return not (os.sep in name or name.startswith(".") or name.endswith((".yaml", ".toml")))


def locate(name: str, near: Path | None = None) -> Path:
    """The manifest file of the card named `name` (a path, or an id searched for on the roots)."""
    if not isinstance(name, (str, os.PathLike)):  # the Python API's callers: a BadInput, not a TypeError
        raise BadInput(f"a card is named by its id, folder or manifest file, got {name!r}"[:300])
    name = os.fspath(name)
    file = _as_path(name)
    if file is not None:
        return file
    roots = search_roots(near)
    entries = scan(roots, ids_only=True)
    matches = [e for e in entries if e.id == name]
    if not matches:
        searched = ", ".join(f"{display_path(r.path)} ({r.origin}{_absent(r)})" for r in roots) or "nothing"
        close = difflib.get_close_matches(name, sorted({e.id for e in entries if e.id}), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        if os.path.isdir(name):
            hint += f"(./{name} is a folder, not a card: it holds no card.yaml or card.toml.) "
        elif os.path.lexists(name):  # not a file either (_as_path took that): a pipe, a device, a link to nothing
            hint += f"(./{name} is {_kind(Path(name))}, not a card.) "
        unread = [display_path(e.folder) for e in entries if e.id is None and e.error is not None]
        if unread:  # the card asked for may be one of them: a manifest whose id cannot even be read
            hint += (f"{len(unread)} card folder{'s' if len(unread) > 1 else ''} there could not be read "
                     f"({', '.join(unread[:3])}{' …' if len(unread) > 3 else ''}; `cardtool cards validate FOLDER` "
                     "says why). ")
        raise CardNotFound(f"no card with id '{name}'; searched {searched}. {hint}"
                           "Give a card folder, or add its parent folder to CARDTOOL_PATH")
    beside = [e for e in matches if e.origin == "beside"]
    if len(matches) > 1 and len(beside) == 1:  # a card naming a sibling by id means its own family's, whatever else
        return beside[0].file                  # declares it (a copy of the family in ./cards, say)
    if len(matches) > 1:
        places = " and ".join(f"{display_path(e.folder)} ({e.origin})" for e in matches)
        raise AmbiguousCard(f"card id '{name}' is declared twice: {places}; rename one of them")
    return matches[0].file
