"""Lineage: walk `recipe.parents` from a card back to its roots (base → rl → distilled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cardtool.core.cards.discovery import locate, scans_once
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import display_path
from cardtool.errors import AmbiguousCard, BadInput, CardNotFound, CardValidationError, Problem

__all__ = ["LineageNode", "check_new_folder", "check_new_id", "lineage", "missing_parent_problems"]


MAX_DEPTH = 128  # cards from one to its farthest root: far beyond a real lineage, well within Python's recursion


@dataclass
class LineageNode:
    """A card in a lineage; `missing` marks a parent id that no search root holds, `recorded` one read from the
    `recipe.ancestors` an export keeps (that card is not on this disk). A card two descendants name (a diamond of
    parents) is one node, walked and shown once."""

    id: str
    method: str | None
    folder: Path | None
    parents: list[LineageNode] = field(default_factory=list)
    missing: bool = False
    recorded: bool = False

    def to_json(self, shown: set[str] | None = None) -> dict:
        """The tree as nested documents; a card already shown (`repeated`) is not shown again with its parents."""
        shown = set() if shown is None else shown
        repeated = self.id in shown
        shown.add(self.id)
        return {"id": self.id, "method": self.method, "path": display_path(self.folder) if self.folder else None,
                "missing": self.missing, "recorded": self.recorded, "repeated": repeated,
                "parents": [] if repeated else [p.to_json(shown) for p in self.parents]}

    def chain(self) -> list[LineageNode] | None:
        """Root-first list of cards when the lineage is a single line, else None."""
        if len(self.parents) > 1:
            return None
        if not self.parents:
            return [self]
        above = self.parents[0].chain()
        return above + [self] if above is not None else None

    def nodes(self) -> list[LineageNode]:
        """This card and every card above it, each once, nearest first."""
        seen, order, queue = {self.id}, [self], list(self.parents)
        while queue:
            node = queue.pop(0)
            if node.id not in seen:
                seen.add(node.id)
                order.append(node)
                queue += node.parents
        return order

    def above(self) -> list[LineageNode]:
        """Every card above this one that is known (found or recorded), each once, nearest first."""
        return [node for node in self.nodes()[1:] if not node.missing]


def lineage(card: Card) -> LineageNode:
    """The tree of `card`'s parents, grandparents … to the roots: each parent found on the search roots, else read
    from the ancestors a card on the way recorded (the nearest record first), else marked missing; each card walked
    once however many descendants name it. A cycle, or a lineage deeper than MAX_DEPTH, is a CardValidationError.
    The search roots are read once for the whole walk."""
    with scans_once():
        return _walk(card, (), {}, {})


def _walk(card: Card, below: tuple[str, ...], recorded: dict, walked: dict[str, LineageNode]) -> LineageNode:
    recorded = {**{a.id: a for a in card.manifest.recipe.ancestors}, **recorded}
    node = walked[card.id] = LineageNode(card.id, card.manifest.recipe.method, card.folder)
    node.parents = [_parent(card, ("recipe", "parents", str(i)), parent_id, below + (card.id,), recorded, walked)
                    for i, parent_id in enumerate(card.manifest.recipe.parents)]
    return node


def _parent(card: Card, where: tuple[str, ...], parent_id: str, below: tuple[str, ...], recorded: dict,
            walked: dict[str, LineageNode]) -> LineageNode:
    """The node of `parent_id`, a parent of the last id in `below`; `card` is the nearest card on disk below it,
    whose folder the search starts beside and whose manifest a problem names."""
    if parent_id in below:
        raise CardValidationError([card.problem(where, f"parents form a cycle: {' → '.join(below + (parent_id,))}",
                                                "a card cannot descend from itself; remove one parent")])
    if parent_id in walked:  # named by another descendant too: walked once
        return walked[parent_id]
    if len(below) >= MAX_DEPTH:
        raise CardValidationError([card.problem(where, f"the lineage is deeper than {MAX_DEPTH} cards",
                                                "a lineage this long is not one cardtool made; check the parents")])
    try:
        parent = load_card(locate(parent_id, near=card.folder.parent))
    except CardNotFound:
        record = recorded.get(parent_id)
        if record is None:
            node = walked[parent_id] = LineageNode(parent_id, None, None, missing=True)
            return node
        node = walked[parent_id] = LineageNode(parent_id, record.method, None, recorded=True)
        node.parents = [_parent(card, ("recipe", "ancestors"), p, below + (parent_id,), recorded, walked)
                        for p in record.parents]
        return node
    except AmbiguousCard as e:
        raise CardValidationError([card.problem(where, str(e))]) from None
    return _walk(parent, below, recorded, walked)


def missing_parent_problems(card: Card, node: LineageNode) -> list[Problem]:
    """A problem for each parent of `card` that cannot be found (its lineage has no root there)."""
    return [card.problem(("recipe", "parents", str(i)), f"parent card '{p.id}' cannot be found",
                         "put the parent card beside this one, in ./cards or on CARDTOOL_PATH")
            for i, p in enumerate(node.parents) if p.missing]


def check_new_id(card_id: str, parents: list[Card], fix: str) -> None:
    """A card made from `parents` may not take the id of a card in their lineage: its own lineage would loop back to
    itself, and a lookup of the id beside it would find two cards. Checked before the work that makes it."""
    for parent in parents:
        node = _lineage_or_self(parent)
        if card_id in {n.id for n in node.nodes()}:
            where = "its parent's" if card_id == parent.id else f"a card '{parent.id}' descends from"
            raise BadInput(f"card id '{card_id}' is {where}: the new card would descend from itself; {fix}")


def check_new_folder(folder: Path | str, parents: list[Card]) -> None:
    """A card made from `parents` may not be written over the folder of a card in their lineage or of one they extend
    (`--force`, `--overwrite`): the swap would delete the weights the new card is made from, and the ids that name
    them would name nothing or the new card itself. Checked before the work that makes it."""
    from cardtool.core.cards.writer import same_folder

    for parent in parents:
        held = [(n.id, n.folder) for n in _lineage_or_self(parent).nodes() if n.folder is not None]
        held += [(source.data.get("id"), source.file.parent) for source in parent.sources]
        for holder, place in held:
            if same_folder(place, Path(folder)):
                raise BadInput(f"{folder} is the folder of '{holder}', which the new card is made from or descends "
                               "from: replacing it would delete what the new card reads; write the new card to another "
                               "folder")


def _lineage_or_self(card: Card) -> LineageNode:
    try:
        return lineage(card)
    except CardValidationError:  # a card whose own lineage is broken: itself is what is known
        return LineageNode(card.id, None, card.folder)
