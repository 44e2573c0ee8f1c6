"""What an rl or distill run makes of its parent (derived.py): the new card's parts and its name."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from cardtool.backends.lora import TrainableLora
from cardtool.backends.lora_targets import DEFAULT_TARGETS
from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.training.derived import card_name, trained_parts
from cardtool.core.training.distill import distill_recipe
from cardtool.core.training.lora_settings import LoraSettings
from cardtool.core.training.rl import rl_recipe
from cardtool.errors import BadInput, CardValidationError


def with_default_invert(examples, tmp_path):
    """tiny-base whose loop applies its LoRA `invert` by default."""
    folder = shutil.copytree(examples / "tiny-base", tmp_path / "tiny-inverting")
    manifest = folder / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: tiny-inverting").replace(
        "solver: euler}", "solver: euler, adapters: {invert: 0.5}}"))
    return load_card(folder)


def test_a_whole_transformer_drops_the_parents_adapters_and_their_defaults(examples, tmp_path):
    """The parent's LoRAs were trained on its weights, not the tuned ones: the new card removes them, and its loop's
    default stack with them (else every request would ask for an adapter the card no longer has)."""
    module = torch.nn.Linear(2, 2)
    parts, weights, metadata, defaults = trained_parts(module, "transformer", None, "nft",
                                                       with_default_invert(examples, tmp_path))
    assert parts == {"components": {"transformer": {"weights": "transformer.safetensors"}},
                     "adapters": {"invert": None}}
    assert list(weights) == ["transformer.safetensors"] and metadata == {} and defaults == {"adapters": None}
    _, _, _, plain = trained_parts(module, "transformer", None, "nft", load_card(examples / "tiny-base"))
    assert plain == {}, "no default stack to turn off"


@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, ("blocks.*.attn1.to_q", "blocks.1.ffn.net.2")])
def test_a_lora_is_added_beside_the_parents_and_records_only_targets_other_than_the_default(examples, targets):
    parent = load_card(examples / "tiny-base")
    dit = ModelInstance(parent, Platform("cpu", "generic")).component("transformer")
    settings = LoraSettings(rank=2, targets=targets)
    module = SimpleNamespace(lora=TrainableLora(dit, settings.targets, settings.rank, settings.alpha))
    parts, weights, metadata, defaults = trained_parts(module, "transformer", settings, "nft", parent)
    entry = parts["adapters"]["nft"]
    assert (entry["rank"], entry["alpha"], entry["weights"]) == (2, 2.0, "adapters/nft.safetensors")
    assert entry.get("targets") == (None if targets == DEFAULT_TARGETS else list(targets))
    assert defaults == {"adapters": {"nft": 1.0}} and list(weights) == list(metadata) == ["adapters/nft.safetensors"]
    with pytest.raises(BadInput, match="'tiny-base' already declares an adapter 'invert'"):
        trained_parts(module, "transformer", settings, "invert", parent)


def test_a_new_card_is_named_after_the_id_its_parent_declares_however_the_parent_was_named(examples, tmp_path):
    """`distill cards/x/card.yaml` made a student 'card.yaml-4step', and a copy in a folder of another name (an
    export, a checkout) named the new card after the folder."""
    copy = shutil.copytree(examples / "tiny-base", tmp_path / "exported")
    for ref in (examples / "tiny-base" / "card.yaml", copy, copy / "card.yaml", f"{examples}/tiny-base/"):
        assert card_name(str(ref)) == "tiny-base", ref
        assert distill_recipe(str(ref), steps=2).card.id == "tiny-base-2step"
        assert rl_recipe(str(ref), str(examples / "tiny-judge")).card.id == "tiny-base-nft"
    # one that cannot be read is named after its folder; loading it later says what is wrong with it
    assert card_name(str(tmp_path / "gone" / "card.yaml")) == card_name(str(tmp_path / "gone")) == "gone"


def test_a_default_id_that_is_no_card_id_is_refused_naming_the_way_out(examples, tmp_path):
    """A parent whose id is near the 128-character limit makes an id past it: said of the default id, with the option
    that names the card — not as an error of a card.id the command never gave."""
    long = "a" * 125
    copy = shutil.copytree(examples / "tiny-base", tmp_path / "long")
    (copy / "card.yaml").write_text((copy / "card.yaml").read_text().replace("id: tiny-base", f"id: {long}"))
    for make, suffix in ((lambda *sets: distill_recipe(str(copy), None, list(sets), steps=2), "2step"),
                         (lambda *sets: rl_recipe(str(copy), str(examples / "tiny-judge"), None, None, list(sets)),
                          "nft")):
        with pytest.raises(BadInput, match=f"the new card's default id, '{long[:60]}'… \\({126 + len(suffix)} "
                                           f"characters\\) \\(its parent's name and '-{suffix}'\\), is no card id: .* "
                                           "name the card with --set card.id=ID"):
            make()
        assert make("card.id=short").card.id == "short"
    # a parent that does not load, named by its folder (with a space): its own error, not the id's
    broken = shutil.copytree(copy, tmp_path / "my card")
    (broken / "card.yaml").write_text((broken / "card.yaml").read_text().replace(f"id: {long}\n", ""))
    with pytest.raises(CardValidationError, match="id: required field is missing"):
        distill_recipe(str(broken), steps=2)
