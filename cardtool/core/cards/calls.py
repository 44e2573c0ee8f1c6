"""Cards made from cards, from Python — `cardtool.merge`, `cardtool.compose`, `cardtool.extract_lora`,
`cardtool.export` and `cardtool.import_diffusers` (and `cardtool.diff`, which compares two) — each the `cardtool
cards` command of that name as one call: the same checks before any work, the same card written atomically, and the
command line it equals recorded in it (`recipe.command`), as the command records it. An argument of a type the
command line could not have given is BadInput naming it, not a TypeError deep in the work."""

from __future__ import annotations

import numbers
import os

from cardtool.core.arguments import as_int, card_ref, check, maybe_path, path, sequence
from cardtool.errors import BadInput, said_as_cardtool_errors

MAX_TOP = 1000  # tensors listed per weights file

__all__ = ["compose", "diff", "export", "extract_lora", "import_diffusers", "merge"]


@said_as_cardtool_errors
def merge(cards: list, *, card_id: str, out: str | os.PathLike | None = None, overwrite: bool = False):
    """`cardtool cards merge CARD[=WEIGHT]... --id ID`: the weighted average of cards made from one model (a model
    soup). `cards` holds ids or paths, each alone or as a (card, weight) pair; no weights: an equal mix. Returns
    the Merge: `card`, `weights`, `merged` (the components averaged) and `loops_differ`."""
    from cardtool.core.cards.merge import merge_cards

    shares = [_share(item) for item in sequence("cards", cards, "a list of cards, each alone or with its weight")]
    _card_out(card_id, out, overwrite)
    return merge_cards(shares, card_id, maybe_path(out), overwrite)


@said_as_cardtool_errors
def compose(base: str | os.PathLike, adapter_cards: list, *, card_id: str, out: str | os.PathLike | None = None,
            overwrite: bool = False):
    """`cardtool cards compose BASE ADAPTER_CARD... --id ID`: one card serving the adapters of several adapter
    cards made on `base` (a list of them, or one), chosen per request. Returns the Card."""
    from cardtool.core.cards.compose import compose_cards

    listed = [adapter_cards] if isinstance(adapter_cards, (str, os.PathLike)) else \
        sequence("adapter_cards", adapter_cards, "a list of cards (or one card)")
    refs = [card_ref("adapter_cards", item) for item in listed]
    base = card_ref("base", base)
    _card_out(card_id, out, overwrite)
    return compose_cards(base, refs, card_id, maybe_path(out), overwrite)


@said_as_cardtool_errors
def extract_lora(base: str | os.PathLike, tuned: str | os.PathLike, *, rank: int, card_id: str,
                 adapter: str | None = None, out: str | os.PathLike | None = None, overwrite: bool = False):
    """`cardtool cards extract-lora BASE TUNED --rank R --id ID`: an adapter card on `base` whose LoRA approximates
    `tuned` (each layer's change truncated by SVD to `rank`). Returns the Extraction: `card`, `adapter`, `rank`,
    `modules`, `linear_share` and `kept`."""
    from cardtool.core.cards.lora_extract import extract_lora as run

    base, tuned = card_ref("base", base), card_ref("tuned", tuned)
    check(texts={"adapter": adapter}, paths={}, flags={}, whole={"rank": rank}, callbacks={})
    _card_out(card_id, out, overwrite)
    return run(base, tuned, as_int(rank), card_id, adapter=adapter, out=maybe_path(out), overwrite=overwrite)


@said_as_cardtool_errors
def export(card: str | os.PathLike, out: str | os.PathLike, *, format: str = "hf", overwrite: bool = False):
    """`cardtool cards export CARD --out OUT`: the card for people who do not use cardtool (`hf`: a Hugging Face
    model folder whose transformer diffusers loads). Returns the exported Card."""
    from cardtool.core.cards.export import export_card

    card, out = card_ref("card", card), path("out", out)
    if not isinstance(format, str):
        raise BadInput(f"format must be a format's name (text), got {format!r}"[:300])
    check(texts={}, paths={}, flags={"overwrite": overwrite}, whole={}, callbacks={})
    return export_card(card, out, fmt=format, overwrite=overwrite)


@said_as_cardtool_errors
def import_diffusers(source: str | os.PathLike, *, base: str | os.PathLike, card_id: str,
                     out: str | os.PathLike | None = None, variant: str | None = None, overwrite: bool = False):
    """`cardtool cards import SOURCE --base BASE --id ID`: a card from a diffusers WanTransformer3DModel folder
    (or a model folder with one in transformer/), on `base`'s text encoder, VAE and loop. Returns the Card."""
    from cardtool.core.cards.diffusers_import import import_diffusers as run

    source, base = path("source", source), card_ref("base", base)
    check(texts={"variant": variant}, paths={}, flags={}, whole={}, callbacks={})
    _card_out(card_id, out, overwrite)
    return run(source, base, card_id, maybe_path(out), variant=variant, overwrite=overwrite)


@said_as_cardtool_errors
def diff(a: str | os.PathLike, b: str | os.PathLike, *, top: int = 5) -> dict:
    """`cardtool cards diff A B`: what card `b` changes of card `a` — its manifest fields, and how far each weights
    file moved (‖B − A‖ / ‖A‖, the `top` tensors that moved most listed) — as the command's `--json` document."""
    from cardtool.core.cards.diff import diff_cards
    from cardtool.core.cards.loader import load_card

    a, b = card_ref("a", a), card_ref("b", b)
    check(texts={}, paths={}, flags={}, whole={"top": top}, callbacks={})
    if not 0 <= top <= MAX_TOP:
        raise BadInput(f"--top must be from 0 to {MAX_TOP}, got {top}")
    return diff_cards(load_card(a), load_card(b), as_int(top))


def _share(item) -> str:
    """A card and its weight as the command line writes it: CARD=WEIGHT, or CARD alone."""
    if isinstance(item, (tuple, list)):
        if len(item) != 2 or isinstance(item[1], bool) or not isinstance(item[1], numbers.Real):
            raise BadInput(f"a share of a merge is a card or a (card, weight) pair, got {item!r}"[:300])
        return f"{card_ref('cards', item[0])}={float(item[1])!r}"
    return card_ref("cards", item)


def _card_out(card_id, out, overwrite) -> None:
    """The new card's id (text: the card checks it is an id), its folder and whether it may replace one."""
    if not isinstance(card_id, str):
        raise BadInput(f"card_id must be the new card's id (text), got {card_id!r}"[:300])
    check(texts={}, paths={"out": out}, flags={"overwrite": overwrite}, whole={}, callbacks={})
