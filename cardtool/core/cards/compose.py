"""`cardtool cards compose BASE ADAPTER_CARD… --id ID`: one serving card that extends BASE and declares the
adapters of several adapter cards trained on it (each `lora`/`controlnet` card adds one), so one base serves them
all, chosen per request. The adapter files are copied (the written card verifies their sha256); the recipe names
BASE and every adapter card as parents, so a lineage walks back to how each adapter was made."""

from __future__ import annotations

from pathlib import Path

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import check_new_folder, check_new_id
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.writer import card_folder, write_card
from cardtool.core.training.derived import extends_reference
from cardtool.errors import BadInput
from cardtool.shell_words import shell_join

__all__ = ["compose_cards"]


def compose_cards(base_ref: str, adapter_refs: list[str], card_id: str, out: Path | None = None,
                  overwrite: bool = False, command: str | None = None) -> Card:
    out = card_folder(card_id, out)
    base = load_card(locate(base_ref))
    if not adapter_refs:
        raise BadInput("name at least one adapter card to compose")
    adapters, copies, parents, owners, seen = {}, {}, [base.id], {}, set()
    for ref in adapter_refs:
        card = load_card(locate(ref))
        if card.file.resolve() == base.file.resolve():
            raise BadInput(f"'{ref}' is BASE itself; name the adapter cards made on it")
        if card.file.resolve() in seen:
            raise BadInput(f"adapter card '{card.id}' is named twice")
        seen.add(card.file.resolve())
        parent = card.sources[1].file if len(card.sources) > 1 else None  # the manifest it extends
        if parent is None or parent.resolve() != base.file.resolve():
            raise BadInput(f"'{card.id}' does not extend '{base.id}' directly; its adapters were made for another "
                           "transformer")
        own = {n: a for n, a in card.manifest.adapters.items() if n not in base.manifest.adapters}
        if not own:
            raise BadInput(f"'{card.id}' adds no adapter to '{base.id}'")
        for name, spec in own.items():
            if name in adapters:
                raise BadInput(f"adapter cards '{owners[name]}' and '{card.id}' both declare an adapter '{name}'; a "
                               "serving card takes each name once")
            owners[name] = card.id
            entry = spec.model_dump(mode="json", exclude_none=True)
            entry.pop("sha256", None)
            entry["weights"] = f"adapters/{name}.safetensors"
            copies[entry["weights"]] = card.weights_file(name, "adapters")
            adapters[name] = entry
        parents.append(card.id)
        check_new_id(card_id, [base, card], "give the serving card another --id")
        check_new_folder(out, [base, card])
    manifest = {"schema": "cardtool/v1", "id": card_id,
                "description": f"{base.id} serving the adapters of {', '.join(parents[1:])}",
                "extends": extends_reference(base, out),
                "adapters": adapters,
                "recipe": {"method": "import", "parents": parents, "assumes": {"loop": "denoise"},
                           "command": command or shell_join(["cardtool", "cards", "compose", base_ref, *adapter_refs,
                                                             "--id", card_id])},
                "parity": {"consistency": "C1"}}
    return write_card(out, manifest, {}, copies=copies, overwrite=overwrite)
