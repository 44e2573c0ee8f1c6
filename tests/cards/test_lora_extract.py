"""`cardtool cards extract-lora BASE TUNED --rank R`: TUNED's change to BASE's transformer as a LoRA on BASE."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.lora_extract import extract_lora
from cardtool.core.cards.weight_files import sha256_file
from cardtool.core.sampling.generate import LoadedCard
from cardtool.errors import BadInput

torch.set_num_threads(1)

QUERY = "blocks.0.attn1.to_q"


@pytest.fixture
def examples(examples, monkeypatch):
    """The example cards, found by id."""
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return examples


def tuned(examples, change, name: str = "tuned", vae: bool = False):
    """A card extending tiny-base whose transformer is tiny-base's with `change(tensors)` applied."""
    tensors = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    change(tensors)
    folder = examples / name
    folder.mkdir()
    save_file(tensors, str(folder / "transformer.safetensors"))
    vae_entry = ""
    if vae:
        weights = load_file(str(examples / "tiny-base" / "vae.safetensors"))
        save_file({k: v * np.float32(1.01) for k, v in weights.items()}, str(folder / "vae.safetensors"))
        vae_entry = f"  vae:\n    weights: vae.safetensors\n    sha256: {sha256_file(folder / 'vae.safetensors')}\n"
    (folder / "card.yaml").write_text(
        f"schema: cardtool/v1\nid: {name}\nextends: tiny-base\ncomponents:\n  transformer:\n"
        f"    weights: transformer.safetensors\n    sha256: {sha256_file(folder / 'transformer.safetensors')}\n"
        f"{vae_entry}loops:\n  denoise:\n    defaults: {{steps: 3, guidance: 1.0}}\n"
        "recipe: {method: finetune, parents: [tiny-base]}\n")
    return tensors


def every_linear(tensors):
    rng = np.random.default_rng(0)
    for name, value in tensors.items():
        if name.endswith(".weight") and value.ndim == 2:
            tensors[name] = value + np.float32(0.05) * rng.standard_normal(value.shape).astype(np.float32)


def extract(examples, *args: str, card_id: str = "extracted"):
    return CliRunner().invoke(app, ["cards", "extract-lora", *args, "--id", card_id, "--out",
                                    str(examples / card_id), "--json"])


def lora(examples, card_id: str = "extracted", name: str = "tuned") -> dict:
    return load_file(str(examples / card_id / "adapters" / f"{name}.safetensors"))


def test_at_full_rank_the_adapter_card_makes_the_tuned_cards_images(examples):
    """A change to linear weights alone, extracted at full rank: the base with the LoRA is the tuned model."""
    tuned(examples, every_linear)
    result = extract(examples, "tiny-base", "tuned", "--rank", "32")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["linear_share"] == 1.0 and report["kept"] == pytest.approx(1.0, abs=1e-12)
    made = [LoadedCard(str(examples / ref)).generate("a bag", num=2, out=None).images for ref in ("tuned", "extracted")]
    for mine, theirs in zip(*made, strict=True):
        assert mine.metadata["steps"] == theirs.metadata["steps"] == "3", "the tuned card's loop defaults"
        assert np.abs(mine.pixels.astype(int) - theirs.pixels).max() <= 1
    plain = LoadedCard(str(examples / "tiny-base")).generate("a bag", num=2, steps=3, guidance=1.0, out=None).images
    assert np.abs(plain[0].pixels.astype(int) - made[0][0].pixels).max() > 10, "the change must show for this test"


def test_an_adapter_named_like_a_component_is_served_exported_and_composed_as_the_adapter(examples):
    """Extracted from a card whose id is `vae`, the LoRA is named `vae`: the card's weights lookup gave it the VAE
    component's file ("adapter 'vae' (…/tiny-base/vae.safetensors) does not fit"), found by the card fuzzer."""
    tuned(examples, every_linear, name="vae")
    assert extract(examples, "tiny-base", "vae", "--rank", "32").exit_code == 0
    made = [LoadedCard(str(examples / ref)).generate("a bag", out=None).images[0].pixels
            for ref in ("vae", "extracted")]
    assert np.abs(made[0].astype(int) - made[1]).max() <= 1
    runner = CliRunner()
    off_the_path = examples.parent  # the export keeps the card's id
    for args in (["export", "extracted", "--format", "hf", "--out", str(off_the_path / "exported")],
                 ["compose", "tiny-base", "extracted", "--id", "served", "--out", str(off_the_path / "served")]):
        result = runner.invoke(app, ["cards", *args])
        assert result.exit_code == 0, result.output
    for folder in ("exported", "served"):
        assert sha256_file(off_the_path / folder / "adapters" / "vae.safetensors") == \
            sha256_file(examples / "extracted" / "adapters" / "vae.safetensors")
        again = LoadedCard(str(off_the_path / folder)).generate("a bag", out=None, adapters=[("vae", 1.0)], steps=3,
                                                           guidance=1.0).images[0].pixels
        assert np.array_equal(again, made[1])
    diff = json.loads(runner.invoke(app, ["cards", "diff", "--json", "tiny-base", "extracted"]).stdout)
    assert {"section": "adapters", "name": "vae", "status": "added"} in diff["weights"]
    assert {"section": "components", "name": "vae", "status": "same"} in diff["weights"]
    result = extract(examples, "tiny-base", "extracted", "--rank", "32", card_id="again")  # its default stack read
    assert result.exit_code == 0, result.output
    again = LoadedCard(str(examples / "again")).generate("a bag", out=None).images[0].pixels
    assert np.abs(again.astype(int) - made[1]).max() <= 1


def test_the_api_replaces_a_card_it_made_only_when_told_to(examples):
    tuned(examples, every_linear)
    made = extract_lora("tiny-base", "tuned", 1, "extracted", out=examples / "extracted")
    with pytest.raises(BadInput, match="already"):
        extract_lora("tiny-base", "tuned", 2, "extracted", out=examples / "extracted")
    assert load_card(examples / "extracted").manifest.adapters["tuned"].rank == made.rank == 1
    assert extract_lora("tiny-base", "tuned", 2, "extracted", out=examples / "extracted", overwrite=True).rank == 2


def test_a_low_rank_lora_is_each_layers_truncated_svd(examples):
    base = load_file(str(examples / "tiny-base" / "transformer.safetensors"))
    tensors = tuned(examples, every_linear)
    result = extract(examples, "tiny-base", "tuned", "--rank", "3")
    assert result.exit_code == 0, result.output
    kept = json.loads(result.stdout)["kept"]
    file, energy, top = lora(examples), 0.0, 0.0
    for name in (n for n, v in base.items() if n.endswith(".weight") and v.ndim == 2):
        delta = tensors[name].astype(np.float64) - base[name]
        module = name.removesuffix(".weight")
        a, b = file[f"{module}.lora_A.weight"], file[f"{module}.lora_B.weight"]
        assert a.shape == (3, delta.shape[1]) and b.shape == (delta.shape[0], 3)
        u, s, vh = np.linalg.svd(delta, full_matrices=False)
        best = (u[:, :3] * s[:3]) @ vh[:3]  # Eckart–Young: the closest rank-3 matrix
        np.testing.assert_allclose(b.astype(np.float64) @ a, best, atol=1e-5)
        energy, top = energy + float((s**2).sum()), top + float((s[:3] ** 2).sum())
    assert kept == pytest.approx(top / energy, rel=1e-9)
    card = load_card(examples / "extracted", checksums=True)
    spec = card.manifest.adapters["tuned"]
    assert (spec.rank, spec.alpha) == (3, 3.0) and "blocks.*.attn1.to_q" in spec.targets
    assert card.manifest.recipe.method == "lora_extract" and card.manifest.recipe.parents == ["tiny-base", "tuned"]
    assert card.manifest.loops["denoise"].defaults["adapters"] == {"tuned": 1.0}
    assert set(card.manifest.adapters) == {"invert", "tuned"}, "the base's own adapters stay"


def test_only_the_layers_that_changed_are_adapted(examples):
    def one_layer(tensors):
        tensors[f"{QUERY}.weight"] = tensors[f"{QUERY}.weight"] + np.outer(np.arange(32), np.ones(32)).astype(
            np.float32) / 100

    tuned(examples, one_layer)
    result = extract(examples, "tiny-base", "tuned", "--rank", "32")
    assert result.exit_code == 0, result.output
    file = lora(examples)
    assert sorted(file) == [f"{QUERY}.lora_A.weight", f"{QUERY}.lora_B.weight"]
    assert load_card(examples / "extracted").manifest.adapters["tuned"].targets == [QUERY], \
        "not blocks.*: the other block's query did not change"
    run = CliRunner().invoke(app, ["generate", str(examples / "extracted"), "-p", "a bag", "--steps", "1",
                                   "--adapter", "tuned=0.5", "--adapter", "invert", "--out", str(examples / "o")])
    assert run.exit_code == 0, run.output


def test_one_kind_of_layer_changed_in_every_block_is_one_pattern_and_rank_one_is_a_rank(examples):
    def queries(tensors):
        for name in [n for n in tensors if n.endswith("attn1.to_q.weight")]:
            tensors[name] = tensors[name] + np.float32(0.05)

    tuned(examples, queries)
    made = extract_lora("tiny-base", "tuned", 1, "extracted", out=examples / "extracted", command="made by a test")
    assert made.rank == 1 and made.modules == 2 and made.kept == pytest.approx(1.0), "a constant change is rank 1"
    assert made.card.manifest.adapters["tuned"].targets == ["blocks.*.attn1.to_q"]
    assert made.card.manifest.recipe.command == "made by a test"
    assert all(t.shape[0 if k.endswith("lora_A.weight") else 1] == 1 for k, t in lora(examples).items())
    with pytest.raises(BadInput, match="has no DiT component 'vae'"):
        extract_lora("tiny-base", "tuned", 1, "other", target="vae", out=examples / "other")


def test_a_layer_smaller_than_the_rank_is_zero_padded_to_it(examples):
    """TINY_DIT's time embedding takes 4 frequencies into 8 channels: at rank 8 its A has 4 rows of zeros."""
    from helpers import TINY_DIT, tiny_tensors, write_tensors

    config = ", ".join(f"{k}: {v}" for k, v in TINY_DIT.items())
    for name, extends, seed, adapters in (("narrow", "tiny-base", 0, "adapters: {invert: null}\n"),
                                          ("narrow-tuned", "narrow", 1, "")):
        digest = write_tensors(examples / name / "transformer.safetensors", tiny_tensors("dit"), seed)
        (examples / name / "card.yaml").write_text(
            f"schema: cardtool/v1\nid: {name}\nextends: {extends}\ncomponents:\n  transformer:\n"
            f"    config: {{{config}}}\n    weights: transformer.safetensors\n    sha256: {digest}\n"
            f"{adapters}recipe: {{method: finetune, parents: [{extends}]}}\n")
    result = extract(examples, "narrow", "narrow-tuned", "--rank", "8")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kept"] == pytest.approx(1.0, abs=1e-12), "8 is every layer's full rank"
    file = lora(examples, name="narrow-tuned")
    time_a = file["condition_embedder.time_embedder.linear_1.lora_A.weight"]
    time_b = file["condition_embedder.time_embedder.linear_1.lora_B.weight"]
    assert time_a.shape == (8, 4) and not time_a[4:].any() and not time_b[:, 4:].any()
    assert time_a[:4].any() and file[f"{QUERY}.lora_A.weight"][4:].any(), "the 8×8 query uses all 8"
    run = CliRunner().invoke(app, ["generate", str(examples / "extracted"), "-p", "a bag", "--steps", "1",
                                   "--out", str(examples / "o")])
    assert run.exit_code == 0, run.output


def table_too(tensors):
    """Every linear layer changed, and the output's modulation table, which no LoRA carries."""
    every_linear(tensors)
    tensors["scale_shift_table"] = tensors["scale_shift_table"] + np.float32(5)


def test_a_change_outside_linear_layers_is_reported_as_beyond_the_lora(examples):
    tuned(examples, table_too)
    report = json.loads(extract(examples, "tiny-base", "tuned", "--rank", "32").stdout)
    assert 0 < report["linear_share"] < 0.9 and report["kept"] == pytest.approx(1.0, abs=1e-12)


def test_only_the_loops_the_base_has_get_the_tuned_settings(examples):
    """A loop the tuned card adds is not the base's: the adapter card (which extends the base) sets only the
    defaults of the base's loops that run the transformer. Its recipe records the shares to six places."""
    tuned(examples, table_too)
    manifest = examples / "tuned" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("loops:\n", "loops:\n  fast:\n    kind: flow_denoise\n"
                                                     "    uses: [text_encoder, vae, transformer]\n"
                                                     "    defaults: {steps: 2, guidance: 1.0}\n"))
    assert set(load_card(manifest.parent).manifest.loops) == {"denoise", "fast"}
    result = extract(examples, "tiny-base", "tuned", "--rank", "2")
    assert result.exit_code == 0, result.output
    card = load_card(examples / "extracted").manifest
    assert set(card.loops) == {"denoise"} and card.loops["denoise"].defaults["steps"] == 3
    report = json.loads(result.stdout)
    assert card.recipe.metrics == {"modules": report["modules"], "linear_share": round(report["linear_share"], 6),
                                   "kept": round(report["kept"], 6)}  # as recorded: to six places
    assert report["kept"] != round(report["kept"], 6) and report["linear_share"] != round(report["linear_share"], 6)


def stranger(examples):
    shutil.copytree(examples / "tiny-base", examples / "stranger")
    manifest = examples / "stranger" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: stranger"))


@pytest.mark.parametrize(("args", "make", "message"), [
    (["tiny-base", "tiny-rl", "--rank", "0"], None, "--rank must be a whole number, at least 1"),
    (["tiny-base", "tiny-base", "--rank", "2"], None, "BASE and TUNED are both 'tiny-base'"),
    (["tiny-base", "tiny-rl", "--rank", "33"], None, "(at most 32): a higher rank adds only zeros; give at most 32"),
    (["tiny-base", "tiny-rl", "--rank", "100000000"], None, "above the full rank of every linear layer"),
    (["tiny-base", "same", "--rank", "2"], lambda e: tuned(e, lambda t: None, "same"),
     "'same' does not change the linear weights of 'tiny-base'"),
    (["tiny-base", "stranger", "--rank", "2"], stranger, "share no ancestor"),
    (["tiny-base", "vae-too", "--rank", "2"], lambda e: tuned(e, every_linear, "vae-too", vae=True),
     "'vae-too' also changes vae of 'tiny-base'"),
    (["tiny-base", "tiny-rl", "--rank", "2", "--adapter", "invert"], None, "already has an adapter 'invert'"),
    (["tiny-judge", "tiny-rl", "--rank", "2"], None, "share no ancestor"),
    (["tiny-base", "tiny-rl", "--rank", "2", "--adapter", "../../evil"], None,
     "--adapter '../../evil': an adapter name starts with a letter or digit"),
    (["tiny-base", "tiny-rl", "--rank", "2", "--adapter", "a/b"], None, "--adapter 'a/b': an adapter name"),
    (["tiny-base", "tiny-rl", "--rank", "2", "--adapter", ""], None, "--adapter '': an adapter name"),
])
def test_extractions_that_cannot_work_are_refused_with_exit_2(examples, args, make, message):
    if make:
        make(examples)
    result = extract(examples, *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(json.loads(result.stdout)["error"]["message"].split())
    assert not (examples / "extracted").exists()
    assert not list(examples.parent.rglob("evil*")), "the adapter's name is its file's: it wrote outside the card"


def test_a_lora_card_is_compared_as_it_serves_so_its_lora_is_resized(examples):
    """A card that serves tiny-base with its LoRA at 0.5 changes no weights file, yet serves other weights: at the
    LoRA's own rank the extraction is that LoRA's delta, and the adapter card makes that card's images."""
    (examples / "half-invert").mkdir()
    (examples / "half-invert" / "card.yaml").write_text(
        "schema: cardtool/v1\nid: half-invert\nextends: tiny-base\nloops:\n  denoise:\n    defaults: {adapters: "
        "{invert: 0.5}}\nrecipe: {method: lora, parents: [tiny-base]}\n")
    result = extract(examples, "tiny-base", "half-invert", "--rank", "4", "--adapter", "half")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["kept"] == pytest.approx(1.0, abs=1e-12)
    invert = load_file(str(examples / "tiny-base" / "adapters" / "invert.safetensors"))
    mine = lora(examples, name="half")
    spec = load_card(examples / "tiny-base").manifest.adapters["invert"]
    for key in (k for k in invert if k.endswith("lora_A.weight")):
        module = key.removesuffix(".lora_A.weight")
        wanted = 0.5 * spec.alpha / spec.rank * invert[f"{module}.lora_B.weight"].astype(np.float64) @ invert[key]
        got = mine[f"{module}.lora_B.weight"].astype(np.float64) @ mine[key]
        np.testing.assert_allclose(got, wanted, atol=1e-5)
    made = [LoadedCard(str(examples / ref)).generate("a bag", steps=3, out=None).images[0].pixels
            for ref in ("half-invert", "extracted")]
    assert np.abs(made[0].astype(int) - made[1]).max() <= 1

    # two LoRAs of a default stack on one layer add up: invert at 0.5 and a copy of it at 0.25 serve 0.75 of it
    (examples / "twice" / "adapters").mkdir(parents=True)
    shutil.copy(examples / "tiny-base" / "adapters" / "invert.safetensors", examples / "twice" / "adapters")
    (examples / "twice" / "card.yaml").write_text(
        "schema: cardtool/v1\nid: twice\nextends: tiny-base\nadapters:\n  again: {kind: lora, target: transformer, "
        f"weights: adapters/invert.safetensors, sha256: {spec.sha256}, rank: 4, alpha: 4}}\nloops:\n  denoise:\n"
        "    defaults: {adapters: {invert: 0.5, again: 0.25}}\nrecipe: {method: lora, parents: [tiny-base]}\n")
    result = extract(examples, "tiny-base", "twice", "--rank", "4", "--adapter", "both", card_id="both")
    assert result.exit_code == 0, result.output
    both = lora(examples, "both", name="both")
    for key in (k for k in invert if k.endswith("lora_A.weight")):
        module = key.removesuffix(".lora_A.weight")
        wanted = 0.75 * spec.alpha / spec.rank * invert[f"{module}.lora_B.weight"].astype(np.float64) @ invert[key]
        np.testing.assert_allclose(both[f"{module}.lora_B.weight"].astype(np.float64) @ both[key], wanted, atol=1e-5)


def test_a_base_that_serves_with_a_lora_keeps_it_under_the_extracted_one(examples):
    (examples / "half-invert").mkdir()
    (examples / "half-invert" / "card.yaml").write_text(
        "schema: cardtool/v1\nid: half-invert\nextends: tiny-base\nloops:\n  denoise:\n    defaults: {adapters: "
        "{invert: 0.5}}\nrecipe: {method: lora, parents: [tiny-base]}\n")
    tuned(examples, every_linear)  # tiny-base's weights tuned; it serves without the LoRA
    result = extract(examples, "half-invert", "tuned", "--rank", "32")
    assert result.exit_code == 0, result.output
    assert load_card(examples / "extracted").manifest.loops["denoise"].defaults["adapters"] == {
        "invert": 0.5, "tuned": 1.0}
    made = [LoadedCard(str(examples / ref)).generate("a bag", out=None).images[0].pixels
            for ref in ("tuned", "extracted")]
    assert np.abs(made[0].astype(int) - made[1]).max() <= 1, "the base's LoRA and the extracted one: the tuned card"
