"""Recording measured metrics into a card's recipe, atomically, keeping the manifest's other text; an eval's
full table goes to a report file beside the manifest, its summary into the manifest."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import yaml

from cardtool.atomic import write_atomic
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.cards.yaml_splice import with_metrics
from cardtool.errors import BadInput

__all__ = ["EVAL_REPORT", "eval_summary", "record_eval", "record_metrics", "recordable"]

EVAL_REPORT = "eval.json"


def recordable(card_ref: str):
    """The card, if results can be recorded in its manifest (a YAML one, in a folder that can be written — a card
    installed read-only cannot — and not a built-in card inside the installed package, which pip replaces):
    checked before the work, not after it."""
    from cardtool.atomic import writable_folder
    from cardtool.core.cards.discovery import installed_dir
    from cardtool.shell_words import shell_join

    card = load_card(card_ref)
    if card.file.suffix != ".yaml":
        raise BadInput(f"--record writes YAML manifests; {card.file} is TOML")
    installed = installed_dir()
    if installed is not None and card.folder.resolve().is_relative_to(installed.resolve()):
        raise BadInput(f"card '{card.id}' is built in, installed with cardtool in {card.folder}: an upgrade or a "
                       "reinstall would replace it and the record with it; copy its folder "
                       f"({shell_join(['cp', '-r', card.folder, f'my-{card.id}'])}) and record into the copy by its "
                       "path")
    writable_folder(card.folder, "the card folder --record writes into")
    return card


@contextlib.contextmanager
def _recording(folder: Path) -> Iterator[None]:
    """One recording into a card folder at a time: a blocking advisory `flock` on the folder itself, held for the
    milliseconds of a read-modify-write. Two runs recording into one card at once (an rl run's held-out judge, a CI
    job's eval) each keep what they add, and a summary always describes the report beside it. Unlocked where there
    is no flock (Windows, some network file systems)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def record_metrics(card_ref: str, metrics: dict) -> None:
    """Merge `metrics` into recipe.metrics of the card's own manifest (YAML cards) and re-validate."""
    card = recordable(card_ref)
    with _recording(card.folder):
        _merge(card, metrics)


def _merge(card, metrics: dict) -> None:
    before = card.file.read_bytes()  # read under the lock: another's record kept
    text = before.decode("utf-8")
    data = yaml.safe_load(text)
    recipe = data["recipe"] = data.get("recipe") or {}
    recipe["metrics"] = {**(recipe.get("metrics") or {}), **metrics}
    # the metrics written into the text as it is (its comments and layout kept); the whole manifest dumped anew only
    # where its layout is not one that edit understands
    after = with_metrics(text, recipe["metrics"]) or yaml.safe_dump(data, sort_keys=False, allow_unicode=True,
                                                                    width=110)
    write_atomic(card.file, after.encode("utf-8"), durable=True)
    try:
        load_card(card.file, checksums=True)
    except Exception:
        write_atomic(card.file, before, durable=True)  # never leave a card that does not load
        raise


def record_eval(card_ref: str, report: dict) -> None:
    """The whole report as `eval.json` beside the manifest, and its summary as recipe.metrics.eval: a large
    table stays out of the manifest every generate call parses."""
    card = recordable(card_ref)
    data = (json.dumps(report, indent=1) + "\n").encode()
    path = card.folder / EVAL_REPORT
    loop = card.manifest.loops.get("denoise")
    defaults = FlowDenoiseDefaults.model_validate(loop.defaults if loop else {})
    with _recording(card.folder):
        before = path.read_bytes() if path.is_file() else None
        write_atomic(path, data, durable=True)
        try:
            _merge(card, {"eval": eval_summary(report, defaults, hashlib.sha256(data).hexdigest())})
        except Exception:  # the manifest kept its old summary: keep the report it describes
            if before is None:
                path.unlink(missing_ok=True)
            else:
                write_atomic(path, before, durable=True)
            raise


def eval_summary(report: dict, defaults: FlowDenoiseDefaults, sha256: str) -> dict:
    """Where the report is, what judged it, its floors, and its rows at the card's loop defaults (one per
    precision; every row when none is at the defaults)."""
    wanted = (defaults.steps, defaults.guidance, list(defaults.guidance_interval))
    at_defaults = [r for r in report["rows"] if (r["steps"], r["guidance"], list(r["guidance_interval"])) == wanted]
    return {"report": EVAL_REPORT, "sha256": sha256, "rows_in_report": len(report["rows"]),
            **{k: report[k] for k in ("judge", "platform", "per_class", "floors", "kid_floors",
                                 "manifold_floors") if k in report},
            "rows": at_defaults or report["rows"]}
