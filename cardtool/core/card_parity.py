"""Parity of a card: each component with a numpy forward, run by torch and by numpy on the card's weights."""

from __future__ import annotations

from cardtool.backends.component_parity import component_rows
from cardtool.backends.parity import ParityRow
from cardtool.backends.platform import Platform
from cardtool.core.loader import Card

__all__ = ["card_parity"]


def card_parity(card: Card, platform: Platform) -> list[ParityRow]:
    rows = []
    for name, component in card.manifest.components.items():
        if component.weights:
            rows += component_rows(name, component.impl, component.config, card.weights_file(name), platform)
    return rows
