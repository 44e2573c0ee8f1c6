"""`cardtool cards merge A=W B=W …`: a card whose weights are the weighted average of related cards' weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import TINY_DIT, tiny_tensors, write_tensors
from safetensors.numpy import load_file
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.export import front_matter
from cardtool.core.cards.lineage import lineage
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.weight_files import read_metadata, sha256_file
from cardtool.core.sampling.generate import LoadedCard

torch.set_num_threads(1)


@pytest.fixture
def examples(examples, monkeypatch):
    """The example cards, found by id."""
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return examples


def merge(examples, *shares: str, card_id: str = "soup", json_: bool = True):
    args = ["cards", "merge", *shares, "--id", card_id, "--out", str(examples / card_id)]
    return CliRunner().invoke(app, args + (["--json"] if json_ else []))


def transformer(folder) -> dict:
    card = load_card(folder)
    return load_file(str(card.weights_file("transformer")))


def float16_transformer(examples, card: str, dtype=torch.float16) -> None:
    """Store the card's transformer in float16 (or `dtype`; and declare the new file's sha256)."""
    path = examples / card / "transformer.safetensors"
    old = sha256_file(path)
    save_torch({k: v.to(dtype) for k, v in load_torch(str(path)).items()}, str(path))
    manifest = next((examples / card).glob("card.*"))
    manifest.write_text(manifest.read_text().replace(old, sha256_file(path)))


def test_a_merge_holds_the_weighted_average_of_every_tensor(examples):
    result = merge(examples, "tiny-base=0.3", "tiny-rl=0.7")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["merged"] == ["transformer"] and report["weights"] == [0.3, 0.7]
    assert report["parents"] == ["tiny-base", "tiny-rl"] and report["loops_differ"] == []
    a, b, soup = transformer(examples / "tiny-base"), transformer(examples / "tiny-rl"), transformer(examples / "soup")
    assert set(soup) == set(a)
    for name, value in soup.items():
        expected = (0.3 * a[name].astype(np.float64) + 0.7 * b[name].astype(np.float64)).astype(np.float32)
        assert value.dtype == np.float32 and np.array_equal(value, expected), name
    card = load_card(examples / "soup", checksums=True)
    assert card.weights_file("vae").resolve() == (examples / "tiny-base" / "vae.safetensors").resolve(), \
        "a component the same in every card is the first card's file, not a copy"
    assert sorted(p.name for p in (examples / "soup").iterdir()) == ["card.yaml", "transformer.safetensors"]
    recipe = card.manifest.recipe
    assert recipe.method == "merge" and recipe.parents == ["tiny-base", "tiny-rl"]
    assert recipe.hyperparameters == {"weights": [0.3, 0.7]} and "cards merge" in recipe.command
    assert {n.id for n in lineage(card).nodes()} == {"soup", "tiny-base", "tiny-rl"}
    assert front_matter(card)["base_model"] == ["tiny-base", "tiny-rl"]
    assert front_matter(card)["base_model_relation"] == "merge"


def test_weights_one_and_zero_make_the_first_cards_images_bit_for_bit(examples):
    assert merge(examples, "tiny-rl=1", "tiny-base=0").exit_code == 0
    made = [LoadedCard(str(examples / ref)).generate("a red dress", steps=2, out=None).images[0].pixels
            for ref in ("tiny-rl", "soup")]
    assert np.array_equal(made[0], made[1])
    assert not np.array_equal(made[0], LoadedCard(str(examples / "tiny-base")).generate(
        "a red dress", steps=2, out=None).images[0].pixels), "the two cards must differ for this test to mean anything"


def test_no_weights_mix_equally_and_a_note_says_whose_loop_runs(examples):
    result = merge(examples, "tiny-base", "tiny-rl", "tiny-distilled", json_=False)
    assert result.exit_code == 0, result.output
    assert load_card(examples / "soup").manifest.recipe.hyperparameters["weights"] == pytest.approx([1 / 3] * 3)
    assert "note: the loops of tiny-distilled differ from tiny-base's" in " ".join(result.output.split())
    assert load_card(examples / "soup").manifest.loops["denoise"].defaults["steps"] == 30
    two = merge(examples, "tiny-base", "tiny-distilled", card_id="pair")
    assert json.loads(two.stdout)["loops_differ"] == ["tiny-distilled"], two.output


def test_a_card_folder_whose_path_holds_an_equals_sign_is_a_card_not_a_weight(examples, monkeypatch):
    shutil.copytree(examples / "tiny-rl", examples / "runs=2" / "tiny-rl")
    monkeypatch.chdir(examples)
    result = merge(examples, "tiny-base", "runs=2/tiny-rl")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weights"] == [0.5, 0.5]
    weighted = merge(examples, "tiny-base=0.25", "runs=2/tiny-rl=0.75", card_id="soup2")
    assert json.loads(weighted.stdout)["weights"] == [0.25, 0.75], weighted.output
    shutil.copytree(examples / "tiny-rl", examples / "tiny-rl=0.75")  # a number after the last '=' is a weight
    assert json.loads(merge(examples, "tiny-base=0.25", "tiny-rl=0.75", card_id="soup3").stdout)["weights"] == [
        0.25, 0.75]


def test_the_merged_file_keeps_the_first_cards_file_metadata(examples):
    path = examples / "tiny-rl" / "transformer.safetensors"
    old = sha256_file(path)
    save_torch(load_torch(str(path)), str(path), metadata={"trained_by": "tiny-rl's run"})
    manifest = next((examples / "tiny-rl").glob("card.*"))
    manifest.write_text(manifest.read_text().replace(old, sha256_file(path)))
    assert merge(examples, "tiny-rl=0.5", "tiny-base=0.5").exit_code == 0
    assert read_metadata(examples / "soup" / "transformer.safetensors") == {"trained_by": "tiny-rl's run"}


def test_a_float16_card_merges_with_a_float32_one_into_float32_without_rounding(examples):
    float16_transformer(examples, "tiny-rl")
    assert merge(examples, "tiny-base=0.5", "tiny-rl=0.5").exit_code == 0
    a, b, soup = transformer(examples / "tiny-base"), transformer(examples / "tiny-rl"), transformer(examples / "soup")
    name = "blocks.0.attn1.to_q.weight"
    assert b[name].dtype == np.float16 and soup[name].dtype == np.float32
    assert np.array_equal(soup[name], (0.5 * a[name].astype(np.float64) + 0.5 * b[name]).astype(np.float32))


def test_a_float16_card_merges_with_a_bfloat16_one_into_float32_which_holds_both(examples):
    float16_transformer(examples, "tiny-base", torch.bfloat16)
    float16_transformer(examples, "tiny-rl")
    assert merge(examples, "tiny-base=0.5", "tiny-rl=0.5").exit_code == 0
    name = "blocks.0.attn1.to_q.weight"
    a, b = (load_torch(str(examples / card / "transformer.safetensors"))[name] for card in ("tiny-base", "tiny-rl"))
    soup = load_torch(str(examples / "soup" / "transformer.safetensors"))[name]
    assert (a.dtype, b.dtype, soup.dtype) == (torch.bfloat16, torch.float16, torch.float32)
    assert torch.equal(soup, (0.5 * a.double() + 0.5 * b.double()).float())


def test_extrapolating_past_a_float16_range_is_refused(examples):
    float16_transformer(examples, "tiny-base")
    float16_transformer(examples, "tiny-rl")
    result = merge(examples, "tiny-rl=1e7", "tiny-base=-9999999")
    assert result.exit_code == 2 and "beyond torch.float16" in result.output
    assert not (examples / "soup").exists()


def stranger(examples):
    """tiny-base's architecture under another id, made from nothing: a model unrelated to tiny-base."""
    shutil.copytree(examples / "tiny-base", examples / "stranger")
    manifest = examples / "stranger" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: stranger"))


def narrower(examples):
    """A card on tiny-base whose transformer is narrower (another config)."""
    folder = examples / "narrow"
    digest = write_tensors(folder / "transformer.safetensors", tiny_tensors("dit"))
    config = ", ".join(f"{k}: {v}" for k, v in TINY_DIT.items())
    (folder / "card.yaml").write_text(
        f"schema: cardtool/v1\nid: narrow\nextends: ../tiny-base\ncomponents:\n  transformer:\n"
        f"    config: {{{config}}}\n    weights: transformer.safetensors\n    sha256: {digest}\n"
        "adapters: {invert: null}\nrecipe: {method: finetune, parents: [tiny-base]}\n")


def renamed(examples):
    """tiny-base under another description only: the same weights."""
    (examples / "same").mkdir()
    (examples / "same" / "card.yaml").write_text("schema: cardtool/v1\nid: same\nextends: ../tiny-base\n"
                                                 "description: the same\nrecipe: {method: finetune, parents: "
                                                 "[tiny-base]}\n")


def adapted(examples):
    """An adapter card on tiny-base: its weights, one more adapter (a copy of tiny-base's own)."""
    (examples / "adapted" / "adapters").mkdir(parents=True)
    shutil.copy(examples / "tiny-base" / "adapters" / "invert.safetensors", examples / "adapted" / "adapters")
    (examples / "adapted" / "card.yaml").write_text(
        "schema: cardtool/v1\nid: adapted\nextends: ../tiny-base\nadapters:\n  again: {kind: lora, target: "
        "transformer, weights: adapters/invert.safetensors, rank: 4, alpha: 4}\nrecipe: {method: lora, parents: "
        "[tiny-base]}\n")


def more(examples):
    """A card on tiny-base with one component more (a second VAE): not the same set of components."""
    (examples / "more").mkdir()
    shutil.copy(examples / "tiny-base" / "vae.safetensors", examples / "more")
    (examples / "more" / "card.yaml").write_text(
        "schema: cardtool/v1\nid: more\nextends: ../tiny-base\ncomponents:\n  vae2: {kind: vae, impl: conv-vae, "
        "config: {latent_channels: 4, channels: [8, 16, 32]}, weights: vae.safetensors}\nrecipe: {method: finetune, "
        "parents: [tiny-base]}\n")


@pytest.mark.parametrize(("shares", "make", "card_id", "message"), [
    (["tiny-base=0.5", "tiny-rl=0.6"], None, "soup", "the weights sum to 1.1"),
    (["tiny-base=1e308", "tiny-rl=1e308"], None, "soup", "the weights sum to inf"),  # past a float, not a traceback
    (["tiny-base=half", "tiny-rl=0.5"], None, "soup", "the weight 'half' is not a number"),
    (["tiny-base=nan", "tiny-rl=0.5"], None, "soup", "must be a finite number"),
    (["tiny-base=0.5", "tiny-rl"], None, "soup", "give every card a weight"),
    (["tiny-base"], None, "soup", "at least two cards"),
    (["tiny-base", "tiny-base"], None, "soup", "'tiny-base' is named twice"),
    (["tiny-base", "stranger"], stranger, "soup", "share no ancestor"),
    (["tiny-base", "narrow"], narrower, "soup", "differs in its kind, impl, source or config"),
    (["tiny-base", "more"], more, "soup", "component 'vae2' is not in 'tiny-base'; merged cards have the same"),
    (["=0.5", "tiny-rl=0.5"], None, "soup", "'=0.5' names no card before '='; write CARD=WEIGHT"),
    (["more", "tiny-base"], more, "soup", "'tiny-base' has no component 'vae2', which 'more' has"),
    (["tiny-base", "same"], renamed, "soup", "hold the same weights in every component: the merge would be "
                                             "'tiny-base' itself"),
    (["tiny-base", "adapted"], adapted, "soup", "they differ only in their adapters (tiny-base: invert; adapted: "
                                                "again, invert), which a merge does not average: `cardtool cards "
                                                "compose"),
    (["tiny-base", "tiny-rl"], None, "tiny-base", "the new card would descend from itself"),
])
def test_merges_that_cannot_make_a_model_are_refused_with_exit_2(examples, shares, make, card_id, message):
    if make:
        make(examples)
    result = merge(examples, *shares, card_id=card_id, json_=False)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert not (examples / "soup").exists()


def test_the_api_replaces_a_merged_card_only_when_told_to(examples):
    from cardtool.core.cards.merge import merge_cards
    from cardtool.errors import BadInput

    merge_cards(["tiny-base=0.5", "tiny-rl=0.5"], "soup", examples / "soup")
    with pytest.raises(BadInput, match="already"):
        merge_cards(["tiny-base=0.9", "tiny-rl=0.1"], "soup", examples / "soup")
    assert load_card(examples / "soup").manifest.recipe.hyperparameters["weights"] == [0.5, 0.5]
    merge_cards(["tiny-base=0.9", "tiny-rl=0.1"], "soup", examples / "soup", overwrite=True)
    assert load_card(examples / "soup").manifest.recipe.hyperparameters["weights"] == [0.9, 0.1]


def test_cards_of_the_same_weights_and_adapters_are_refused_without_an_adapter_hint(examples):
    renamed(examples)
    message = json.loads(merge(examples, "tiny-base", "same").stdout)["error"]["message"]
    assert message.endswith("hold the same weights in every component: the merge would be 'tiny-base' itself")


def test_an_output_that_cannot_be_written_is_refused_before_the_weights_are_averaged(examples, monkeypatch):
    from cardtool.core.cards import merge as merging

    monkeypatch.setattr(merging, "_average", lambda *a: pytest.fail("averaged before the output was checked"))
    (examples / "soup").mkdir()
    (examples / "soup" / "notes.txt").write_text("mine")
    result = merge(examples, "tiny-base", "tiny-rl", json_=False)
    assert result.exit_code == 2 and "already exists" in result.output
    result = CliRunner().invoke(app, ["cards", "merge", "tiny-base", "tiny-rl", "--id", "tiny-judge"])
    assert result.exit_code == 2 and "already the id of" in " ".join(result.output.split())
    assert (examples / "soup" / "notes.txt").read_text() == "mine"


def test_a_card_another_run_puts_at_the_output_while_this_one_is_written_is_kept(examples, monkeypatch):
    """The output is checked before the work and as the card begins; a card another process finished there in the
    seconds this one took to write was swapped out and deleted — now this one is refused and the other stays."""
    from cardtool.core.cards import writer

    validate = writer.load_card

    def meanwhile(folder, **options):
        if folder.name.startswith(".soup.tmp-") and not (examples / "soup").exists():
            shutil.copytree(examples / "tiny-rl", examples / "soup")  # the other run's card, in place first
            manifest = examples / "soup" / "card.toml"
            manifest.write_text(manifest.read_text().replace('id = "tiny-rl"', 'id = "soup"', 1))
        return validate(folder, **options)

    monkeypatch.setattr(writer, "load_card", meanwhile)
    result = merge(examples, "tiny-base", "tiny-rl")
    assert result.exit_code == 2
    assert "another run wrote it while this card was being written" in json.loads(result.stdout)["error"]["message"]
    assert load_card(examples / "soup").manifest.recipe.method == "diffusion_nft", "the other run's card stays"
    assert [p.name for p in examples.iterdir() if p.name.startswith(".")] == [], "nothing left beside it"
    monkeypatch.setattr(writer, "load_card", validate)
    assert merge(examples, "tiny-base", "tiny-rl", "--overwrite").exit_code == 0
    assert load_card(examples / "soup").manifest.recipe.method == "merge", "--overwrite replaces it"
    assert merge(examples, "tiny-rl", "tiny-base", "--force").exit_code == 0, "--force is the same option"
    assert load_card(examples / "soup").manifest.recipe.parents == ["tiny-rl", "tiny-base"]


def test_tensors_a_plugins_layout_does_not_fix_average_only_when_they_match(tmp_path):
    """A component with no layout its config implies may hold integer tensors and tensors of any name: equal integers
    are kept, floats averaged; a missing, reshaped, differing-integer or float-and-integer tensor is refused."""
    from safetensors.numpy import save_file

    from cardtool.core.cards.merge import _average
    from cardtool.errors import BadInput

    def file(name, **tensors):
        path = tmp_path / f"{name}.safetensors"
        save_file({"w": np.ones(3, np.float32), "step": np.array([7], np.int64), **tensors}, str(path))
        return path

    base = file("base")
    averaged = _average([base, file("doubled", w=np.full(3, 3.0, np.float32))], [0.5, 0.5], ["a", "b"], "counter")
    assert averaged["w"].tolist() == [2.0, 2.0, 2.0] and averaged["step"].tolist() == [7]
    for other, message in ((file("extra", x=np.zeros(1, np.float32)), "tensor 'x' is not the same in 'a' and 'b'"),
                           (file("wide", w=np.ones(4, np.float32)), "tensor 'w' is not the same in 'a' and 'b'"),
                           (file("later", step=np.array([8], np.int64)), "the integer tensor 'step' differs"),
                           (file("cast", w=np.ones(3, np.int32)), "tensor 'w' is a float in one card and an integer")):
        with pytest.raises(BadInput, match=message):
            _average([base, other], [0.5, 0.5], ["a", "b"], "counter")
