"""The card commands' domain functions: list every card on the search roots, validate cards in bulk."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.core.cards.discovery import Entry, bare_name, locate, manifest_in, scan, scans_once, search_roots
from cardtool.core.cards.lineage import lineage, missing_parent_problems
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import MANIFEST_NAMES, display_path, peek_id
from cardtool.errors import BadInput, CardValidationError, Problem, raise_if_the_machines

__all__ = ["CardSummary", "ValidationResult", "list_cards", "validate_paths"]


@dataclass
class CardSummary:
    id: str | None
    path: str
    origin: str
    method: str | None = None
    description: str = ""
    problems: list[Problem] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"id": self.id, "path": self.path, "origin": self.origin, "method": self.method,
                "description": self.description, "valid": self.valid,
                "problems": [p.to_json() for p in self.problems]}


@dataclass
class ValidationResult:
    path: str
    id: str | None
    problems: list[Problem]

    @property
    def valid(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"path": self.path, "id": self.id, "valid": self.valid,
                "problems": [p.to_json() for p in self.problems]}


def list_cards() -> list[CardSummary]:
    """Every card on the search roots, in search order; an invalid card is listed with its problems."""
    with scans_once():
        return _listed()


def _listed() -> list[CardSummary]:
    summaries, cards = [], []
    for entry in scan(search_roots()):
        summary = CardSummary(entry.id, display_path(entry.folder), entry.origin)
        try:
            card = _load(entry)
            summary.method, summary.description = card.manifest.recipe.method, card.manifest.description
            cards.append((summary, card))
        except CardValidationError as e:
            summary.problems = e.problems
        summaries.append(summary)
    for summary, card in cards:  # a lookup of the id finds both and names neither
        twins = [s.path for s in summaries if s.id == card.id and s is not summary]
        if twins:
            summary.problems.append(card.problem(("id",), f"card id '{card.id}' is also declared by "
                                                 f"{', '.join(twins)}: looking it up finds two cards",
                                                 "give each card its own id, or take one folder off the search"))
    return summaries


def _load(entry: Entry) -> Card:
    if entry.error is not None:
        raise entry.error
    return load_card(entry.file)


def validate_paths(paths: list[str], *, checksums: bool = False) -> list[ValidationResult]:
    """Validate each card (a folder, a manifest or an id) in `paths`; a folder of card folders validates each
    card.

    Beyond loading, a card's parents must be found and must not form a cycle."""
    with scans_once():
        return _validated(paths, checksums)


def _validated(paths: list[str], checksums: bool) -> list[ValidationResult]:
    results, cards = [], {}
    for target in _expand(paths):
        try:
            card = load_card(target, checksums=checksums)
            problems = missing_parent_problems(card, lineage(card))
            results.append(ValidationResult(display_path(target), card.id, problems))
            cards[len(results) - 1] = card
        except CardValidationError as e:
            results.append(ValidationResult(display_path(target), _declared_id(target), e.problems))
        except OSError as e:  # a card this user may not read (another's, on a team disk): that card fails, not all
            raise_if_the_machines(e)
            where = display_path(e.filename) if e.filename else display_path(target)
            results.append(ValidationResult(display_path(target), None, [Problem(
                where, 1, 1, "", f"cannot read {where}: {e.strerror or e}", "ask its owner for read access")]))
    for i, card in cards.items():  # siblings: wherever their folder is searched, the id names no card
        twins = [results[j].path for j, other in cards.items()
                 if other.id == card.id and other.folder.resolve() != card.folder.resolve()
                 and other.folder.parent.resolve() == card.folder.parent.resolve()]
        if twins:
            results[i].problems.append(card.problem(("id",), f"card id '{card.id}' is also declared by "
                                                    f"{', '.join(twins)} beside it: looking it up finds two cards",
                                                    "give each card its own id"))
    return results


def _declared_id(target: Path) -> str | None:
    """The id an invalid card's manifest declares, when it can be read: a script then knows which card failed."""
    try:
        file = target if target.is_file() else manifest_in(target)
        return peek_id(file) if file is not None else None
    except (CardValidationError, OSError):
        return None


def _expand(paths: list[str]) -> list[Path]:
    targets = []
    for name in paths:
        path = Path(name)
        if path.is_file():
            targets.append(path)
        elif path.is_dir():
            # hidden folders are no cards, as on the search roots: a killed run's staging copy (`.ID.tmp-PID`) would
            # fail the folder's check, or declare the card's id twice
            children = [path] if _has_manifest(path) else sorted(
                p for p in path.iterdir() if not p.name.startswith(".") and _has_manifest(p))
            if children:
                targets += children
            elif bare_name(name):  # an id that also names a folder here that is no card (a generate --out, say)
                targets.append(locate(name))
            else:
                raise BadInput(f"{display_path(path)} holds no card (no card.yaml or card.toml in it or below it)")
        else:
            targets.append(locate(name))  # an id, as every other command takes; CardNotFound says where it looked
    return targets


def _has_manifest(folder: Path) -> bool:
    """Whether the folder holds a manifest name, as a file or not (`manifest_in` says what is wrong with the rest);
    a folder this user may not look into may hold one, and loading it says it cannot be read."""
    for name in MANIFEST_NAMES:
        try:
            os.lstat(folder / name)
            return True
        except PermissionError:
            return True
        except (OSError, ValueError):
            continue
    return False
