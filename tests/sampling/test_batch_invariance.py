"""Batch invariance (the parity ladder's C2): a request's image does not depend on the requests sampled with it or on
what the text cache held — prompts are encoded alone, small products are padded to the rows a batched one has, the
patch embedding is a product, and the VAE decodes in groups of a fixed size. Where this CPU's products themselves
round alike at every batch size (probed), a tiny card promising C2 passes `parity --card` bit for bit."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import rows_are_independent
from typer.testing import CliRunner

from cardtool.backends.platform import Platform
from cardtool.backends.wan_dit import MIN_ROWS, Kernels, patchify, product
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling import denoise
from cardtool.core.sampling.denoise import SMALL_GROUP, VAE_GROUP, DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache, encode_prompts


@pytest.fixture(scope="module")
def loop():
    torch.set_num_threads(1)
    card = load_card("examples/cards/tiny-base")
    return DenoiseLoop(ModelInstance(card, Platform.detect("cpu")), cache=TextFeatureCache(disk=False))


def products_round_alike() -> bool:
    """Whether this CPU's float32 products give a row the same bits at every row count from MIN_ROWS up."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 96), torch.randn(200, 96)
    full = F.linear(x, weight)
    return all(torch.equal(F.linear(x[:rows], weight), full[:rows]) for rows in (MIN_ROWS, 17, 40, 100))


independent_rows = pytest.mark.skipif(not rows_are_independent(), reason="this CPU's fixed-shape products depend on "
                                      "the other rows: batch invariance cannot hold here")


def test_a_prompt_has_the_same_features_whatever_else_the_call_encodes(loop, monkeypatch):
    """Each prompt is encoded alone (an encoder batch rounds ~2e-6 differently for the built-in encoder)."""
    instance = loop.instance
    encoder, component, batches = instance.component("text_encoder"), instance.component, []

    def recording(prompts):
        batches.append(list(prompts))
        return encoder(prompts)

    monkeypatch.setattr(instance, "component", lambda name: recording if name == "text_encoder" else component(name))
    [alone] = encode_prompts(instance, ["a bag"], TextFeatureCache(disk=False))
    mixed = encode_prompts(instance, ["a coat", "a bag", ""], TextFeatureCache(disk=False))
    assert batches == [["a bag"], ["a coat"], ["a bag"], [""]]
    assert np.array_equal(alone[0], mixed[1][0]) and np.array_equal(alone[1], mixed[1][1])


@independent_rows
def test_a_small_product_takes_the_path_of_a_batched_one():
    """A few rows alone get the bits they get among MIN_ROWS rows (without padding BLAS takes its GEMV or small-M
    path for them: 1e-5 apart here)."""
    torch.manual_seed(1)
    ops = Kernels(Platform.detect("cpu"))
    weight, bias, x = torch.randn(128, 512), torch.randn(128), torch.randn(MIN_ROWS, 512)
    for rows in (1, 2, 5, 15):
        assert torch.equal(product(ops, x[:rows], weight, bias), product(ops, x, weight, bias)[:rows]), rows
    assert product(ops, x[:3].reshape(1, 3, 512), weight).shape == (1, 3, 128)


def test_the_patch_embedding_as_a_product_is_the_convolution():
    torch.manual_seed(2)
    conv = torch.nn.Conv3d(4, 32, kernel_size=(1, 2, 2), stride=(1, 2, 2))
    x = torch.randn(3, 4, 2, 8, 6)
    expected = conv(x).flatten(2).transpose(1, 2)
    with torch.no_grad():
        assert torch.allclose(patchify(Kernels(Platform.detect("cpu")), conv, x), expected, atol=1e-6, rtol=0)


def test_a_forward_holds_at_most_max_batch_rows_a_guided_request_two(loop, monkeypatch):
    """`max_batch` counts model rows: a request on a guided step is two (its conditional and unconditional rows)."""
    step, forwards = loop.step, []

    def recording(chunk):
        forwards.append([2 if state.guided else 1 for state in chunk])
        return step(chunk)

    monkeypatch.setattr(loop, "step", recording)
    guided = [Request("a bag", seed=s, steps=1, guidance=3.0) for s in range(3)]
    plain = [Request("a coat", seed=s, steps=1, guidance=1.0) for s in range(3)]
    sample(loop, guided + plain, max_batch=4)
    assert forwards == [[2, 2], [2, 1, 1], [1]]


def test_generation_runs_under_inference_mode_and_a_rollout_that_trains_does_not(loop):
    """Without `grad` nothing is recorded for autograd (inference mode); with it the latents can enter autograd.
    Nor is the trajectory kept unless asked for (`capture`)."""
    [plain] = sample(loop, [Request("a bag", steps=1, guidance=3.0)])
    assert torch.is_inference(plain.latents) and plain.capture is None
    with torch.enable_grad():
        [traced] = sample(loop, [Request("a bag", steps=1, guidance=3.0)], grad=True)
    assert not torch.is_inference(traced.latents)


@independent_rows
def test_an_image_decodes_to_the_same_pixels_alone_and_in_a_batch(loop, monkeypatch):
    """The VAE sees groups of one fixed size (the fashion VAE's convolutions round ~1.7e-6 differently at other batch
    sizes): SMALL_GROUP, or VAE_GROUP where a trial on the first images shows those give the same bits. So an image's
    pixels are the same alone and among others."""
    monkeypatch.setattr(denoise, "_groups_agree", weakref.WeakKeyDictionary())
    requests = [Request(p, seed=s, steps=2, guidance=3.0) for s, p in enumerate(["a bag", "a coat", "a dress"] * 12)]
    states = sample(loop, requests)
    vae = loop.instance.component(loop.vae)
    decode, sizes = vae.decode, []
    monkeypatch.setattr(vae, "decode", lambda latents: sizes.append(len(latents)) or decode(latents))
    together, _ = loop.decode(states)
    trial = [SMALL_GROUP] * 4 + [VAE_GROUP]  # the first 16 both ways
    agree = denoise._groups_agree[vae]["decode"]
    assert sizes == trial + ([VAE_GROUP, SMALL_GROUP] if agree else [SMALL_GROUP] * 5), agree
    sizes.clear()
    for k, state in enumerate(states):
        assert np.array_equal(loop.decode([state])[0][0], together[k]), k
    assert set(sizes) == {SMALL_GROUP}, "one image: one small group"
    sizes.clear()
    assert np.array_equal(loop.decode(states)[0], together)
    assert sizes == ([VAE_GROUP] * 2 + [SMALL_GROUP] if agree else [SMALL_GROUP] * 9), "tried once per VAE"


def test_large_groups_that_round_otherwise_are_never_used(loop, monkeypatch):
    monkeypatch.setattr(denoise, "_groups_agree", weakref.WeakKeyDictionary())
    states = sample(loop, [Request("a bag", seed=s, steps=1, guidance=3.0) for s in range(20)])
    vae = loop.instance.component(loop.vae)
    decode, sizes = vae.decode, []

    def rounding_otherwise(latents):  # a VAE whose groups of 16 give other bits
        sizes.append(len(latents))
        return decode(latents) + (1e-3 if len(latents) == VAE_GROUP else 0)

    monkeypatch.setattr(vae, "decode", rounding_otherwise)
    pixels, _ = loop.decode(states)
    assert sizes == [SMALL_GROUP] * 4 + [VAE_GROUP] + [SMALL_GROUP] * 1 and not denoise._groups_agree[vae]["decode"]
    sizes.clear()
    again, _ = loop.decode(states)
    assert sizes == [SMALL_GROUP] * 5 and np.array_equal(again, pixels), "the verdict kept: groups of four"


@independent_rows
def test_a_card_promising_c2_keeps_it_where_the_products_round_alike(examples):
    if not products_round_alike():
        pytest.skip("this CPU's products round differently at different row counts: no card can promise C2 here")
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("consistency: C1", "consistency: C2"))
    result = CliRunner().invoke(app, ["parity", "--card", str(examples / "tiny-base"), "--op", "cfg_combine",
                                      "--json"])
    contract = [row for row in json.loads(result.stdout)["rows"] if row["cell"].startswith("contract:")]
    assert [(row["against"], row["max_abs_err"], row["passed"]) for row in contract] == [
        ("a 2nd load", 0, True), ("alone", 0, True)]
    assert result.exit_code == 0, result.output
