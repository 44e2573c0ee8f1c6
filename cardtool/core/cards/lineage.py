"""Lineage: walk `recipe.parents` from a card back to its roots (base → rl → distilled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import display_path
from cardtool.errors import AmbiguousCard, CardNotFound, CardValidationError, Problem

__all__ = ["LineageNode", "lineage", "missing_parent_problems"]


@dataclass
class LineageNode:
    """A card in a lineage; `missing` marks a parent id that no search root holds."""

    id: str
    method: str | None
    folder: Path | None
    parents: list[LineageNode] = field(default_factory=list)
    missing: bool = False

    def to_json(self) -> dict:
        return {"id": self.id, "method": self.method, "path": display_path(self.folder) if self.folder else None,
                "missing": self.missing, "parents": [p.to_json() for p in self.parents]}

    def chain(self) -> list[LineageNode] | None:
        """Root-first list of cards when the lineage is a single line, else None."""
        if len(self.parents) > 1:
            return None
        if not self.parents:
            return [self]
        above = self.parents[0].chain()
        return above + [self] if above is not None else None


def lineage(card: Card) -> LineageNode:
    """The tree of `card`'s parents, grandparents … to the roots. A cycle is a CardValidationError."""
    return _walk(card, ())


def _walk(card: Card, below: tuple[str, ...]) -> LineageNode:
    node = LineageNode(card.id, card.manifest.recipe.method, card.folder)
    for i, parent_id in enumerate(card.manifest.recipe.parents):
        if parent_id in below + (card.id,):
            cycle = " → ".join(below + (card.id, parent_id))
            raise CardValidationError([card.problem(("recipe", "parents", str(i)), f"parents form a cycle: {cycle}",
                                                    "a card cannot descend from itself; remove one parent")])
        try:
            parent = load_card(locate(parent_id, near=card.folder.parent))
        except CardNotFound:
            node.parents.append(LineageNode(parent_id, None, None, missing=True))
            continue
        except AmbiguousCard as e:
            raise CardValidationError([card.problem(("recipe", "parents", str(i)), str(e))]) from None
        node.parents.append(_walk(parent, below + (card.id,)))
    return node


def missing_parent_problems(card: Card, node: LineageNode) -> list[Problem]:
    """A problem for each parent of `card` that cannot be found (its lineage has no root there)."""
    return [card.problem(("recipe", "parents", str(i)), f"parent card '{p.id}' cannot be found",
                         "put the parent card beside this one, in ./cards or on CARDTOOL_PATH")
            for i, p in enumerate(node.parents) if p.missing]
