"""`cardtool eval --record`: the full report beside the manifest, a summary at the card's defaults inside it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

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

    def broken(card, metrics):
        raise RuntimeError("disk full")

    monkeypatch.setattr(record, "_merge", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        record_eval(str(folder), {"rows": [row(3, 4.0, "float32", 0.9)]})
    assert ((folder / "eval.json").read_bytes(), (folder / "card.yaml").read_bytes()) == before


def test_a_recording_waits_for_another_into_the_same_card(examples):
    """Two runs recording into one card at once (an eval --record beside an rl run's held-out judge): the second
    waits for the first's read-modify-write, so neither's metrics are lost."""
    import fcntl
    import os
    import threading

    from cardtool.core.cards.record import record_metrics

    folder = examples / "tiny-base"
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process recording now
    recording = threading.Thread(target=record_metrics, args=(str(folder), {"mine": 1}))
    recording.start()
    recording.join(0.5)
    try:
        assert recording.is_alive() and "mine" not in (folder / "card.yaml").read_text(), "it waited"
    finally:
        os.close(fd)
    recording.join(30)
    assert not recording.is_alive() and "mine: 1" in (folder / "card.yaml").read_text()


def test_a_record_keeps_the_manifest_as_written_and_makes_it_durable(examples, monkeypatch):
    """Its keys in their order, its text as typed (a σ stays a σ, not \\u03C3): a recorded card reads as before, in a
    diff too; and the new manifest reaches the disk before the call returns."""
    from helpers import fsynced

    from cardtool.core.cards.record import record_metrics

    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("description: ", "description: σ-shifted — ", 1))
    keys = list(yaml.safe_load(manifest.read_text()))
    flushed = fsynced(monkeypatch)
    record_metrics(str(examples / "tiny-base"), {"note": "ü"})
    text = manifest.read_text(encoding="utf-8")
    assert list(yaml.safe_load(text)) == keys and "σ-shifted — " in text and "note: ü" in text
    folder = str(manifest.parent.resolve())  # its data before the rename, the rename before returning
    assert [Path(f).name.startswith(".card.yaml.") for f in flushed] == [True, False] and flushed[1] == folder


def test_a_record_keeps_the_manifests_comments_and_layout_byte_for_byte(examples):
    """A card written by hand keeps its comments, flow-style mappings and spacing: only its metrics block is
    rewritten, in place, and a later record merges into that block."""
    from cardtool.core.cards.record import record_metrics

    manifest = examples / "tiny-base" / "card.yaml"
    written = manifest.read_text(encoding="utf-8").replace("recipe:\n", "recipe:  # how it was made\n", 1) + \
        "# the end of the card\n"
    manifest.write_text(written, encoding="utf-8")
    assumes = "  assumes: {loop: denoise, precision: float32}\n"  # the recipe's last entry; parity: follows
    assert written.count(assumes) == 1
    record_metrics(str(examples / "tiny-base"), {"loss": 0.5})
    assert manifest.read_text(encoding="utf-8") == written.replace(assumes, assumes + "  metrics:\n    loss: 0.5\n")
    record_metrics(str(examples / "tiny-base"), {"accuracy": {"fashion": 0.9}})
    assert manifest.read_text(encoding="utf-8") == written.replace(
        assumes, assumes + "  metrics:\n    loss: 0.5\n    accuracy:\n      fashion: 0.9\n")
    assert load_card(examples / "tiny-base").manifest.recipe.metrics == {"loss": 0.5, "accuracy": {"fashion": 0.9}}


@pytest.mark.parametrize("text, expected", [
    # the block replaced; the comment and key after it kept
    ("id: a\nrecipe:\n  metrics:\n    old: 1\n    older: [1, 2]  # old\n  # parents next\n  parents: []\n",
     "id: a\nrecipe:\n  metrics:\n    new: 2\n  # parents next\n  parents: []\n"),
    ("id: a\nrecipe:\n  metrics: {}\n  parents: []\n", "id: a\nrecipe:\n  metrics:\n    new: 2\n  parents: []\n"),
    ("id: a\nrecipe:\n    metrics:\n    method: x\n", "id: a\nrecipe:\n    metrics:\n      new: 2\n    method: x\n"),
    # none: the recipe's last entry, then the recipe itself at the end of the file
    ("recipe:\n  parents: [a, b]\n\n# tail\n", "recipe:\n  parents: [a, b]\n  metrics:\n    new: 2\n\n# tail\n"),
    ("id: a\nrecipe:\n  command: |\n    cardtool x\n# tail\n",
     "id: a\nrecipe:\n  command: |\n    cardtool x\n  metrics:\n    new: 2\n# tail\n"),
    ("id: a  # no recipe\n", "id: a  # no recipe\nrecipe:\n  metrics:\n    new: 2\n"),
    ("id: a", "id: a\nrecipe:\n  metrics:\n    new: 2\n"),
    # layouts it leaves to a whole dump
    ("id: a\nrecipe: {method: x, metrics: {}}\n", None),
    ("{id: a, recipe: {method: x}}\n", None),
    ("id: a\nrecipe:\n", None),
    ("id: a\n---\nid: b\n", None),
    ("- a\n", None),
])
def test_metrics_are_spliced_into_the_text_or_left_to_a_whole_dump(text, expected):
    from cardtool.core.cards.yaml_splice import with_metrics

    assert with_metrics(text, {"new": 2}) == expected


def test_a_record_into_a_layout_the_splice_leaves_alone_writes_the_whole_manifest(examples):
    from cardtool.core.cards.record import record_metrics

    manifest = examples / "tiny-base" / "card.yaml"
    data = yaml.safe_load(manifest.read_text())
    manifest.write_text(json.dumps(data))  # JSON is YAML: one flow mapping
    record_metrics(str(examples / "tiny-base"), {"loss": 0.5})
    assert yaml.safe_load(manifest.read_text()) == {**data, "recipe": {**data["recipe"], "metrics": {"loss": 0.5}}}
    assert load_card(examples / "tiny-base").manifest.recipe.metrics == {"loss": 0.5}


def test_a_whole_dump_keeps_the_manifests_key_order_and_its_text_as_written(examples):
    from cardtool.core.cards.record import record_metrics

    manifest = examples / "tiny-base" / "card.yaml"
    data = {**yaml.safe_load(manifest.read_text()), "description": "Größe: a tiny card — für Tests"}
    manifest.write_text(json.dumps(data))  # a flow mapping: dumped whole
    record_metrics(str(examples / "tiny-base"), {"loss": 0.5})
    text = manifest.read_text(encoding="utf-8")
    assert text.startswith("schema: cardtool/v1\nid: tiny-base\n"), "in the manifest's own order, not sorted"
    assert "Größe: a tiny card — für Tests" in text, "as written, not \\u escapes"


def test_a_record_that_would_leave_a_card_that_does_not_load_is_undone_and_said(examples, monkeypatch):
    from cardtool.core.cards import record
    from cardtool.errors import CardValidationError

    manifest = examples / "tiny-base" / "card.yaml"
    before = manifest.read_bytes()
    monkeypatch.setattr(record, "with_metrics", lambda text, metrics: text.replace("schema: cardtool/v1", "schema: x"))
    with pytest.raises(CardValidationError):
        record.record_metrics(str(examples / "tiny-base"), {"loss": 0.5})
    assert manifest.read_bytes() == before


def test_checksums_hold_the_report_to_the_summary_recorded_from_it(examples, tmp_path):
    """`cards validate --checksums`: the eval report beside the manifest is the one its summary was made from; one
    edited since is a located problem, one missing leaves the summary standing; the report travels with an export."""
    from cardtool.core.cards.export import export_card
    from cardtool.errors import CardValidationError

    card = examples / "tiny-base"
    record_eval(str(card), {"judge": "j", "rows": [row(2, 4.0, "float32", 0.5)]})
    load_card(card, checksums=True)
    exported = export_card(str(card), tmp_path / "export")
    assert (exported.folder / "eval.json").read_bytes() == (card / "eval.json").read_bytes()
    load_card(exported.folder, checksums=True)
    report = card / "eval.json"
    report.write_text(report.read_text().replace("0.5", "0.9"))
    with pytest.raises(CardValidationError, match=r"card.yaml:\d+:\d+: recipe.metrics.eval.sha256: sha256 of the eval "
                                                  r"report 'eval.json' is [0-9a-f]{64}, the recorded summary declares"):
        load_card(card, checksums=True)
    load_card(card)  # read only under --checksums, as the weights' digests are
    report.unlink()
    load_card(card, checksums=True)
    manifest = card / "card.yaml"
    manifest.write_text(manifest.read_text().replace("report: eval.json", "report: ../eval.json"))
    with pytest.raises(CardValidationError, match="the eval report '../eval.json' is not a file name beside the manif"):
        load_card(card, checksums=True)


def test_a_built_in_card_inside_the_installed_package_is_not_recorded_into(examples, monkeypatch, tmp_path):
    """pip replaces an installed package's files: a row recorded into a built-in card there would go with the next
    upgrade. Refused before any work, with how to record into a copy; a checkout's cards/ stays recordable."""
    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.core.cards import discovery

    monkeypatch.setattr(discovery, "installed_dir", lambda: examples)
    result = CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"),
                                      "--steps", "1", "--per-class", "1", "--record", "--json"])
    assert result.exit_code == 2, result.output
    message = json.loads(result.stdout)["error"]["message"]
    assert message.startswith("card 'tiny-base' is built in, installed with cardtool in ") and \
        message.endswith("my-tiny-base) and record into the copy by its path")
    assert not (examples / "tiny-base" / "eval.json").exists()
    monkeypatch.setattr(discovery, "installed_dir", lambda: tmp_path / "site-packages" / "cardtool" / "cards")
    from cardtool.core.cards.record import recordable

    assert recordable(str(examples / "tiny-base")).id == "tiny-base"
