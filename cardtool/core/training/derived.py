"""Cards made from another card (a DMD2 student, an RL'd policy): how the new card names its parent in `extends`,
the fingerprint that says which run made it, and its eval at its own loop defaults, recorded in it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cardtool.core import distributed
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import MANIFEST_NAMES, peek_id
from cardtool.errors import BadInput, CardtoolError, RunFailed, write_remedy
from cardtool.paths import utf8_name

__all__ = ["card_name", "default_id", "extends_reference", "evaluate_output", "held_out_output", "recipe_fingerprint",
           "trained_parts", "write_output"]


def card_name(ref: str) -> str:
    """What a card made from the card `ref` is named after (`BASE-nft`, `TEACHER-2step`): the id that card declares,
    however it is named — a folder, a manifest file, a copy in a folder of another name; where it cannot be read
    (its own error comes when it is loaded), the name of its folder."""
    try:
        declared = peek_id(locate(ref))
    except CardtoolError:
        declared = None
    if isinstance(declared, str):
        return declared
    path = Path(ref)
    return path.parent.name if path.name in MANIFEST_NAMES else path.name or ref


def default_id(ref: str, suffix: str) -> str:
    """`NAME-SUFFIX`, the id of a card made from the card `ref` (NAME its `card_name`) where the recipe names none:
    BadInput, naming the way out, where that is no card id (a long name, a folder named with spaces) — not a recipe
    error of a card.id the command never gave."""
    from cardtool.core.cards.schema import checked_name

    card_id = f"{card_name(ref)}-{suffix}"
    try:
        return checked_name(card_id)
    except ValueError:
        load_card(locate(ref))  # a parent that does not load (named by its folder here) says its own error first
        shown = repr(card_id) if len(card_id) <= 80 else repr(card_id[:60]) + f"… ({len(card_id)} characters)"
        raise BadInput(f"the new card's default id, {shown} (its parent's name and '-{suffix}'), is no card id: one "
                       "starts with a letter or digit and uses only letters, digits, '.', '_' and '-', at most 128; "
                       "name the card with --set card.id=ID") from None


def extends_reference(parent: Card, out: Path) -> str:
    """The id where that finds this very parent from the new card's folder (a built-in parent, or one beside it),
    else the relative path — refused (BadInput) where that path is no text a manifest can hold: a folder on it named
    with bytes that are not UTF-8. The commands ask before their work (`writable_outputs`), not at the card's write."""
    try:
        if locate(parent.id, near=out.parent.resolve()).resolve() == parent.file.resolve():
            return parent.id
    except BadInput:
        pass
    reference = os.path.relpath(parent.folder.resolve(), out.parent.resolve() / out.name)
    if not utf8_name(reference):
        raise BadInput(f"the new card extends '{parent.id}', which its manifest names by the path {reference!r}, and "
                       "a manifest (UTF-8 text) cannot hold it: a folder on it is named with bytes that are not UTF-8; "
                       f"rename that folder, copy the card to one whose name is UTF-8, or write the new card "
                       f"(--out) where '{parent.id}' is found by its id"[:600])
    return reference


def recipe_fingerprint(recipe, data: str | None = None) -> str:
    """sha256 of the resolved recipe with each parent named by what it is — its id and the manifest parts that
    decide a run (components with their weights' sha256, loops, adapters) — not by where it or its files lie, and
    `data`, the digest of what the run trains on where the recipe does not say it (DMD2's GAN images from --data,
    rl's --prompts). Two runs with one fingerprint make the same card, so a re-run (the flywheel's stages) can skip
    it."""
    document = {"recipe": recipe.shaping(("parents",)), "parents": _by_content(recipe),
                **({"data": data} if data else {})}
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()


def parents_digest(recipe) -> str:
    """sha256 of the recipe's parent cards named by what they are (as `recipe_fingerprint` names them): what a
    resumed run must train from again — a parent replaced in place since its checkpoint would change the run midway."""
    return hashlib.sha256(json.dumps(_by_content(recipe), sort_keys=True).encode()).hexdigest()


def _by_content(recipe) -> list[dict]:
    parents = []
    for ref in recipe.parents:
        manifest = load_card(locate(ref)).manifest
        parts = manifest.model_dump(mode="json", include={"components", "loops", "adapters"})
        for section in ("components", "adapters"):
            for entry in parts[section].values():
                if entry.get("sha256"):  # the content names the file; its path depends on where the cards lie
                    entry.pop("weights", None)
        parents.append({"id": manifest.id, **parts})
    return parents


def check_eval_data(data: str | None, what: str, per_class: int) -> None:
    """The splits an eval of `per_class` images a class after the work reads (`data`, else the default), read before
    the work: a folder that is not there, that holds no labelled images, or too few for the eval, is refused now, not
    after hours of training."""
    from cardtool.core.evaluation.evaluate import eval_splits

    try:
        test = eval_splits(data, per_class)[0]
    except BadInput as e:
        raise BadInput(f"{what}: {e}") from None
    test.classes(what)


def evaluate_output(card: Card, judge: str, device: str | None, data: str | None = None, on_eval=None,
                    per_class: int = 100) -> Card:
    """`cardtool eval` at the card's own defaults, recorded (eval.json beside it, summary in the recipe)."""
    from cardtool.core.cards.record import record_eval

    command = _eval_command(card, judge, device, data, per_class)
    return _evaluated(card, judge, device, data, on_eval, per_class,
                      lambda report: record_eval(str(card.folder), report),
                      lambda e: f"the card {card.folder} was written, but its eval failed: {e}; run `{command}` "
                                "once it can")


def held_out_output(card: Card, judge: str, device: str | None, data: str | None, on_eval, per_class: int) -> Card:
    """Class accuracy at the card's defaults under a judge that was never the reward (nor the eval's judge), recorded
    beside the eval as `held_out_judge`."""
    from cardtool.core.cards.record import record_metrics

    def record(report: dict) -> None:
        row = report["rows"][0]
        record_metrics(str(card.folder), {"held_out_judge": {"card": report["judge"], "images": row["images"],
                                                             "class_accuracy": row["class_accuracy"]}})

    command = _eval_command(card, judge, device, data, per_class, record=False)
    return _evaluated(card, judge, device, data, on_eval, per_class, record,
                      lambda e: f"the card {card.folder} was written and its eval recorded, but the held-out judge's "
                                f"eval failed: {e}; `{command}` measures it once it can")


def _evaluated(card: Card, judge: str, device: str | None, data: str | None, on_eval, per_class: int, record,
               failed) -> Card:
    """The written card evaluated at its defaults under `judge`, the report given to `record` (and `on_eval`) on rank
    0, and the card loaded again. An eval that fails keeps its kind — bad input (a judge that is no reward card) or a
    failed run (NaN images) — and says `failed(error)`: the card is kept, and how to measure it later."""
    from cardtool.core.evaluation.evaluate import evaluate

    try:
        evaluated = evaluate(str(card.folder), judge=judge, device=device, data=data, per_class=per_class)
    except CardtoolError as e:
        raise (RunFailed if isinstance(e, RunFailed) else BadInput)(failed(e)) from None
    if evaluated.rank == 0:  # under torchrun every rank samples its share, rank 0 records
        report = evaluated.to_json()
        record(report)
        if on_eval:
            on_eval(report)
    distributed.ranks().barrier()
    return load_card(card.folder)


def _eval_command(card: Card, judge: str, device: str | None, data: str | None, per_class: int,
                  record: bool = True) -> str:
    """The eval a run would have made of its card: its judge and data, not eval's defaults, quoted for a shell."""
    from cardtool.shell_words import shell_join

    return shell_join(["cardtool", "eval", str(card.folder), "--judge", judge, *(["--data", data] if data else []),
                       *(["--per-class", str(per_class)] if per_class != 100 else []),
                       *(["--device", device] if device else []), *(["--record"] if record else [])])


def write_output(folder: Path, manifest: dict, weights: dict, run_dir: Path, **options) -> Card:
    """`write_card` on rank 0 (every process when there is one); the other ranks load the card once it is in place.
    A disk that fails here loses nothing: the run's last checkpoint holds the trained weights, and `--resume` on it
    only writes the card."""
    from cardtool.core.cards.writer import write_card
    from cardtool.core.training.trainer import CHECKPOINT

    ranks = distributed.ranks()
    try:
        card = write_card(folder, manifest, weights, **options) if ranks.main else None
    except OSError as e:
        raise RunFailed(f"cannot write the card to {folder}: {e.strerror or e}; the trained weights are in "
                        f"{Path(run_dir) / CHECKPOINT} — {write_remedy(e)} and run the same command with --resume to "
                        "write the card") from None
    except BadInput as e:  # checked before training; another process took the folder or the card id meanwhile
        raise BadInput(f"{e}. The trained weights are in {Path(run_dir) / CHECKPOINT}: the same command with "
                       "--resume and the change writes the card without training again") from None
    ranks.barrier()
    ranks.sees(folder / "card.yaml", "--out (the flywheel's --out-dir)")  # the others load what rank 0 wrote
    return card if ranks.main else load_card(folder)


def trained_parts(module, name: str, lora, adapter: str, parent: Card) -> tuple[dict, dict, dict, dict]:
    """What a post-training run made, as the new card's manifest parts, weight files, their header metadata and its
    loop's default adapters: the whole transformer (it replaces the parent's, whose adapters then no longer apply)
    or, with `lora`, a LoRA named `adapter` that the card adds and its loop applies by default."""
    inherited = parent.manifest.adapters
    defaults = parent.manifest.loops["denoise"].defaults.get("adapters") if "denoise" in parent.manifest.loops else None
    if lora is None:
        parts = {"components": {name: {"weights": "transformer.safetensors"}},
                 **({"adapters": {n: None for n in inherited}} if inherited else {})}
        return parts, {"transformer.safetensors": module.state_dict()}, {}, {"adapters": None} if defaults else {}
    from cardtool.backends.lora import lora_file
    from cardtool.backends.lora_targets import DEFAULT_TARGETS

    if adapter in inherited:
        raise BadInput(f"'{parent.id}' already declares an adapter '{adapter}'; the LoRA this run trains would "
                       "replace it — train from a card without one")
    rel = f"adapters/{adapter}.safetensors"
    tensors, metadata = lora_file(*module.lora.weights(), lora.rank, lora.alpha)
    entry = {"kind": "lora", "target": name, "weights": rel, "rank": lora.rank, "alpha": lora.alpha,
             **({"targets": list(lora.targets)} if tuple(lora.targets) != DEFAULT_TARGETS else {})}
    return {"adapters": {adapter: entry}}, {rel: tensors}, {rel: metadata}, {"adapters": {adapter: 1.0}}
