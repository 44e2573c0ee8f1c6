"""Writing a new card folder atomically: weights as safetensors, their sha256 filled into the manifest,
the whole folder validated before it is renamed into place (DESIGN.md invariant 8)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path, PurePosixPath

import yaml

from cardtool.atomic import refuse_stream, running, save_tensors, synced, writable_folder
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import MANIFEST_NAMES, display_path
from cardtool.core.cards.weight_files import sha256_file
from cardtool.errors import BadInput, CardValidationError

__all__ = ["card_folder", "card_folder_usable", "replaceable", "same_folder", "unclaimed_id", "write_card"]


def write_card(folder: Path, manifest: dict, weights: dict[str, dict], *, copies: dict[str, Path] | None = None,
               storage: str | None = "float32", overwrite: bool = False,
               metadata: dict[str, dict] | None = None, texts: dict[str, str] | None = None) -> Card:
    """Write `manifest` (components/adapters naming files in `weights` or `copies`) into `folder`.

    `weights` maps a relative file name to a state dict of torch tensors, stored at `storage` precision
    (floating tensors only; None keeps each tensor's dtype), with the header `metadata` given for that name (a LoRA's
    rank and alpha); `copies` maps a relative name to an existing file copied as is, `texts` to a file's text."""
    import torch

    folder = Path(folder)
    for rel in [*weights, *(copies or {}), *(texts or {})]:
        _check_inside(rel)
    staging = card_folder_usable(folder, str(manifest.get("id")), overwrite) / f".{folder.name}.tmp-{os.getpid()}"
    _recover(folder)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    writing = staging  # what a failed write names (a file's write error carries no name)
    try:
        dtype = storage and getattr(torch, storage)
        for rel, state in weights.items():
            writing = staging / rel
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            stored = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().contiguous().cpu()
                      for k, v in state.items()}
            save_tensors(staging / rel, stored, (metadata or {}).get(rel))
            os.chmod(staging / rel, 0o644)  # safetensors writes 0600: a card shared on a team disk must be readable
        for rel, source in (copies or {}).items():
            writing = staging / rel
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, staging / rel)
        for rel, text in (texts or {}).items():
            writing = staging / rel
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_text(text, encoding="utf-8")
        for section in ("components", "adapters"):
            for entry in manifest.get(section, {}).values():
                if entry and entry.get("weights"):  # an inherited entry set to null is removed
                    entry["sha256"] = sha256_file(staging / entry["weights"])
        writing = staging / "card.yaml"
        (staging / "card.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False, allow_unicode=True, width=110))
        try:  # a card that would not load is never put in place
            load_card(staging, checksums=True)
        except CardValidationError as e:  # located in the folder the user named, not the staging one
            raise CardValidationError([dataclasses.replace(p, file=p.file.replace(staging.name, folder.name))
                                       for p in e.problems]) from None
        writing = staging
        for path in sorted(staging.rglob("*"), reverse=True):  # files, then the folders holding them
            synced(path)
        synced(staging)
        _swap(staging, folder, overwrite)
        synced(folder.parent)  # a power loss after this leaves the whole new card, not a folder of empty files
    except OSError as e:  # a full disk, say: named in the card folder asked for, not in the staging one
        named = [Path(os.fsdecode(name)) for name in (e.filename, e.filename2) if name]  # a copy's: source, target
        failed = next((path for path in named if path.is_relative_to(staging)), writing)
        where = folder / failed.relative_to(staging) if failed.is_relative_to(staging) else folder
        raise OSError(e.errno, e.strerror, str(where)) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return load_card(folder)


def _check_inside(rel: str) -> None:
    """A weights file named by a relative path that stays in the card folder: checked before anything is written,
    since the manifest's own check of it (on load) comes after the file is."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts:
        raise BadInput(f"the weights file {rel!r} is not a path inside the card folder")


def _recover(folder: Path) -> None:
    """Clear what a run killed while writing this card left beside it: its staging folder (`.ID.tmp-PID`) and the
    card it was swapping out (`.ID.old-PID`) — put back in place if the kill fell between the swap's two renames,
    so the card is not lost. Leftovers of a process still running are its own."""
    import glob
    import re

    for leftover in folder.parent.glob(f".{glob.escape(folder.name)}.*-*"):
        match = re.fullmatch(rf"\.{re.escape(folder.name)}\.(tmp|old)-(\d+)", leftover.name)
        if match is None or not leftover.is_dir() or running(int(match[2])):
            continue
        if match[1] == "old" and not folder.exists():
            os.replace(leftover, folder)
        else:
            shutil.rmtree(leftover, ignore_errors=True)


def card_folder(card_id: str, out: str | Path | None) -> Path:
    """Where a command writes the card `card_id`: `out`, else cards/ID — the id checked first, as the written manifest
    would check it, so that one like '../x' is refused before any work and never names a folder outside cards/."""
    from cardtool.core.cards.schema import checked_name

    try:
        checked_name(card_id)
    except ValueError:
        raise BadInput(f"--id {card_id!r}"[:200] + ": a card id starts with a letter or digit and uses only letters, "
                       "digits, '.', '_' and '-' (at most 128)") from None
    return Path(out) if out is not None else Path("cards") / card_id


def card_folder_usable(folder: Path, card_id: str, overwrite: bool, flag: str = "--overwrite",
                       fix: str = "give the new card another id, or write it off the card search path (--out)", *,
                       keep: bool = True) -> Path:
    """What would stop `write_card` putting card `card_id` at `folder`, found before the work that makes it: a path
    that names a folder by where it is ('.', '..', '/'), a folder there without `overwrite` (the command's `flag`),
    or one that is no card's; the id another card's on the search path; a parent folder that cannot be written
    (made for the proof, and removed again unless `keep`: see writable_folder). Returns that parent folder."""
    refuse_stream(folder, "a card is written as a folder of files")
    if folder.name in ("", ".."):  # no rename can put a new folder at such a path
        raise BadInput(f"{folder} names the current folder, a parent or the root, not a new folder: a card is put in "
                       f"place as a folder of its own; name one, e.g. {folder / card_id}")
    if folder.exists() or folder.is_symlink():
        if not overwrite:
            raise BadInput(f"{folder} already exists; choose another --out, or pass {flag} to replace it")
        replaceable(folder)
    unclaimed_id(card_id, folder, fix)
    return writable_folder(folder.parent, "the card's folder", keep=keep)


def unclaimed_id(card_id: str, folder: Path,
                 fix: str = "give the new card another id, or write it off the card search path (--out)") -> None:
    """A card written into a folder the card search covers (./cards, CARDTOOL_PATH, the built-in cards) may not take
    the id of another card found there: every later lookup of that id — `generate ID`, a child's `extends`, a
    lineage — would fail as ambiguous. (`distill fashion-base` run outside this repository would otherwise write a
    second `fashion-base-2step` beside the built-in one.) Replacing the very card that holds the id is fine."""
    from cardtool.core.cards.discovery import scan, search_roots

    folder = Path(folder).resolve()
    roots = search_roots()
    if not any(same_folder(root.path, folder.parent) for root in roots):
        return  # a folder of the user's own choosing, off the search path
    for entry in scan(roots, ids_only=True):
        if entry.id == card_id and not same_folder(entry.folder, folder):
            raise BadInput(f"card id '{card_id}' is already the id of {display_path(entry.folder)} ({entry.origin}); "
                           f"a second card with it in {display_path(folder.parent)} would make every lookup of the "
                           f"id ambiguous: {fix}")


def same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13) is no folder
        return False


def replaceable(folder: Path) -> None:
    """Overwriting replaces a card (a folder holding its manifest) or an empty folder — never any other folder or
    file that happens to stand at the output path, whose contents the swap would delete."""
    if folder.is_symlink() or not folder.is_dir():
        raise BadInput(f"{folder} exists and is not a folder; overwriting replaces a card folder only — choose "
                       "another --out")
    if any(folder.iterdir()) and not any((folder / name).is_file() for name in MANIFEST_NAMES):
        raise BadInput(f"{folder} is not a card folder (no card.yaml or card.toml in it); overwriting replaces a card "
                       "folder only, never another folder and what it holds — choose another --out")


def _swap(staging: Path, folder: Path, overwrite: bool) -> None:
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    if folder.exists() or folder.is_symlink():
        if not overwrite:  # checked before the work and as this card began, yet another run has put one there since
            raise BadInput(f"{folder} already exists: another run wrote it while this card was being written; "
                           "choose another --out, or pass --overwrite to replace it")
        os.replace(folder, old)
    os.replace(staging, folder)
    shutil.rmtree(old, ignore_errors=True)
