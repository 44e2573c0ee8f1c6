"""`cardtool cards import`: a diffusers WanTransformer3DModel folder (one file or shards) becomes a card on another
card's text encoder and VAE, and gives diffusers' velocity; what cannot be the same model is refused (exit 2)."""

from __future__ import annotations

import inspect
import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import from_diffusers
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.errors import BadInput

diffusers = pytest.importorskip("diffusers")

TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 4,
        "out_channels": 4, "text_dim": 384, "freq_dim": 64, "ffn_dim": 64, "num_layers": 2}


def peer(**changes):
    torch.manual_seed(0)
    return diffusers.WanTransformer3DModel(**{**TINY, **changes}).eval()


def run_import(source, base, out, *extra):
    return CliRunner().invoke(app, ["cards", "import", str(source), "--base", str(base), "--id", "imported",
                                    "--out", str(out), "--json", *extra])


def velocity_gap(card_folder, model) -> tuple[float, float]:
    loop = DenoiseLoop(ModelInstance(load_card(card_folder), Platform("cpu", "generic"), "float32"),
                       cache=TextFeatureCache(disk=False))
    states = loop.init([Request(p, seed=i, guidance=1.0) for i, p in enumerate(["an ankle boot", "a bag"])])
    x = torch.cat([s.latents for s in states])
    t = torch.tensor([700.0, 250.0])
    text, mask = torch.cat([s.cond[0] for s in states]), torch.cat([s.cond[1] for s in states])
    with torch.no_grad():
        ours = loop.instance.component("transformer")(x, t, text, mask)
        theirs = model(x, t, text, return_dict=False)[0]
    return float(ours.abs().max()), float((ours - theirs).abs().max())


@pytest.mark.parametrize("shards", [None, "40KB"])
def test_a_diffusers_transformer_imports_as_a_card_with_diffusers_velocity(examples, tmp_path, shards):
    model = peer()
    model.save_pretrained(tmp_path / "dm", **({"max_shard_size": shards} if shards else {}))
    if shards:
        assert len(list((tmp_path / "dm").glob("*.safetensors"))) > 1
    result = run_import(tmp_path / "dm", examples / "tiny-base", tmp_path / "card")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["transformer"]["dim"] == 32
    card = load_card(tmp_path / "card", checksums=True)
    m = card.manifest
    assert m.recipe.method == "import" and m.recipe.parents == ["tiny-base"]
    assert m.components["transformer"].config["text_mask"] is False, "diffusers' semantics: no text mask"
    assert not m.adapters, "tiny-base's LoRA was made for tiny-base's transformer"
    assert m.recipe.command == f"cardtool cards import {tmp_path / 'dm'} --base {examples / 'tiny-base'} --id imported"
    size, gap = velocity_gap(tmp_path / "card", model)
    assert size > 0.1 and gap <= 1e-5


def test_an_id_that_is_no_card_id_is_refused_before_reading_the_source(examples, tmp_path):
    result = CliRunner().invoke(app, ["cards", "import", str(tmp_path / "missing"), "--base",
                                      str(examples / "tiny-base"), "--id", "../x", "--json"])
    assert result.exit_code == 2, result.output
    assert "--id '../x': a card id starts with a letter or digit" in json.loads(result.stdout)["error"]["message"]


def test_without_out_the_card_goes_to_cards_id_beside_other_cards_readable_by_all(examples, tmp_path, monkeypatch):
    """./cards is on the card search path: a new id is written there beside the cards it holds, and --overwrite
    replaces the card that holds the id (a second card with it would make the id ambiguous)."""
    import os

    peer().save_pretrained(tmp_path / "dm")
    shutil.copytree(examples / "tiny-base", tmp_path / "work" / "cards" / "tiny-base")
    monkeypatch.chdir(tmp_path / "work")
    for extra in ([], ["--overwrite"]):
        result = CliRunner().invoke(app, ["cards", "import", str(tmp_path / "dm"), "--base", "tiny-base", "--id",
                                          "imported", "--json", *extra])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["path"] == "cards/imported"
    card = load_card("imported")
    assert card.folder == tmp_path / "work" / "cards" / "imported" and card.manifest.extends == "tiny-base"
    from cardtool.core.cards.diffusers_import import import_diffusers

    with pytest.raises(BadInput, match="cards/imported already exists; choose another --out, or pass --overwrite"):
        import_diffusers(tmp_path / "dm", "tiny-base", "imported")  # from Python too, nothing is replaced unasked
    weights = card.folder / "transformer.safetensors"
    assert os.stat(weights).st_mode & 0o777 == 0o644, "a card on a shared disk is readable by the team"


def test_an_export_imports_back_as_the_same_transformer(examples, tmp_path):
    exported = CliRunner().invoke(app, ["cards", "export", str(examples / "tiny-rl"), "--out", str(tmp_path / "hf")])
    assert exported.exit_code == 0, exported.output
    assert run_import(tmp_path / "hf", examples / "tiny-base", tmp_path / "back").exit_code == 0
    model = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "hf" / "transformer").eval()
    assert velocity_gap(tmp_path / "back", model)[1] <= 1e-5


def test_a_bf16_checkpoint_with_float32_norms_and_a_variant_import_losslessly(examples, tmp_path):
    """diffusers keeps a bf16 model's norms and modulation in float32: the card stores the widest precision."""
    peer().save_pretrained(tmp_path / "f32")
    mixed = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "f32", torch_dtype=torch.bfloat16)
    mixed.save_pretrained(tmp_path / "mixed", variant="bf16")
    result = run_import(tmp_path / "mixed", examples / "tiny-base", tmp_path / "card")
    assert result.exit_code == 2 and "holds the variant(s) bf16: pass --variant" in json.loads(result.stdout)[
        "error"]["message"]
    for variant in ("../mixed/diffusion_pytorch_model.bf16", "bf16 "):  # a variant names a file, not a path
        result = run_import(tmp_path / "mixed", examples / "tiny-base", tmp_path / "card", "--variant", variant)
        assert result.exit_code == 2 and json.loads(result.stdout)["error"]["message"] == (
            f"--variant {variant!r}: a variant is a short name such as fp16")
    assert run_import(tmp_path / "mixed", examples / "tiny-base", tmp_path / "card", "--variant", "bf16").exit_code == 0
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "card" / "transformer.safetensors"))
    original = {k: v.float() for k, v in mixed.state_dict().items()}
    assert {v.dtype for v in stored.values()} == {torch.float32}
    assert all(torch.equal(stored[k], original[k]) for k in original), "bf16 values kept exactly"
    upcast = diffusers.WanTransformer3DModel.from_pretrained(tmp_path / "mixed", variant="bf16",
                                                             torch_dtype=torch.float32).eval()
    assert velocity_gap(tmp_path / "card", upcast)[1] <= 1e-5


def test_a_half_precision_checkpoint_is_stored_at_its_own_precision(examples, tmp_path):
    model = peer().half()
    model.save_pretrained(tmp_path / "fp16")
    assert run_import(tmp_path / "fp16", examples / "tiny-base", tmp_path / "card").exit_code == 0
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "card" / "transformer.safetensors"))
    assert {v.dtype for v in stored.values()} == {torch.float16}
    assert all(torch.equal(stored[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("case", "message"), [
    ("image_to_video", "image_dim: image-to-video conditioning"),
    ("unknown_key", "sets future_option, which a wan-dit does not know"),
    ("wrong_shapes", "the weights do not fit config.json: blocks.0.ffn.net.0.proj.weight is (64, 32), not (96, 32) "
                     "(6 tensors differ)"),
    ("list_config", "config.json is not a JSON object"),
    ("one_wrong_shape", "config.json: blocks.0.attn1.to_q.weight is (32, 16), not (32, 32)"),
    ("unexpected_tensor", "the weights do not fit config.json: unexpected extra.weight"),
    ("pickle", "pickle checkpoints are never loaded"),
    ("not_json", "is not JSON"),
    ("not_utf8", "cannot read the transformer's config: "),
    ("huge_config", "cannot read the transformer's config: "),
    ("escaping_shard", "which is not a file in"),
    ("nul_in_shard", "'a\\x00b', which is not a file in"),  # not "an argument holds a NUL byte"
    ("another_class", "holds a UNet2DModel"),
    ("empty", "is not a diffusers transformer folder"),
    ("judge_as_base", "has no denoise loop over a `transformer` DiT"),
    ("dit_named_otherwise", "has no denoise loop over a `transformer` DiT"),
    ("nan_weights", "holds NaN or inf in blocks.0.attn1.to_q.weight"),  # said of the source, not of the card
])
def test_what_cannot_be_the_same_model_is_refused(examples, tmp_path, case, message):
    source = tmp_path / "dm"
    model = peer(image_dim=32) if case == "image_to_video" else peer()
    if case == "nan_weights":
        with torch.no_grad():
            model.blocks[0].attn1.to_q.weight[0, 0] = float("nan")
    model.save_pretrained(source, safe_serialization=case != "pickle",
                          **({"max_shard_size": "40KB"} if case in ("escaping_shard", "nul_in_shard") else {}))
    config_file = source / "config.json"
    config = json.loads(config_file.read_text())
    if case == "unknown_key":
        config["future_option"] = 1
    elif case == "wrong_shapes":
        config["ffn_dim"] = 96
    elif case == "another_class":
        config["_class_name"] = "UNet2DModel"
    config_file.write_text(json.dumps([config] if case == "list_config" else config))
    if case == "not_json":
        config_file.write_text("{not json")
    elif case == "not_utf8":
        config_file.write_bytes(b'{"_class_name": "\xff"}')
    elif case == "huge_config":  # read whole, a config is small: a file this size is no config.json
        config_file.write_text(json.dumps({**config, "padding": " " * (1 << 20)}))
    elif case in ("escaping_shard", "nul_in_shard"):
        index = source / "diffusion_pytorch_model.safetensors.index.json"
        data = json.loads(index.read_text())
        first = next(iter(data["weight_map"]))
        if case == "escaping_shard":  # a real safetensors file, but outside the model's folder
            shutil.copyfile(source / data["weight_map"][first], tmp_path / "elsewhere.safetensors")
        data["weight_map"][first] = "../elsewhere.safetensors" if case == "escaping_shard" else "a\x00b"
        index.write_text(json.dumps(data))
    elif case in ("one_wrong_shape", "unexpected_tensor"):
        from safetensors.torch import load_file, save_file

        state = load_file(str(source / "diffusion_pytorch_model.safetensors"))
        if case == "one_wrong_shape":
            state["blocks.0.attn1.to_q.weight"] = torch.zeros(32, 16)
        else:
            state["extra.weight"] = torch.zeros(3)
        save_file(state, str(source / "diffusion_pytorch_model.safetensors"))
    elif case == "empty":
        source = tmp_path / "nothing"
        source.mkdir()
    base = examples / ("tiny-judge" if case == "judge_as_base" else "tiny-base")
    if case == "dit_named_otherwise":  # a denoise loop, over a DiT the import would not replace
        base = tmp_path / "renamed"
        shutil.copytree(examples / "tiny-base", base)
        text = (base / "card.yaml").read_text()
        (base / "card.yaml").write_text(text.replace("  transformer:\n", "  dit:\n").replace(
            "vae, transformer]", "vae, dit]").replace("target: transformer", "target: dit"))
        assert load_card(base).manifest.components["dit"].kind == "dit"
    result = run_import(source, base, tmp_path / "card")
    assert result.exit_code == 2, result.output
    assert message in json.loads(result.stdout)["error"]["message"] and "Traceback" not in result.output
    assert not (tmp_path / "card").exists()


def test_a_hub_id_given_as_a_folder_or_card_says_that_nothing_is_downloaded(examples, tmp_path, monkeypatch):
    """`cards import Wan-AI/Wan2.1-T2V-1.3B` said the (missing) folder "is not a diffusers transformer folder"."""
    monkeypatch.chdir(tmp_path)
    repo = "Wan-AI/Wan2.1-T2V-1.3B"
    hub = f"huggingface-cli download {repo} --local-dir DIR"
    message = json.loads(run_import(repo, examples / "tiny-base", "card").stdout)["error"]["message"]
    assert message.startswith(f"{repo}: no such folder;") and f"never downloads: {hub} first" in message
    generate = CliRunner().invoke(app, ["generate", repo, "-p", "a bag", "--json"])
    message = json.loads(generate.stdout)["error"]["message"]
    assert generate.exit_code == 2 and "never downloads" in message and hub in message and "cards import DIR" in message
    (tmp_path / "weights").write_text("")
    for source, kind in (("nowhere", "no such folder"), ("weights", "not a folder")):
        message = json.loads(run_import(source, examples / "tiny-base", "card").stdout)["error"]["message"]
        assert message.startswith(f"{source}: {kind};") and "download" not in message, message
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").write_text("")  # there: a path, not a Hub id
    message = json.loads(run_import("owner/name", examples / "tiny-base", "card").stdout)["error"]["message"]
    assert "not a folder" in message and "download" not in message
    for typo in (["cards", "import", "owner/nmae", "--base", str(examples / "tiny-base"), "--id", "x", "--json"],
                 ["generate", "owner/nmae", "-p", "a bag", "--json"]):  # a local folder's path mistyped
        message = json.loads(CliRunner().invoke(app, typo).stdout)["error"]["message"]
        assert "owner/nmae" in message and "download" not in message, message
    assert not (tmp_path / "card").exists()


def test_keys_a_config_json_leaves_out_take_diffusers_defaults():
    """A config.json saved by an older diffusers (or written by hand) may omit a key; diffusers builds its own default
    for it, so the imported card must too."""
    defaults = {name: p.default for name, p in inspect.signature(diffusers.WanTransformer3DModel).parameters.items()}
    assert from_diffusers({}) == from_diffusers(defaults)
    assert from_diffusers({}).to_diffusers() == {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()
                                                 if k not in ("image_dim", "added_kv_proj_dim", "rope_max_seq_len",
                                                              "pos_embed_seq_len")}


@pytest.mark.parametrize(("config", "message"), [
    ({"qk_norm": "rms_norm"}, "qk_norm is 'rms_norm'; a wan-dit normalises q and k with rms_norm_across_heads"),
    ({"num_attention_heads": 2.0}, "num_attention_heads and attention_head_dim must be whole numbers, got 2.0, 128"),
    ({"attention_head_dim": True}, "must be whole numbers, got 40, True"),
    ({"num_layers": 0}, r"wan-dit \(from config.json\) config: depth: "),
])
def test_a_config_json_a_wan_dit_cannot_be_is_refused_by_its_key(config, message):
    with pytest.raises(BadInput, match=message):
        from_diffusers(config)
