"""`cardtool cards compose`: one serving card for the adapters of several adapter cards made on one base."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cardtool.backends.lora import linear_names, write_lora
from cardtool.backends.platform import Platform
from cardtool.cli import app
from cardtool.core.cards.compose import compose_cards
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.weight_files import sha256_file
from cardtool.core.sampling.instance import ModelInstance
from cardtool.errors import BadInput

ADAPTER_CARD = """\
schema: cardtool/v1
id: {id}
extends: {base}
adapters:
  {name}: {{kind: lora, target: transformer, weights: adapters/{name}.safetensors, rank: 2, alpha: 2}}
recipe: {{method: lora, parents: [tiny-base]}}
"""


def adapter_card(root, base, card_id, name, seed):
    dit = ModelInstance(load_card(root / base), Platform("cpu", "generic")).component("transformer")
    layers = linear_names(dit)
    generator = torch.Generator().manual_seed(seed)
    names = ["blocks.0.attn1.to_q", "blocks.1.ffn.net.2"]
    write_lora(root / card_id / "adapters" / f"{name}.safetensors",
               {n: torch.randn(2, layers[n].in_features, generator=generator) for n in names},
               {n: torch.randn(layers[n].out_features, 2, generator=generator) for n in names}, rank=2, alpha=2)
    (root / card_id / "card.yaml").write_text(ADAPTER_CARD.format(id=card_id, base=base, name=name))


def test_compose_serves_every_adapter_card_from_one_card(examples, tmp_path):
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    adapter_card(examples, "tiny-base", "tiny-b", "beta", 2)
    result = CliRunner().invoke(app, ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-a"),
                                      str(examples / "tiny-b"), "--id", "tiny-served", "--out",
                                      str(examples / "tiny-served"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["adapters"] == ["alpha", "beta", "invert"]
    card = load_card(examples / "tiny-served", checksums=True)
    assert card.manifest.recipe.method == "import" and card.manifest.recipe.parents == ["tiny-base", "tiny-a", "tiny-b"]
    assert card.manifest.recipe.command == (f"cardtool cards compose {examples / 'tiny-base'} {examples / 'tiny-a'} "
                                            f"{examples / 'tiny-b'} --id tiny-served")
    assert set(card.manifest.adapters) == {"invert", "alpha", "beta"}, "the base's own adapters stay"
    assert card.manifest.adapters["alpha"].sha256 == sha256_file(examples / "tiny-a" / "adapters" / "alpha.safetensors")
    validate = CliRunner().invoke(app, ["cards", "validate", str(examples / "tiny-served")])
    assert validate.exit_code == 0, validate.output
    run = CliRunner().invoke(app, ["generate", str(examples / "tiny-served"), "-p", "a bag", "--steps", "1",
                                   "--adapter", "alpha=0.5", "--adapter", "beta", "--json", "--out", str(tmp_path)])
    assert run.exit_code == 0, run.output
    assert [a["name"] for a in json.loads(run.stdout)["images"][0]["adapters"]] == ["alpha", "beta"]


def test_compose_refuses_cards_made_on_another_base_and_clashing_names(examples, tmp_path):
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    adapter_card(examples, "tiny-base", "tiny-a2", "alpha", 3)
    runner = CliRunner()
    clash = runner.invoke(app, ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-a"),
                                str(examples / "tiny-a2"), "--id", "x", "--out", str(tmp_path / "x")])
    assert clash.exit_code == 2 and "cards 'tiny-a' and 'tiny-a2' both declare an adapter 'alpha'" in clash.output
    twice = runner.invoke(app, ["cards", "compose", "tiny-base", str(examples / "tiny-a"), str(examples / "tiny-a"),
                                "--id", "x", "--out", str(tmp_path / "x")], env={"CARDTOOL_PATH": str(examples)})
    assert twice.exit_code == 2 and "adapter card 'tiny-a' is named twice" in twice.output, twice.output
    itself = runner.invoke(app, ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-base"),
                                 "--id", "x", "--out", str(tmp_path / "x")])
    assert itself.exit_code == 2 and "is BASE itself; name the adapter cards made on it" in itself.output
    other = runner.invoke(app, ["cards", "compose", str(examples / "tiny-rl"), str(examples / "tiny-a"), "--id", "y",
                                "--out", str(tmp_path / "y")])
    assert other.exit_code == 2 and "does not extend 'tiny-rl'" in other.output
    plain = runner.invoke(app, ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-rl"), "--id", "x",
                                "--out", str(tmp_path / "x")])  # tuned weights, no adapter of its own
    assert plain.exit_code == 2 and "'tiny-rl' adds no adapter to 'tiny-base'" in plain.output, plain.output
    root = runner.invoke(app, ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-judge"), "--id",
                               "z", "--out", str(tmp_path / "z")])  # a card that extends none
    assert root.exit_code == 2 and "'tiny-judge' does not extend 'tiny-base' directly" in root.output
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()


def test_a_card_that_would_not_validate_is_located_in_the_folder_asked_for(examples, tmp_path, monkeypatch):
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    args = ["cards", "compose", str(examples / "tiny-base"), str(examples / "tiny-a"), "--id", "../up", "--json"]
    refused = CliRunner().invoke(app, args)  # an id that is no card id is refused before any work, as --id
    assert refused.exit_code == 2 and "--id '../up': a card id starts with" in refused.stdout
    from cardtool.core.cards import compose

    monkeypatch.setattr(compose, "card_folder", lambda card_id, out: out)  # past that check, the staged card's own
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "served")])
    assert result.exit_code == 1, result.output
    problem = json.loads(result.stdout)["error"]["problems"][0]
    assert problem["file"].endswith("served/card.yaml") and ".tmp" not in problem["file"] and problem["field"] == "id"
    assert not (tmp_path / "served").exists() and not list(tmp_path.glob(".served*"))


def test_compose_from_python_needs_an_adapter_card_and_replaces_only_when_asked(examples, tmp_path):
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    with pytest.raises(BadInput, match="name at least one adapter card to compose"):
        compose_cards(str(examples / "tiny-base"), [], "served", out=tmp_path / "served")
    assert not (tmp_path / "served").exists()
    compose_cards(str(examples / "tiny-base"), [str(examples / "tiny-a")], "served", out=tmp_path / "served")
    with pytest.raises(BadInput, match="already exists"):
        compose_cards(str(examples / "tiny-base"), [str(examples / "tiny-a")], "served", out=tmp_path / "served")
    adapter_card(examples, "tiny-base", "tiny-b", "beta", 2)
    card = compose_cards(str(examples / "tiny-base"), [str(examples / "tiny-b")], "served", out=tmp_path / "served",
                         overwrite=True)
    assert set(card.manifest.adapters) == {"invert", "beta"}


def test_an_adapter_name_a_card_lacks_is_refused_with_what_it_likely_meant(examples, tmp_path):
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    compose_cards(str(examples / "tiny-base"), [str(examples / "tiny-a")], "tiny-served", out=examples / "tiny-served")

    def refusal(card, name):
        result = CliRunner().invoke(app, ["generate", card, "-p", "a bag", "--steps", "1", "--adapter", name, "--out",
                                          str(tmp_path / "o")], env={"CARDTOOL_PATH": str(examples), "COLUMNS": "1000"})
        assert result.exit_code == 2, result.output
        return " ".join(result.output.split())

    said = "card 'tiny-served' declares no adapter '{}'; its adapters: invert, alpha"
    assert refusal("tiny-served", "tiny-a").endswith(said.format("tiny-a") + "; 'tiny-a' is the card that made "
                                                     "'alpha': name the adapter, not the card")
    assert refusal("tiny-served", "tiny-served").endswith(said.format("tiny-served")), "not itself"
    assert refusal("tiny-served", "Alpha").endswith(said.format("Alpha") + "; did you mean 'alpha'?")
    assert refusal("tiny-served", "alpah").endswith(said.format("alpah") + "; did you mean 'alpha'?")
    assert refusal("tiny-base", "alpha").endswith("card 'tiny-base' declares no adapter 'alpha'; its adapters: "
                                                  "invert; cards made on it that declare 'alpha': tiny-a, tiny-served "
                                                  "(use one of those)")
    assert refusal("tiny-rl", "alpha").endswith("card 'tiny-rl' declares no adapter 'alpha'; its adapters: invert")

    def record_sha256(card):
        manifest, weights = examples / card / "card.yaml", examples / card / "adapters" / "alpha.safetensors"
        manifest.write_text(manifest.read_text().replace("rank: 2,", f"sha256: {sha256_file(weights)}, rank: 2,"))

    adapter_card(examples, "tiny-base", "tiny-a2", "alpha", 3)  # another 'alpha': not the weights tiny-served serves
    record_sha256("tiny-a2")
    assert refusal("tiny-served", "tiny-a2").endswith(said.format("tiny-a2")), "known by its weights' sha256"
    record_sha256("tiny-a")
    assert refusal("tiny-served", "tiny-a").endswith("; 'tiny-a' is the card that made 'alpha': name the adapter, not "
                                                     "the card")
    workflow = tmp_path / "flow.yaml"  # a workflow step's stack: the same hint, as the problem's fix
    workflow.write_text("schema: cardtool/v1\nkind: workflow\nid: flow\nsteps:\n  a:\n    generate: {card: tiny-base, "
                        "prompts: [a bag], adapters: {alpha: 1.0}}\n")
    checked = CliRunner().invoke(app, ["workflow", "validate", str(workflow), "--json"],
                                 env={"CARDTOOL_PATH": str(examples)})
    [problem] = json.loads(checked.stdout)["error"]["problems"]
    assert problem["message"] == "card 'tiny-base' declares no LoRA 'alpha'", problem
    assert problem["fix"] == "cards made on it that declare 'alpha': tiny-a, tiny-a2, tiny-served (use one of those)"
    assert refusal("tiny-base", "omega").endswith("card 'tiny-base' declares no adapter 'omega'; its adapters: invert")
