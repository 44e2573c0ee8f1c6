"""`cardtool cards diff A B`: the manifest fields B changes, and how far each weights file moved, tensor by tensor."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.diff import diff_cards
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.weight_files import sha256_file

QUERY = "blocks.0.attn1.to_q.weight"


def tweaked(examples, tensors: dict, guidance: float = 2.0, name: str = "tweaked", metadata=None):
    """A card extending tiny-base with its transformer's tensors replaced by `tensors` and another default guidance."""
    folder = examples / name
    folder.mkdir()
    save_file(tensors, str(folder / "transformer.safetensors"), metadata=metadata)
    (folder / "card.yaml").write_text(
        f"schema: cardtool/v1\nid: {name}\nextends: tiny-base\ncomponents:\n  transformer:\n"
        f"    weights: transformer.safetensors\n    sha256: {sha256_file(folder / 'transformer.safetensors')}\n"
        f"loops:\n  denoise:\n    defaults: {{guidance: {guidance}}}\n"
        "recipe: {method: finetune, parents: [tiny-base]}\n")
    return folder


def test_a_scaled_tensor_is_the_one_change_reported_with_its_exact_size(examples):
    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    changed = {**base, QUERY: base[QUERY] * np.float32(1.1)}
    report = diff_cards(load_card(examples / "tiny-base"), load_card(tweaked(examples, changed)))
    assert report["manifest"]["loops.denoise.defaults.guidance"] == [4.0, 2.0]
    assert report["manifest"]["extends"] == [None, "tiny-base"] and not any("sha256" in k for k in report["manifest"])
    status = {w["name"]: w for w in report["weights"]}
    assert status["vae"]["status"] == status["invert"]["status"] == "same"
    assert "text_encoder" not in status, "a packaged encoder has no weights file of the card's"
    moved = status["transformer"]
    assert moved["status"] == "changed" and moved["tensors_changed"] == 1 and moved["tensors"] == len(base)
    (row,) = moved["largest"]
    delta = changed[QUERY].astype(np.float64) - base[QUERY]
    assert row["tensor"] == QUERY and row["relative_change"] == pytest.approx(0.1, rel=1e-6)
    assert row["max_abs_change"] == pytest.approx(np.abs(delta).max(), rel=1e-12)
    whole = np.sqrt(sum(float((t.astype(np.float64) ** 2).sum()) for t in base.values()))
    assert moved["relative_change"] == pytest.approx(np.linalg.norm(delta) / whole, rel=1e-9)


def test_bfloat16_weights_are_compared_by_their_values(examples):
    import torch
    from safetensors.torch import save_file as save_torch

    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    folder = tweaked(examples, base)
    rounded = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in base.items()}
    save_torch(rounded, str(folder / "transformer.safetensors"))
    text = (folder / "card.yaml").read_text().splitlines()
    (folder / "card.yaml").write_text("\n".join(
        f"    sha256: {sha256_file(folder / 'transformer.safetensors')}" if "sha256" in line else line
        for line in text) + "\n")
    moved = next(w for w in diff_cards(load_card(examples / "tiny-base"), load_card(folder), top=200)["weights"]
                 if w["name"] == "transformer")
    wide = {k: v.astype(np.float64) for k, v in base.items()}
    expected = {k: float(np.linalg.norm(rounded[k].double().numpy() - v) / np.linalg.norm(v))
                for k, v in wide.items() if np.linalg.norm(v) > 0}
    got = {r["tensor"]: r["relative_change"] for r in moved["largest"]}
    assert got and set(got) <= set(expected)
    assert all(got[k] == pytest.approx(expected[k], rel=1e-9) and 0 < got[k] < 2**-8 for k in got), \
        "bf16 rounding: under half a bf16 step, widened exactly"


def test_components_only_one_card_has_are_added_or_removed(examples):
    report = diff_cards(load_card(examples / "tiny-base"), load_card(examples / "tiny-judge"))
    status = {(w["section"], w["name"]): w["status"] for w in report["weights"]}
    assert status[("components", "transformer")] == "removed" and status[("adapters", "invert")] == "removed"
    assert "added" in status.values()


def test_the_command_prints_a_table_or_one_json_document_and_imports_no_torch(examples, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    tweaked(examples, {**base, QUERY: np.zeros_like(base[QUERY])}, name="zeroed")
    tweaked(examples, base)
    result = CliRunner().invoke(app, ["cards", "diff", "zeroed", "tweaked", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    moved = next(w for w in report["weights"] if w["name"] == "transformer")
    # a tensor that was all zero (as a LoRA's B starts) has no relative change: null, listed first
    assert moved["largest"][0] == {"tensor": QUERY, "relative_change": None,
                                   "max_abs_change": pytest.approx(float(np.abs(base[QUERY]).max()))}
    assert moved["tensors_changed"] == 1 and 0 < moved["relative_change"] < 1
    table = CliRunner().invoke(app, ["cards", "diff", "tiny-base", "zeroed"], env={"COLUMNS": "200"})
    assert table.exit_code == 0 and "loops.denoise.defaults.guidance" in table.stdout, table.stdout
    assert re.search(r"loops\.denoise\.defaults\.guidance\s*│\s*4\.0\s*│\s*2\.0\s*│", table.stdout), "A's value, B's"
    assert f"1 of {len(base)}" in table.stdout and f"{QUERY} (1)" in table.stdout, table.stdout
    missing = CliRunner().invoke(app, ["cards", "diff", "tiny-base", "nope"])
    assert missing.exit_code == 2 and "nope" in missing.stderr
    for top in (0, 3):  # the tensors listed per changed file: at most --top, here of the one that changed
        listed = CliRunner().invoke(app, ["cards", "diff", "tiny-base", "zeroed", "--top", str(top), "--json"])
        moved = next(w for w in json.loads(listed.stdout)["weights"] if w["name"] == "transformer")
        assert len(moved["largest"]) == min(top, moved["tensors_changed"]) and moved["tensors_changed"] == 1
    assert CliRunner().invoke(app, ["cards", "diff", "tiny-base", "zeroed", "--top", "-1"]).exit_code == 2


def test_another_file_holding_the_same_values_is_the_same(examples):
    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    folder = tweaked(examples, dict(reversed(base.items())), metadata={"note": "rewritten"})
    assert sha256_file(folder / "transformer.safetensors") != sha256_file(examples / "tiny-base" /
                                                                         "transformer.safetensors")
    report = diff_cards(load_card(examples / "tiny-base"), load_card(folder))
    assert next(w for w in report["weights"] if w["name"] == "transformer") == {
        "section": "components", "name": "transformer", "status": "same"}


def test_changes_are_listed_largest_first_five_by_default_and_read_a_chunk_at_a_time(examples, monkeypatch):
    from cardtool.core.cards import diff

    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    names = sorted(k for k, v in base.items() if np.abs(v).max() > 0)[:7]
    changed = {**base, **{k: base[k] * np.float32(1 + 0.1 * (i + 1)) for i, k in enumerate(names)}}
    changed[names[0]] = np.zeros_like(base[names[0]])  # -100 %
    a, b = load_card(examples / "tiny-base"), load_card(tweaked(examples, changed))
    moved = next(w for w in diff_cards(a, b)["weights"] if w["name"] == "transformer")
    ratios = [r["relative_change"] for r in moved["largest"]]
    assert moved["tensors_changed"] == 7 and len(ratios) == 5
    assert ratios == pytest.approx([1.0, 0.7, 0.6, 0.5, 0.4], rel=1e-6)
    assert [r["tensor"] for r in moved["largest"]] == [names[0], *names[6:2:-1]]
    listed = CliRunner().invoke(app, ["cards", "diff", str(a.folder), str(b.folder), "--json"])  # the command's too
    assert [w for w in json.loads(listed.stdout)["weights"] if w["name"] == "transformer"][0]["largest"] == \
        json.loads(json.dumps(moved["largest"]))
    back = next(w for w in diff_cards(b, a)["weights"] if w["name"] == "transformer")
    assert back["largest"][0] == {"tensor": names[0], "relative_change": None,
                                  "max_abs_change": pytest.approx(float(np.abs(base[names[0]]).max()))}, \
        "a tensor all zero in A has no ratio: listed first"
    monkeypatch.setattr(diff, "_CHUNK", 7)  # every tensor over several reads, the last one short
    chunked = next(w for w in diff_cards(a, b, top=7)["weights"] if w["name"] == "transformer")
    assert chunked["largest"][1]["max_abs_change"] == pytest.approx(
        float(np.abs(changed[names[6]].astype(np.float64) - base[names[6]]).max()), rel=1e-12)
    assert chunked["relative_change"] == pytest.approx(moved["relative_change"], rel=1e-12)


def test_integer_tensors_are_equal_or_not_and_an_all_zero_file_moved_by_nothing(tmp_path):
    """A plugin's component with no implied layout may hold integer tensors (a step counter): changed or not, no
    ratio; a file whose floats are all zero and unchanged moved by 0, not by an unknown amount."""
    from cardtool.core.cards import diff

    class Weights:  # what diff reads of a card: where a component's weights file is
        def __init__(self, path):
            self.path = path

        def weights_file(self, name, section):
            return self.path

    files = []
    for k, step in enumerate((1, 2, 1)):
        files.append(tmp_path / f"{k}.safetensors")
        save_file({"w": np.zeros(4, np.float32), "step": np.array([step], np.int64), "index": np.arange(3)},
                  str(files[-1]), metadata={"k": str(k)})
    moved = diff._weights("components", "counter", Weights(files[0]), Weights(files[1]), 5)
    assert moved["largest"] == [{"tensor": "step", "relative_change": None, "max_abs_change": None}]
    assert moved["tensors_changed"] == 1 and moved["relative_change"] == 0.0, "no float moved: 0, not unknown"
    assert diff._weights("components", "counter", Weights(files[0]), Weights(files[2]), 5)["status"] == "same"
    # a float that moved beside integers that did not: only it is listed (each integer read to its own end)
    save_file({"w": np.ones(4, np.float32), "step": np.array([1], np.int64), "index": np.arange(3)},
              str(tmp_path / "moved.safetensors"))
    moved = diff._weights("components", "counter", Weights(files[0]), Weights(tmp_path / "moved.safetensors"), 5)
    assert [row["tensor"] for row in moved["largest"]] == ["w"] and moved["largest"][0]["max_abs_change"] == 1.0
    # a float that became an integer of the same shape is changed, with no ratio
    save_file({"w": np.zeros(4, np.int32), "step": np.array([1], np.int64), "index": np.arange(3)},
              str(tmp_path / "cast.safetensors"))
    cast = diff._weights("components", "counter", Weights(files[0]), Weights(tmp_path / "cast.safetensors"), 5)
    assert cast["largest"] == [{"tensor": "w", "relative_change": None, "max_abs_change": None}]
    # B's weights overflowed: how far they moved is not a number, not inf
    save_file({"w": np.array([np.inf, 1, 1, 1], np.float32), "step": np.array([1], np.int64), "index": np.arange(3)},
              str(tmp_path / "inf.safetensors"))
    blown = diff._weights("components", "counter", Weights(tmp_path / "moved.safetensors"),
                          Weights(tmp_path / "inf.safetensors"), 5)
    assert blown["relative_change"] is None and blown["largest"][0]["relative_change"] is None


def test_the_table_names_tensors_of_another_shape_or_in_one_card_only(examples, monkeypatch):
    """A card of another config (another patch, no cross-attention norm, a block more) shares tensors it cannot be
    compared on: the table said "0 of N, 0" as if nothing had changed; they are now counted and named, as --json
    lists them."""
    from cardtool.backends.wan_config import WanDiTConfig

    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    config = {"dim": 32, "depth": 3, "heads": 2, "ffn_dim": 64, "patch": [1, 4, 4], "text_dim": 384, "freq_dim": 64,
              "cross_attn_norm": False}
    shapes = WanDiTConfig(**config).tensors()
    folder = examples / "other"
    folder.mkdir()
    save_file({k: base[k] if k in base and base[k].shape == shape else np.zeros(shape, np.float32)
               for k, shape in shapes.items()}, str(folder / "transformer.safetensors"))
    (folder / "card.yaml").write_text(
        f"schema: cardtool/v1\nid: other\nextends: tiny-base\ncomponents:\n  transformer:\n"
        f"    config: {json.dumps(config)}\n    weights: transformer.safetensors\n"
        f"    sha256: {sha256_file(folder / 'transformer.safetensors')}\n"
        "recipe: {method: finetune, parents: [tiny-base]}\n")
    result = CliRunner().invoke(app, ["cards", "diff", "tiny-base", "other", "--json"])
    assert result.exit_code == 0, result.stdout
    moved = next(w for w in json.loads(result.stdout)["weights"] if w["name"] == "transformer")
    reshaped = ["patch_embedding.weight", "proj_out.bias", "proj_out.weight"]
    assert moved["reshaped"] == reshaped and moved["tensors_changed"] == 0
    assert moved["only_in_a"] == ["blocks.0.norm2.bias", "blocks.0.norm2.weight", "blocks.1.norm2.bias",
                                  "blocks.1.norm2.weight"] and len(moved["only_in_b"]) == 25
    table = CliRunner().invoke(app, ["cards", "diff", "tiny-base", "other"], env={"COLUMNS": "1000"}).stdout
    assert f"0 of {len(base) + 25}, 3 reshaped, 4 only in tiny-base, 25 only in other" in table, table
    assert f"reshaped: {', '.join(reshaped)}; only in tiny-base: blocks.0.norm2.bias, blocks.0.norm2.weight, " \
           "blocks.1.norm2.bias, …; only in other: blocks.2." in table, table
