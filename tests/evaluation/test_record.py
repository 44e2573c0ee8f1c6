"""`cardtool eval --record`: the full report beside the manifest, a summary at the card's defaults inside it."""

from __future__ import annotations

import hashlib
import json

import pytest

from cardtool.core.cards.loader import load_card
from cardtool.core.cards.record import record_eval


def row(steps, guidance, precision, accuracy):
    return {"steps": steps, "guidance": guidance, "guidance_interval": [0.0, 1.0], "precision": precision,
            "images": 10, "class_accuracy": accuracy}


def test_record_keeps_the_table_beside_the_card_and_the_default_rows_in_it(examples):
    card = load_card(examples / "tiny-base")
    defaults = card.manifest.loops["denoise"].defaults
    rows = [row(s, g, p, 0.1 * s) for p in ("float32", "bfloat16") for g in (1.0, defaults["guidance"])
            for s in (2, defaults["steps"])]
    report = {"card": "tiny-base", "judge": "j", "platform": "cpu/x", "per_class": 1, "floors": {"a": 1.0},
              "kid_floors": {"a": 0.1}, "rows": rows, "warnings": []}
    record_eval(str(examples / "tiny-base"), report)
    summary = load_card(examples / "tiny-base", checksums=True).manifest.recipe.metrics["eval"]
    stored = (card.folder / summary["report"]).read_bytes()
    assert json.loads(stored) == report and summary["sha256"] == hashlib.sha256(stored).hexdigest()
    assert [(r["precision"], r["steps"], r["guidance"]) for r in summary["rows"]] == [
        ("float32", defaults["steps"], defaults["guidance"]), ("bfloat16", defaults["steps"], defaults["guidance"])]
    assert summary["rows_in_report"] == 8 and summary["floors"] == {"a": 1.0} and summary["judge"] == "j"


def test_a_record_that_fails_leaves_the_old_report_and_summary_together(examples, monkeypatch):
    from cardtool.core.cards import record

    report = {"rows": [row(2, 4.0, "float32", 0.5)]}
    record_eval(str(examples / "tiny-base"), report)
    folder = examples / "tiny-base"
    before = ((folder / "eval.json").read_bytes(), (folder / "card.yaml").read_bytes())

    def broken(card_ref, metrics):
        raise RuntimeError("disk full")

    monkeypatch.setattr(record, "record_metrics", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        record_eval(str(folder), {"rows": [row(3, 4.0, "float32", 0.9)]})
    assert ((folder / "eval.json").read_bytes(), (folder / "card.yaml").read_bytes()) == before
