"""`cardtool cards merge A[=W] B[=W] … --id ID`: a card whose weights are a weighted average of several cards',
θ = Σ wᵢ·θᵢ with Σ wᵢ = 1 — a model soup (Wortsman et al. 2022, arXiv 2203.05482), WiSE-FT's interpolation between
a model and its fine-tune (arXiv 2109.01903), a rewarded soup of policies tuned on different rewards (Ramé et al.
2023, arXiv 2306.04488); a weight above 1 beside a negative one extrapolates past the fine-tune (ExPO, arXiv
2404.16792). Averaging weights means something only between models fine-tuned from one start, so the cards must share
an ancestor and each averaged component the same architecture. The merged card extends the first card: its loops,
adapters and every component whose weights are the same in all cards are the first card's."""

from __future__ import annotations

import math
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import check_new_folder, check_new_id, lineage
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.weight_files import FLOAT_DTYPES, read_header, read_metadata, sha256_file
from cardtool.core.cards.writer import card_folder, card_folder_usable, write_card
from cardtool.core.training.derived import extends_reference
from cardtool.errors import BadInput
from cardtool.paths import opened_by_utf8_name
from cardtool.shell_words import shell_join

__all__ = ["Merge", "check_architecture", "check_related", "merge_cards", "parse_share"]

_SUM_TOLERANCE = 1e-6  # weights typed as decimals (0.1 + 0.2 + 0.7) sum to 1 only within rounding
_ARCHITECTURE = ("weights", "sha256", "frozen")  # a component's fields that may differ between cards merged


@dataclass(frozen=True)
class Merge:
    card: Card
    weights: list[float]  # one per parent, in the order given
    merged: list[str]  # components whose weights were averaged
    loops_differ: list[str]  # parents whose loops are not the first card's (the merged card runs the first's)


def parse_share(text: str) -> tuple[str, float | None]:
    """`CARD=WEIGHT` → (CARD, WEIGHT); a plain `CARD` → (CARD, None), also a card folder whose path holds '='."""
    ref, sep, weight = text.rpartition("=")
    if not sep:
        return text, None
    try:
        value = float(weight)
    except ValueError:
        if os.path.exists(text):  # no weight after the '=': the path of a card folder
            return text, None
        raise BadInput(f"'{text}': the weight '{weight}' is not a number; write CARD=WEIGHT") from None
    if not ref:
        raise BadInput(f"'{text}' names no card before '='; write CARD=WEIGHT")
    if not math.isfinite(value):
        raise BadInput(f"'{text}': the weight must be a finite number")
    return ref, value


def merge_cards(shares: list[str], card_id: str, out: Path | None = None, overwrite: bool = False,
                command: str | None = None) -> Merge:
    parsed = [parse_share(text) for text in shares]
    if len(parsed) < 2:
        raise BadInput("name at least two cards to merge")
    weights = _weights([w for _, w in parsed])
    cards = [load_card(locate(ref)) for ref, _ in parsed]
    check_related(cards)
    check_new_id(card_id, cards, "give the merged card another --id")
    out = card_folder(card_id, out)
    check_new_folder(out, cards)
    card_folder_usable(out, card_id, overwrite)  # before the work, not after it
    first = cards[0]
    extends = extends_reference(first, out)
    merged, state, metadata = [], {}, {}
    for name, component in first.manifest.components.items():
        check_architecture(cards, name)
        if component.weights is None or len({sha256_file(c.weights_file(name)) for c in cards}) == 1:
            continue  # the same file in every card: inherited from the first, bit for bit
        rel = f"{name}.safetensors"
        state[rel] = _average([c.weights_file(name) for c in cards], weights, [c.id for c in cards], name)
        metadata[rel] = read_metadata(first.weights_file(name)) or None
        merged.append(name)
    if not merged:
        raise BadInput(f"{', '.join(c.id for c in cards)} hold the same weights in every component: the merge would "
                       f"be '{first.id}' itself{_adapters_not_merged(cards)}")
    ids = [c.id for c in cards]
    mix = ", ".join(f"{i} ({w:g})" for i, w in zip(ids, weights, strict=True))
    manifest = {"schema": "cardtool/v1", "id": card_id, "description": f"Weight average of {mix}",
                "extends": extends,
                "components": {name: {"weights": f"{name}.safetensors"} for name in merged},
                "recipe": {"method": "merge", "parents": ids, "hyperparameters": {"weights": weights},
                           "assumes": first.manifest.recipe.assumes.model_dump(mode="json", exclude_none=True),
                           "command": command or shell_join(["cardtool", "cards", "merge", *shares, "--id", card_id])}}
    card = write_card(out, manifest, state, storage=None, overwrite=overwrite, metadata=metadata)
    loops = first.manifest.model_dump(mode="json")["loops"]
    differ = [c.id for c in cards[1:] if c.manifest.model_dump(mode="json")["loops"] != loops]
    return Merge(card, weights, merged, differ)


def _adapters_not_merged(cards: list[Card]) -> str:
    """Adapter cards on one base hold its weights and differ only in their adapters, which a merge does not average."""
    named = {c.id: sorted(c.manifest.adapters) for c in cards}
    if len({tuple(names) for names in named.values()}) == 1:
        return ""
    held = "; ".join(f"{i}: {', '.join(names)}" for i, names in named.items() if names)
    return (f"; they differ only in their adapters ({held}), which a merge does not average: `cardtool cards compose "
            "BASE ADAPTER_CARD… --id ID` serves several, chosen per request")


def _weights(given: list[float | None]) -> list[float]:
    if all(w is None for w in given):
        return [1 / len(given)] * len(given)  # a uniform soup
    if any(w is None for w in given):
        raise BadInput("give every card a weight (CARD=WEIGHT), or none for an equal mix")
    try:
        total = math.fsum(given)
    except OverflowError:  # beyond a float: nowhere near 1
        total = math.inf
    if abs(total - 1) > _SUM_TOLERANCE:
        raise BadInput(f"the weights sum to {total:g}; a merge's weights sum to 1 (θ = Σ wᵢ·θᵢ), e.g. A=0.7 B=0.3, "
                       "or A=1.5 B=-0.5 to extrapolate past B toward A")
    return list(given)


def check_related(cards: list[Card]) -> None:
    """Distinct cards with an ancestor in common: weights of unrelated models do not average into a model."""
    seen = {}
    for card in cards:
        if card.file.resolve() in seen:
            raise BadInput(f"'{card.id}' is named twice; name each card once and give it its weight")
        seen[card.file.resolve()] = card
    lines = [{node.id for node in lineage(card).nodes()} for card in cards]
    if not set.intersection(*lines):
        raise BadInput(f"{', '.join(c.id for c in cards)} share no ancestor in their lineages (cards lineage): "
                       "weights combine into a working model only between fine-tunes of one model")


def check_architecture(cards: list[Card], name: str) -> None:
    first = cards[0]
    spec = first.manifest.components[name].model_dump(mode="json", exclude=set(_ARCHITECTURE))
    for card in cards[1:]:
        other = card.manifest.components.get(name)
        if other is None:
            raise BadInput(f"'{card.id}' has no component '{name}', which '{first.id}' has; merged cards have the "
                           "same components")
        if other.model_dump(mode="json", exclude=set(_ARCHITECTURE)) != spec:
            raise BadInput(f"component '{name}' differs in its kind, impl, source or config between '{first.id}' and "
                           f"'{card.id}'; only the weights of one architecture combine")
        if (other.weights is None) != (first.manifest.components[name].weights is None):
            raise BadInput(f"component '{name}' has weights in one of '{first.id}' and '{card.id}' only")
    extra = [n for c in cards[1:] for n in c.manifest.components if n not in first.manifest.components]
    if extra:
        raise BadInput(f"component '{extra[0]}' is not in '{first.id}'; merged cards have the same components")


def _average(paths: list[Path], weights: list[float], ids: list[str], name: str) -> dict:
    """Σ wᵢ·θᵢ per tensor, in float64, stored in the widest float dtype the cards hold it in (a float16 card merged
    with a float32 one loses nothing); integer tensors must agree."""
    import torch
    from safetensors import safe_open

    headers = [read_header(path)[0] for path in paths]
    shapes = [{t: shape for t, (_, shape) in header.items()} for header in headers]
    for card_id, other in zip(ids[1:], shapes[1:], strict=True):
        if other != shapes[0]:
            odd = sorted(set(other) ^ set(shapes[0])) or sorted(t for t in other if other[t] != shapes[0][t])
            raise BadInput(f"{name}: tensor '{odd[0]}' is not the same in '{ids[0]}' and '{card_id}' (missing or "
                           "another shape); only the weights of one architecture combine")
    state = {}
    with ExitStack() as files:
        readers = [files.enter_context(safe_open(files.enter_context(opened_by_utf8_name(path)), framework="pt"))
                   for path in paths]
        for tensor in sorted(headers[0]):
            values = [reader.get_tensor(tensor) for reader in readers]
            kinds = {header[tensor][0] in FLOAT_DTYPES for header in headers}
            if kinds == {False}:
                if any(not torch.equal(v, values[0]) for v in values[1:]):
                    raise BadInput(f"{name}: the integer tensor '{tensor}' differs between the cards; it cannot be "
                                   "averaged")
                state[tensor] = values[0]
                continue
            if len(kinds) > 1:
                raise BadInput(f"{name}: tensor '{tensor}' is a float in one card and an integer in another")
            total = sum(w * v.to(torch.float64) for w, v in zip(weights, values, strict=True))
            dtypes = {v.dtype for v in values}
            if len(dtypes) > 1:
                dtypes = {torch.float64 if torch.float64 in dtypes else torch.float32}
            dtype = dtypes.pop()
            merged = total.to(dtype)
            if not bool(torch.isfinite(merged).all()):
                raise BadInput(f"{name}: tensor '{tensor}' averages to values beyond {dtype} (inf or NaN); use "
                               "smaller weights")
            state[tensor] = merged
    return state
