"""The refusal of an adapter name a card does not declare, with what the name most likely meant: a declared name it
differs from in case or a letter or two; the name under which this card serves the adapter of the card the name is
the id of (`fashion-invert` → `invert`); or, for a base asked for its adapter cards' adapters, the cards on the search
path made on it that declare the name."""

from __future__ import annotations

import difflib

from cardtool.core.cards.loader import Card

__all__ = ["likely_meant", "no_such_adapter"]

_LOOKED_AT = 200  # cards on the search path read for the hint; past that, a refusal should not take seconds


def no_such_adapter(card: Card, name: str) -> str:
    """The refusal, with `likely_meant`'s sentence where there is one."""
    said = f"card '{card.id}' declares no adapter '{name}'; its adapters: {', '.join(card.manifest.adapters) or 'none'}"
    hint = likely_meant(card, name)
    return f"{said}; {hint}" if hint else said


def likely_meant(card: Card, name: str) -> str | None:
    """What an adapter name `card` does not declare most likely meant, as a sentence; None where nothing is near."""
    declared = list(card.manifest.adapters)
    close = [d for d in declared if d.casefold() == name.casefold()] or \
        difflib.get_close_matches(name, declared, n=1, cutoff=0.8)
    if close:
        return f"did you mean '{close[0]}'?"
    others = _cards_beside(card)
    named = next((c for c in others if c.id == name), None)
    if named is not None:
        own = named.sources[0].data.get("adapters")  # what it adds, not what it extends
        own = own if isinstance(own, dict) else {}
        served = [d for d, spec in card.manifest.adapters.items()
                  if d in own and _same(spec, named.manifest.adapters[d])]
        if served:
            return f"'{name}' is the card that made {_names(served)}: name the adapter, not the card"
    mine = card.file.resolve()
    serving = [c.id for c in others if name in c.manifest.adapters and mine in {s.file.resolve() for s in c.sources}]
    if serving:
        return f"cards made on it that declare '{name}': {', '.join(serving)} (use one of those)"
    return None


def _same(spec, other) -> bool:
    """One adapter: the same weights where both record their sha256, else the same kind."""
    if spec.sha256 and other.sha256:
        return spec.sha256 == other.sha256
    return spec.kind == other.kind


def _names(names: list[str]) -> str:
    return f"'{names[0]}'" if len(names) == 1 else "the adapters " + ", ".join(f"'{n}'" for n in names)


def _cards_beside(card: Card) -> list[Card]:
    """The cards on the search path (the first `_LOOKED_AT`) that load, but for `card` itself."""
    from cardtool.core.cards.discovery import scan, search_roots
    from cardtool.core.cards.loader import load_card
    from cardtool.errors import CardtoolError

    cards, mine = [], card.file.resolve()
    for entry in scan(search_roots())[:_LOOKED_AT]:
        if entry.error is not None or entry.file.resolve() == mine:
            continue
        try:
            cards.append(load_card(entry.file))
        except (CardtoolError, OSError):
            continue
    return cards
