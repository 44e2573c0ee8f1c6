"""Recording measured metrics into a card's recipe, atomically, keeping the manifest's other text."""

from __future__ import annotations

import yaml

from cardtool.atomic import write_atomic
from cardtool.core.cards.loader import load_card
from cardtool.errors import BadInput

__all__ = ["record_metrics"]


def record_metrics(card_ref: str, metrics: dict) -> None:
    """Merge `metrics` into recipe.metrics of the card's own manifest (YAML cards) and re-validate."""
    card = load_card(card_ref)
    if card.file.suffix != ".yaml":
        raise BadInput(f"--record writes YAML manifests; {card.file} is TOML")
    data = yaml.safe_load(card.file.read_text(encoding="utf-8"))
    data.setdefault("recipe", {}).setdefault("metrics", {}).update(metrics)
    before = card.file.read_bytes()
    write_atomic(card.file, yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110).encode())
    try:
        load_card(card.file, checksums=True)
    except Exception:
        write_atomic(card.file, before)  # never leave a card that does not load
        raise
