"""The adapter plane: LoRA stacks and ControlNets per request, mixed-adapter batches equal to running alone,
fuse/unfuse, hot-swap with versions in metadata and cache keys, and clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import EXAMPLE_CARDS, rows_are_independent
from typer.testing import CliRunner

from cardtool.backends.controlnet import WanControlNet
from cardtool.backends.lora import LoraPlan, fused, linear_names, write_lora
from cardtool.backends.platform import Platform
from cardtool.backends.torch_ops import lora_bgmv
from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.weight_files import sha256_file
from cardtool.core.sampling.control import ControlImage, edges, silhouette
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.images import png_bytes, read_png_metadata, save_png
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.errors import BadInput

CPU = Platform("cpu", "generic")
MANIFEST = """\
schema: cardtool/v1
id: tiny-adapters
extends: {base}
adapters:
  a: {{kind: lora, target: transformer, weights: adapters/a.safetensors, rank: 2, alpha: 4}}
  b: {{kind: lora, target: transformer, weights: adapters/b.safetensors, rank: 3, alpha: 3,
      targets: ["blocks.*.attn1.*"]}}
  ctl: {{kind: controlnet, target: transformer, weights: adapters/ctl.safetensors, control: silhouette,
        config: {{blocks: 1}}}}
recipe: {{method: lora, parents: [tiny-base]}}
"""


def lora_tensors(model, names, rank, seed):
    generator = torch.Generator().manual_seed(seed)
    layers = linear_names(model)
    a = {n: torch.randn(rank, layers[n].in_features, generator=generator) / 4 for n in names}
    b = {n: torch.randn(layers[n].out_features, rank, generator=generator) / 4 for n in names}
    return a, b


def write_lora_b(folder, model, seed):
    names = [n for n in linear_names(model) if ".attn1." in n]
    write_lora(folder / "adapters" / "b.safetensors", *lora_tensors(model, names, 3, seed), rank=3, alpha=3)


@pytest.fixture
def card(tmp_path):
    base = load_card(EXAMPLE_CARDS / "tiny-base")
    model = ModelInstance(base, CPU).component("transformer")
    folder = tmp_path / "tiny-adapters"
    folder.mkdir()
    names = [n for n in linear_names(model) if n.startswith("blocks.") and (".attn" in n or ".ffn." in n)]
    write_lora(folder / "adapters" / "a.safetensors", *lora_tensors(model, names, 2, 1), rank=2, alpha=4)
    write_lora_b(folder, model, 2)
    torch.manual_seed(3)
    net = WanControlNet(model.config, 1, CPU)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(folder / "adapters" / "ctl.safetensors"))
    (folder / "card.yaml").write_text(MANIFEST.format(base=os.path.relpath(EXAMPLE_CARDS / "tiny-base", folder)))
    return load_card(folder)


@pytest.fixture
def loop(card):
    return DenoiseLoop(ModelInstance(card, CPU), cache=TextFeatureCache(disk=False))


# a mixed batch gives each request the bits it gets alone wherever this CPU's products are row-independent (probed):
# stacks are runs of rows, each run's LoRA product and the base product blind to the other rows
MIXED_TOLERANCE = 0.0 if rows_are_independent() else 1e-5


def control(seed, preprocessor="silhouette"):
    rng = np.random.default_rng(seed)
    image = np.zeros((28, 28), np.uint8)
    top, left = rng.integers(2, 10, size=2)
    image[top:top + 14, left:left + 12] = 200
    return ControlImage.make(image, preprocessor)


def run(loop, requests):
    return [s.latents for s in sample(loop, requests)]


def test_a_mixed_batch_equals_each_request_alone(loop):
    requests = [Request("a bag", seed=1, steps=3),
                Request("a bag", seed=1, steps=3, adapters=(("a", 1.0),)),
                Request("a coat", seed=2, steps=2, guidance=1.0, adapters=(("a", 0.5),)),
                Request("a bag", seed=1, steps=3, adapters=(("a", 1.0), ("b", 0.7))),
                Request("a bag", seed=1, steps=3, adapters=(("b", -1.0),)),
                Request("a shirt", seed=3, steps=3, adapters=(("ctl", 1.0),), control=control(0)),
                Request("a shirt", seed=3, steps=3, adapters=(("ctl", 0.5), ("a", 1.0)), control=control(1)),
                Request("a dress", seed=4, steps=4, guidance=2.0, adapters=(("ctl", 2.0),), control=control(2))]
    together = run(loop, requests)
    for request, mixed in zip(requests, together, strict=True):
        [alone] = run(loop, [request])
        assert (mixed - alone).abs().max() <= MIXED_TOLERANCE, request
    plain = together[0]
    assert all((t - plain).abs().max() > 1e-3 for t in together[1:2] + together[3:5]), "each stack changes the image"
    assert (together[3] - together[1]).abs().max() > 1e-3, "composing b onto a changes the image"


def test_a_text_is_projected_once_for_each_lora_stack_that_reads_it(loop, monkeypatch):
    dit = loop.instance.component("transformer")
    rows, project = [], dit.text_context
    monkeypatch.setattr(dit, "text_context", lambda text, lora=None: rows.append(len(text)) or project(text, lora))
    requests = [Request("a bag", seed=1, steps=2, guidance=1.0, adapters=(("a", 1.0),)),
                Request("a bag", seed=2, steps=2, guidance=1.0, adapters=(("a", 1.0),)),
                Request("a bag", seed=1, steps=2, guidance=1.0),
                Request("a coat", seed=1, steps=2, guidance=1.0, adapters=(("a", 1.0),))]
    together = run(loop, requests)
    assert rows == [3], "'a bag' with LoRA a and without it, 'a coat' with it: three texts for four rows"
    for request, mixed in zip(requests, together, strict=True):
        [alone] = run(loop, [request])
        assert (mixed - alone).abs().max() <= MIXED_TOLERANCE, request
    assert (together[0] - together[2]).abs().max() > 1e-3, "the LoRA's text rows are not the base's"


@pytest.mark.parametrize("typed, parsed", [("a", ("a", 1.0)), ("a=0.5", ("a", 0.5)), ("a=-2", ("a", -2.0)),
                                           ("=0.5", "expected NAME or NAME=SCALE"),
                                           ("a=half", "the scale 'half' is not a number"),
                                           ("a=inf", "the scale must be a finite number"),
                                           ("a=nan", "the scale must be a finite number")])
def test_an_adapter_as_typed_is_a_name_and_a_finite_scale(typed, parsed):
    from cardtool.core.sampling.adapters import parse_adapter

    if isinstance(parsed, tuple):
        assert parse_adapter(typed) == parsed
    else:
        with pytest.raises(BadInput, match=f"^--adapter '{typed}': {parsed}$"):
            parse_adapter(typed)


@pytest.mark.parametrize("scale", [0.0, 1.0])
def test_a_name_the_card_does_not_declare_is_refused_by_the_loop_at_any_scale(loop, scale):
    """Off at scale 0 is for a declared adapter: an unknown name is a typo, said before any work, never a KeyError."""
    with pytest.raises(BadInput, match="declares no adapter 'zz'; its adapters: invert, a, b, ctl"):
        loop.init([Request("a bag", steps=2, adapters=(("a", 1.0), ("zz", scale)))])


def test_the_loop_refuses_what_planning_or_validation_would(card, loop):
    """What planning refuses for the CLI, and `cards validate` of an adapter, the loop refuses for a Request made in
    Python and for an adapter first checked when a request uses it: two ControlNets, a ControlNet config key nothing
    reads, a file gone, a DiT (a plugin's) whose forward takes no adapters."""
    with pytest.raises(BadInput, match="^a request takes at most one ControlNet"):
        loop.init([Request("a bag", adapters=(("ctl", 1.0), ("ctl", 0.5)), control=control(0))])
    plugin = DenoiseLoop(ModelInstance(card, CPU), cache=TextFeatureCache(disk=False))
    plugin.instance.component("transformer").forward = lambda x, t, text, text_mask=None, text_context=None: x
    with pytest.raises(BadInput, match="^adapter 'a': the 'wan-dit' DiT on cpu takes no adapters \\(its forward has "
                                       "no lora and control arguments\\)$"):
        plugin.init([Request("a bag", adapters=(("a", 1.0),))])
    manifest = card.folder / "card.yaml"  # served, a card's adapters are checked when a request uses them
    manifest.write_text(manifest.read_text().replace("config: {blocks: 1}", "config: {blocks: 1, depth: 2}"))
    served = DenoiseLoop(ModelInstance(load_card(card.folder, adapters=False), CPU), cache=TextFeatureCache(disk=False))
    with pytest.raises(BadInput, match="^a ControlNet's config takes only blocks, not depth$"):
        served.init([Request("a bag", adapters=(("ctl", 1.0),), control=control(0))])
    (card.folder / "adapters" / "a.safetensors").unlink()  # gone since the card was loaded
    with pytest.raises(BadInput, match=r"^adapter 'a' of card 'tiny-adapters': cannot read .*a.safetensors: No such"):
        loop.init([Request("a bag", adapters=(("a", 1.0),))])


def test_a_controlnet_copies_its_base_s_first_blocks_and_no_more_than_it_has(loop):
    dit = loop.instance.component("transformer")
    net = WanControlNet.from_base(dit, 1, CPU)
    assert torch.equal(net.blocks[0].attn1.to_q.weight, dit.blocks[0].attn1.to_q.weight)
    assert not net.controlnet_blocks[0].weight.any(), "zero-initialised: at init the branch changes nothing"
    for depth in (0, len(dit.blocks) + 1):
        with pytest.raises(ValueError, match=f"a ControlNet copies 1…{len(dit.blocks)} blocks, not {depth}"):
            WanControlNet.from_base(dit, depth, CPU)


def test_scale_zero_is_no_adapter_exactly(loop):
    plain, zero, zeros = run(loop, [Request("a bag", seed=5, steps=3),
                                    Request("a bag", seed=5, steps=3, adapters=(("a", 0.0),)),
                                    Request("a bag", seed=5, steps=3, adapters=(("a", 0.0), ("b", 0.0)))])
    assert torch.equal(plain, zero) and torch.equal(plain, zeros)


def test_composed_loras_sum_their_scaled_deltas():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 6), torch.randn(4, 6)
    from cardtool.backends.lora import LoraWeights

    one = LoraWeights("v1", 2, 4.0, {"m": torch.randn(2, 6)}, {"m": torch.randn(4, 2)})
    two = LoraWeights("v2", 3, 1.5, {"m": torch.randn(3, 6)}, {"m": torch.randn(4, 3)})
    plan = LoraPlan([((one, 0.5), (two, -2.0)), ((two, 1.0),)], [0, -1, 1], lora_bgmv, "cpu")
    y = x @ w.T
    out = plan("m", x, y)
    expected0 = x[0] @ (w + 0.5 * 2.0 * one.b["m"] @ one.a["m"] - 2.0 * 0.5 * two.b["m"] @ two.a["m"]).T
    assert torch.allclose(out[0], expected0, atol=1e-5)
    assert torch.equal(out[1], y[1]), "a row without a stack is the base output exactly"
    assert torch.allclose(out[2], x[2] @ (w + 0.5 * two.b["m"] @ two.a["m"]).T, atol=1e-5)
    assert torch.equal(plan("other", x, y), y)
    # a LoRA whose rank is already a whole slot (8) is scaled after the stacking: the same delta
    eight = LoraWeights("v3", 8, 4.0, {"m": torch.randn(8, 6)}, {"m": torch.randn(4, 8)})
    out = LoraPlan([((eight, 3.0),), ((one, 1.0),)], [1, 0, -1], lora_bgmv, "cpu")("m", x, y)
    assert torch.allclose(out[1], x[1] @ (w + 3.0 * 0.5 * eight.b["m"] @ eight.a["m"]).T, atol=1e-5)
    assert torch.allclose(out[0], x[0] @ (w + 2.0 * one.b["m"] @ one.a["m"]).T, atol=1e-5)


def test_plans_share_their_stacks_slot_weights_and_a_new_version_gets_its_own():
    """Two plans over the same stacks (a guided run's guided and unguided rows) build the slot weights once;
    built under inference mode, they still serve a forward that takes a gradient; a new LoraWeights object (a
    hot-swapped file) is a new entry even with the same version string."""
    from cardtool.backends.lora import LoraWeights, slot_weights

    torch.manual_seed(0)
    one = LoraWeights("v", 2, 2.0, {"m": torch.randn(2, 6)}, {"m": torch.randn(4, 2)})
    with torch.inference_mode():
        first = slot_weights([((one, 1.0),)], "cpu", torch.float32)
    assert slot_weights([((one, 1.0),)], "cpu", torch.float32) is first
    assert slot_weights([((one, 0.5),)], "cpu", torch.float32) is not first
    x = torch.randn(2, 5, 6, requires_grad=True)
    out = LoraPlan([((one, 1.0),)], [0, -1], lora_bgmv, "cpu")("m", x, torch.zeros(2, 5, 4))
    out.sum().backward()
    torch.testing.assert_close(out[0], x[0].detach() @ (one.b["m"] @ one.a["m"]).T)
    assert torch.equal(out[1], torch.zeros(5, 4)) and x.grad[1].abs().max() == 0
    swapped = LoraWeights("v", 2, 2.0, {"m": torch.randn(2, 6)}, {"m": torch.randn(4, 2)})
    again = LoraPlan([((swapped, 1.0),)], [0], lora_bgmv, "cpu")("m", x[:1].detach(), torch.zeros(1, 5, 4))
    torch.testing.assert_close(again[0], x[0].detach() @ (swapped.b["m"] @ swapped.a["m"]).T)


def test_an_activated_layer_gives_a_row_without_a_lora_there_the_product_it_gets_with_none():
    """gelu(W0·x + b + Δ_row·x) for each row with a LoRA on the layer; a row whose stack has none there — no stack,
    or one that skips the layer — takes the table's own product with its GELU, whose bits may differ (oneDNN fuses
    the GELU into the product on a float32 CPU), as it does in a batch with no LoRA at all."""
    from cardtool.backends.lora import LoraWeights
    from cardtool.backends.torch_ops import gelu_tanh
    from cardtool.backends.wan_dit import Kernels, _linear, name_linears, product

    torch.manual_seed(0)
    ops, model = Kernels(CPU), torch.nn.Module()
    model.up = torch.nn.Linear(32, 64)
    name_linears(model)
    x = torch.randn(4, 16, 32)
    one = LoraWeights("v1", 2, 4.0, {"up": torch.randn(2, 32)}, {"up": torch.randn(64, 2)})
    elsewhere = LoraWeights("v2", 3, 3.0, {"down": torch.randn(3, 64)}, {"down": torch.randn(32, 3)})
    plan = LoraPlan([((one, 0.5),), ((elsewhere, 1.0),)], [0, -1, 1, 0], lora_bgmv, "cpu")
    with torch.inference_mode():
        out = _linear(ops, model.up, x, plan, "gelu_tanh")
        alone = product(ops, x[[1, 2]], model.up.weight, model.up.bias, "gelu_tanh")
        adapted = gelu_tanh(model.up(x[[0, 3]]) + x[[0, 3]] @ one.delta("up", 0.5).T)
    assert torch.equal(out[[1, 2]], alone), "no LoRA on this layer: the bits of a batch with none"
    torch.testing.assert_close(out[[0, 3]], adapted, atol=1e-5, rtol=1e-5)
    assert plan.plain_rows("up").tolist() == [1, 2] and plan.plain_rows("down").tolist() == [0, 1, 3]


@pytest.mark.parametrize("tier", ["generic", "avx2"])
def test_a_row_gets_the_bits_it_gets_alone_whatever_the_ranks_batched_with_it(tier):
    """A slot's rank is padded to a multiple of RANK_STEP, never to a batch-mate's (zero-padding a sum changes how
    BLAS blocks it, and so its rounding); slots padded to different ranks take one kernel call each. The avx2
    tier's kernel, which a plan hands A by rows, gives the same deltas (pure torch: it runs on any CPU)."""
    from cardtool.backends import cpu_avx2
    from cardtool.backends.lora import LoraWeights

    bgmv, calls = cpu_avx2.lora_bgmv if tier == "avx2" else lora_bgmv, []

    def kernel(x, *a):
        calls.append(x.shape[0])
        return bgmv(x, *a)

    kernel.a_by_rows = getattr(bgmv, "a_by_rows", False)
    torch.manual_seed(0)
    loras = [LoraWeights(f"v{r}", r, float(r), {"m": torch.randn(r, 32)}, {"m": torch.randn(32, r)})
             for r in (2, 5, 12)]
    x, w = torch.randn(6, 16, 32), torch.randn(32, 32)
    with torch.inference_mode():
        mixed = LoraPlan([((lora, 1.0),) for lora in loras], [0, 0, 1, 1, 2, 2], kernel, "cpu")("m", x, x @ w.T)
        assert calls == [2, 1], "ranks 2 and 5 padded to 8 in one call, 12 to 16 in another"
        for slot, lora in enumerate(loras):
            rows = slice(2 * slot, 2 * slot + 2)
            alone = LoraPlan([((lora, 1.0),)], [0, 0], bgmv, "cpu")("m", x[rows], x[rows] @ w.T)
            assert (mixed[rows] - alone).abs().max() <= MIXED_TOLERANCE, lora.rank
            torch.testing.assert_close(alone, x[rows] @ (w + lora.delta("m", 1.0)).T, atol=1e-4, rtol=1e-5)


def test_one_forward_and_one_gathered_lora_call_per_layer_for_a_mixed_batch(loop, monkeypatch):
    dit = loop.instance.component("transformer")
    forwards, calls = [], []
    original = type(dit).forward
    monkeypatch.setattr(type(dit), "forward",
                        lambda self, x, *a, **k: forwards.append(len(x)) or original(self, x, *a, **k))
    kernel = dit.ops.lora_bgmv
    monkeypatch.setattr(dit.ops, "lora_bgmv", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    requests = [Request("a bag", seed=i, steps=2, guidance=1.0, adapters=stack)
                for i, stack in enumerate([(), (("a", 1.0),), (("a", 0.3),), (("b", 1.0),), (("a", 1.0), ("b", 1.0))])]
    sample(loop, requests)
    assert forwards == [5, 5], "one forward per step for all stacks"
    layers = len([n for n in linear_names(dit) if n.startswith("blocks.") and (".attn" in n or ".ffn." in n)])
    text = len([n for n in linear_names(dit) if ".attn2.to_k" in n or ".attn2.to_v" in n])
    # the text's cross-attention keys and values are computed once per batch, not every step; ranks 2, 3 and 5
    # all pad to 8, one call
    assert len(calls) == 2 * layers - text and set(calls) == {5}, "one gathered call per adapted layer"


def test_equal_runs_finds_a_batch_sorted_by_stack():
    from cardtool.backends.lora import equal_runs

    assert equal_runs([0, 0, 1, 1, 2, 2]) == (0, 6, [0, 1, 2])
    assert equal_runs([-1, 0, 0, -1, -1, 1, 1, -1]) == (1, 7, [0, -1, 1]), "none inside: a run of the zero slot"
    assert equal_runs([0, 0, 0, 0]) == (0, 4, [0])
    assert equal_runs([0, 0, 1, 1, 0, 0]) == (0, 6, [0, 1, 0])
    assert equal_runs([0, 0, 0, 0, 1, 1, -1, -1, 2, 2, 2, 2]) == (0, 12, [0, 0, 1, -1, 2, 2]), "split by the gcd"
    for uneven in ([0, 0, 0, 1], [0, 1, 0, 1], [0, 0, 1, 1, 1], [0, 1], [-1, -1], []):
        assert equal_runs(uneven) is None, uneven


def test_rows_in_equal_runs_take_one_product_per_run_with_each_rows_own_delta():
    """A plan over rows sorted by stack hands the kernel one block per run; every row still gets exactly its own
    stack's delta (none outside the runs), with and without autograd."""
    from cardtool.backends.lora import LoraWeights

    torch.manual_seed(0)
    one = LoraWeights("v1", 2, 4.0, {"m": torch.randn(2, 6)}, {"m": torch.randn(4, 2)})
    two = LoraWeights("v2", 3, 1.5, {"m": torch.randn(3, 6)}, {"m": torch.randn(4, 3)})
    stacks, rows = [((one, 0.5), (two, -2.0)), ((two, 1.0),)], [-1, 0, 0, 1, 1, -1]
    deltas = {-1: torch.zeros(4, 6), 0: 0.5 * 2.0 * one.b["m"] @ one.a["m"] - 2.0 * 0.5 * two.b["m"] @ two.a["m"],
              1: 0.5 * two.b["m"] @ two.a["m"]}
    x, w = torch.randn(6, 5, 6), torch.randn(4, 6)
    blocks = []
    plan = LoraPlan(stacks, rows, lambda x, *a: blocks.append(x.shape) or lora_bgmv(x, *a), "cpu")
    assert plan.runs == (1, 5, [0, 1])
    out = plan("m", x, x @ w.T)
    with torch.inference_mode():
        in_place = plan("m", x, x @ w.T)
    assert blocks == [(2, 10, 6)] * 2, "two runs of two rows × five tokens"
    for i, slot in enumerate(rows):
        expected = x[i] @ (w + deltas[slot]).T
        torch.testing.assert_close(out[i], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(in_place[i], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0], x[0] @ w.T) and torch.equal(out[5], x[5] @ w.T)


def test_sample_orders_a_batch_by_stack_and_returns_each_request_its_own_image(loop, monkeypatch):
    dit = loop.instance.component("transformer")
    kernel, calls = dit.ops.lora_bgmv, []
    monkeypatch.setattr(dit.ops, "lora_bgmv", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    requests = [Request("a bag", seed=i, steps=2, guidance=1.0, adapters=(("ab"[i % 2], 1.0),)) for i in range(6)]
    together = run(loop, requests)
    assert set(calls) == {2}, "interleaved a, b, a, b, …: two runs of three"
    for request, mixed in zip(requests, together, strict=True):
        [alone] = run(loop, [request])
        assert (mixed - alone).abs().max() <= MIXED_TOLERANCE, request
    assert (together[0] - together[1]).abs().max() > 1e-3


def test_fuse_matches_unfused_and_unfusing_restores_the_base_bit_for_bit(loop):
    dit = loop.instance.component("transformer")
    before = {k: (v, v.clone()) for k, v in dit.state_dict(keep_vars=True).items()}
    stack = loop.instance.adapters.resolve((("a", 0.8), ("b", 0.5)))
    with fused(dit, tuple((u.adapter.value, u.scale) for u in stack)):
        loop.fused = tuple((u.adapter, u.scale) for u in stack)
        [merged] = run(loop, [Request("a coat", seed=9, steps=3, adapters=(("a", 0.8), ("b", 0.5)))])
        loop.fused = None
        assert not torch.equal(dit.blocks[0].attn1.to_q.weight, before["blocks.0.attn1.to_q.weight"][1])
    [unfused] = run(loop, [Request("a coat", seed=9, steps=3, adapters=(("a", 0.8), ("b", 0.5)))])
    assert (merged - unfused).abs().max() <= 1e-5
    after = dit.state_dict(keep_vars=True)
    assert all(after[k] is obj and torch.equal(after[k], copy) for k, (obj, copy) in before.items())


def test_at_float64_a_lora_runs_in_float64_so_fused_and_unfused_agree_to_its_rounding(card):
    """The LoRA plan takes the weights' dtype at float64 (float32 otherwise): a float64 run, a parity reference,
    is not rounded to float32 in its adapters' products."""
    loop = DenoiseLoop(ModelInstance(card, CPU, "float64"), cache=TextFeatureCache(disk=False))
    dit, request = loop.instance.component("transformer"), Request("a coat", seed=9, steps=3, adapters=(("a", 0.8),))
    stack = loop.instance.adapters.resolve(request.adapters)
    with fused(dit, tuple((u.adapter.value, u.scale) for u in stack)):
        loop.fused = tuple((u.adapter, u.scale) for u in stack)
        [merged] = run(loop, [request])
        loop.fused = None
    [unfused] = run(loop, [request])
    assert unfused.dtype == torch.float64
    assert 0 < (merged - unfused).abs().max() <= 1e-12


NUMPY = Platform("numpy", "generic")
MIXED = [Request("a bag", seed=1, steps=3, guidance=2.0),
         Request("a bag", seed=1, steps=3, adapters=(("a", 0.7),)),
         Request("a coat", seed=2, steps=2, guidance=1.0, adapters=(("a", 1.0), ("b", -0.6))),
         Request("a shirt", seed=3, steps=3, adapters=(("ctl", 1.5), ("b", 1.0)), control=control(1)),
         Request("a dress", seed=4, steps=3, guidance=2.0, adapters=(("ctl", 0.5),), control=control(2))]


def test_numpy_runs_a_mixed_adapter_batch_as_torch_does_at_float64(card):
    """The numpy reference forwards of LoRA stacks and the ControlNet (invariant 4): the same files, the same mixed
    batch, the same latents as torch's loop to float64 rounding — and each adapter changes them."""
    cache = TextFeatureCache(disk=False)  # numpy reads the features torch encodes: the DiTs are what is compared
    torch_run, numpy_run = (np.stack([np.asarray(latent, dtype=np.float64) for latent in run(
        DenoiseLoop(ModelInstance(card, platform, "float64"), cache=cache), MIXED)]) for platform in (CPU, NUMPY))
    assert np.abs(numpy_run - torch_run).max() <= 1e-12
    [plain] = run(DenoiseLoop(ModelInstance(card, NUMPY, "float64"), cache=cache), [Request("a bag", seed=1, steps=3)])
    assert np.abs(numpy_run[1] - plain).max() > 1e-3, "the LoRA changes the image"
    loop = DenoiseLoop(ModelInstance(card, NUMPY, "float64"), cache=cache)
    [shirt] = run(loop, [Request("a shirt", seed=3, steps=3, adapters=(("b", 1.0),))])
    assert np.abs(numpy_run[3] - shirt).max() > 1e-3, "the ControlNet changes the image"
    [alone] = run(loop, [MIXED[3]])
    assert np.abs(alone - numpy_run[3]).max() <= 1e-12, "in numpy too a request's rows are its own"


def test_numpy_fuses_a_stack_as_torch_does_and_restores_its_base(card):
    request = Request("a coat", seed=9, steps=3, adapters=(("a", 0.8), ("b", 0.5)))
    cache, made = TextFeatureCache(disk=False), {}
    for platform in (CPU, NUMPY):
        loop = DenoiseLoop(ModelInstance(card, platform, "float64"), cache=cache)
        dit, stack = loop.instance.component("transformer"), loop.instance.adapters.resolve(request.adapters)
        before = {k: np.array(np.asarray(v)) for k, v in dit.state_dict().items()}
        with fused(dit, tuple((u.adapter.value, u.scale) for u in stack)):
            loop.fused = tuple((u.adapter, u.scale) for u in stack)
            [made[platform.device]] = run(loop, [request])
            loop.fused = None
        [unfused] = run(loop, [request])
        assert np.abs(np.asarray(made[platform.device]) - np.asarray(unfused)).max() <= 1e-12
        assert all(np.array_equal(before[k], np.asarray(v)) for k, v in dit.state_dict().items())
    assert np.abs(np.asarray(made["cpu"]) - made["numpy"]).max() <= 1e-12


def test_parity_compares_each_adapter_with_numpy_and_a_wrong_one_fails_its_row_only(card, monkeypatch):
    """`parity --card`: a row per adapter (its request in one mixed batch) at float64 and float32 against the numpy
    reference; LoRAs whose torch delta is twice what it should be fail their rows, not the ControlNet's."""
    from cardtool.backends import lora as lora_module
    from cardtool.core.evaluation.card_parity import adapter_rows, unchecked

    rows = adapter_rows(card, CPU)
    assert [(r.cell, r.dtype) for r in rows] == [(f"adapters.{name}:{kind}/cpu/generic", dtype)
                                                 for dtype in ("float64", "float32")
                                                 for name, kind in (("invert", "lora"), ("a", "lora"), ("b", "lora"),
                                                                    ("ctl", "controlnet"))]
    assert all(r.passed for r in rows) and all(r.max_abs_err < 1e-12 for r in rows if r.dtype == "float64")
    assert all(r.max_abs_err > 1e-9 for r in rows if r.dtype == "float32"), "float32 ran, not float64 again"
    low = [r for r in adapter_rows(card, Platform("cpu", "avx512_bf16")) if r.dtype == "bfloat16"]
    assert [r.cell.split(":")[0] for r in low] == ["adapters.invert", "adapters.a", "adapters.b", "adapters.ctl"]
    assert all(r.passed and r.against == "the same batch in float32" and 1e-5 < r.max_abs_err for r in low)
    assert not [u for u in unchecked(card, CPU, rows) if u["name"].startswith("adapters.")]
    assert adapter_rows(card, NUMPY) == [], "numpy is the reference: nothing to compare it with"
    slots = lora_module._slots
    monkeypatch.setattr(lora_module, "_SLOT_CACHE", {})
    monkeypatch.setattr(lora_module, "_slots", lambda *args: (lambda a, b: (a, 2 * b))(*slots(*args)))  # twice B
    failed = {(r.cell.split(":")[0], r.dtype) for r in adapter_rows(card, CPU) if not r.passed}
    assert failed == {(f"adapters.{name}", dtype) for name in ("invert", "a", "b") for dtype in ("float64", "float32")}


def test_generate_fuse_and_metadata_record_the_stack_with_versions(card, tmp_path):
    loaded = LoadedCard(card, device="cpu")
    plain = loaded.generate(["a bag"], steps=2, adapters=[("a", 0.5), ("b", 1.0)], out=tmp_path / "p")
    merged = loaded.generate(["a bag"], steps=2, adapters=[("a", 0.5), ("b", 1.0)], fuse=True, out=tmp_path / "f")
    record = json.loads(read_png_metadata(plain.images[0].path)["adapters"])
    assert [(r["name"], r["scale"]) for r in record] == [("a", 0.5), ("b", 1.0)]
    assert record[0]["version"] == sha256_file(card.folder / "adapters" / "a.safetensors")
    assert read_png_metadata(merged.images[0].path)["fused"] == "true"
    from PIL import Image

    a, b = (np.asarray(Image.open(r.images[0].path), dtype=int) for r in (plain, merged))
    assert np.abs(a - b).max() <= 1, "fused and unfused give the same picture"


def test_a_call_from_another_thread_waits_for_a_fused_call_to_finish(card):
    import threading

    loaded = LoadedCard(card, device="cpu")
    stack = [("a", 1.0), ("b", 1.0)]
    alone = {"plain": loaded.generate("a bag", steps=3, out=None).images[0].pixels,
             "fused": loaded.generate("a bag", steps=3, adapters=stack, fuse=True, out=None).images[0].pixels}
    made, finished = {}, threading.Event()

    def plain():
        made["plain"] = loaded.generate("a bag", steps=3, out=None).images[0].pixels
        finished.set()

    beside = threading.Thread(target=plain)

    def on_step(done, total):  # mid-run, with the stack merged into the shared weights, a second thread calls
        if done == 1:
            beside.start()
            finished.wait(0.5)  # long enough for that call to run, were it let in

    made["fused"] = loaded.generate("a bag", steps=3, adapters=stack, fuse=True, out=None,
                                    on_step=on_step).images[0].pixels
    beside.join()
    assert np.array_equal(made["plain"], alone["plain"]), "the other thread's call ran on the fused weights"
    assert np.array_equal(made["fused"], alone["fused"])


def test_hot_swap_serves_a_new_version_to_the_next_request_only(card, loop):
    dit = loop.instance.component("transformer")
    request = Request("a bag", seed=2, steps=3, adapters=(("b", 1.0),))
    [first] = run(loop, [request])
    in_flight = loop.init([request])
    old = in_flight[0].adapters[0].adapter.version
    write_lora_b(card.folder, dit, seed=99)  # a new version on disk, same name
    while not in_flight[0].done:
        with torch.inference_mode():
            loop.step(in_flight)
    assert torch.equal(in_flight[0].latents, first), "a request in flight finishes on the version it started with"
    [after] = run(loop, [request])
    assert (after - first).abs().max() > 1e-3, "the next request uses the new version"
    assert loop.instance.component("transformer") is dit, "the base is not reloaded"
    new = loop.instance.adapters.get("b").version
    assert new != old and len(new) == 64


def test_a_version_written_in_place_with_the_old_timestamp_is_served(card, loop):
    """A new version of the same size copied over the old one with its timestamp kept (`cp --preserve`, `rsync -t`):
    the file's size, mtime and inode say nothing changed — its ctime does."""
    from helpers import put_timestamp_back

    dit = loop.instance.component("transformer")
    request = Request("a bag", seed=2, steps=3, adapters=(("b", 1.0),))
    [first] = run(loop, [request])
    path = card.folder / "adapters" / "b.safetensors"
    before, old = path.stat(), loop.instance.adapters.get("b").version
    staged = card.folder / "staged"
    staged.mkdir()
    write_lora_b(staged, dit, seed=99)
    path.write_bytes((staged / "adapters" / "b.safetensors").read_bytes())  # in place: the same inode
    put_timestamp_back(path, before)
    assert (path.stat().st_size, path.stat().st_ino, path.stat().st_mtime_ns) == \
        (before.st_size, before.st_ino, before.st_mtime_ns)
    [after] = run(loop, [request])
    assert (after - first).abs().max() > 1e-3, "the new version, not the one read before"
    assert loop.instance.adapters.get("b").version == sha256_file(path) != old


def test_a_version_written_while_the_adapter_is_read_is_served_under_its_own_sha256(card, loop, monkeypatch):
    """The file is hashed and then read in another open: a new version renamed over it in between is read again,
    so the version that PNG metadata and cache keys record is the sha256 of the weights served."""
    import cardtool.backends.lora as lora_module

    dit = loop.instance.component("transformer")
    path = card.folder / "adapters" / "b.safetensors"
    old, read, calls = sha256_file(path), lora_module.read_lora, []

    def swapped_after_hashing(file):
        calls.append(file)
        if len(calls) == 1:
            write_lora_b(card.folder, dit, seed=99)
        return read(file)

    monkeypatch.setattr(lora_module, "read_lora", swapped_after_hashing)
    served = loop.instance.adapters.get("b")
    assert len(calls) == 2 and served.version == sha256_file(path) != old
    on_disk, _ = lora_module.lora_parts(read(path)[0])
    assert served.value.a.keys() == on_disk.keys() and all(torch.equal(served.value.a[m], on_disk[m]) for m in on_disk)

    def never_settles(file):
        write_lora_b(card.folder, dit, seed=100 + len(calls))
        calls.append(file)
        return read(file)

    monkeypatch.setattr(lora_module, "read_lora", never_settles)
    write_lora_b(card.folder, dit, seed=7)
    with pytest.raises(BadInput, match="b.safetensors kept changing while it was read"):
        loop.instance.adapters.get("b")
    assert len(calls) == 2 + 3, "read three times, then refused"


def test_text_encoder_cache_entries_survive_an_adapter_change(card, tmp_path):
    cache = TextFeatureCache(tmp_path / "cache")
    loaded = LoadedCard(card, device="cpu", cache=cache)
    loaded.generate(["a bag"], steps=1, out=tmp_path / "o1")
    misses = cache.misses
    loaded.generate(["a bag"], steps=1, adapters=[("a", 1.0)], out=tmp_path / "o2")
    loaded.generate(["a bag"], steps=1, adapters=[("b", 0.5)], out=tmp_path / "o3")
    assert cache.misses == misses and cache.hits >= 4


def test_control_scale_zero_and_no_controlnet_are_the_same_image(loop):
    plain, zero = run(loop, [Request("a bag", seed=1, steps=2),
                             Request("a bag", seed=1, steps=2, adapters=(("ctl", 0.0),), control=control(0))])
    assert torch.equal(plain, zero)


def test_a_control_image_without_its_controlnet_or_of_another_size_is_refused_by_the_loop(loop):
    with pytest.raises(BadInput, match="ControlNet 'ctl' needs a control image"):
        loop.init([Request("a bag", adapters=(("ctl", 1.0),))])
    with pytest.raises(BadInput, match=r"a control image needs a ControlNet in the request's adapters \(--adapter "
                                       r"NAME\); card 'tiny-adapters' declares: invert, a, b, ctl$"):
        loop.init([Request("a bag", adapters=(("a", 1.0),), control=control(0))])
    wide = ControlImage.make(np.zeros((20, 24), np.uint8), "none")  # an array made by hand, not read and resized
    with pytest.raises(BadInput, match="a control image for this card is 28×28, got 24×20"):
        loop.init([Request("a bag", adapters=(("ctl", 1.0),), control=wide)])
    states = loop.init([Request("a bag", adapters=(("ctl", 1.0),), control=control(0)),
                        Request("a bag", seed=1, adapters=(("ctl", 0.5),), control=control(0)),
                        Request("a bag", adapters=(("ctl", 1.0),), control=control(1))])
    assert states[0].control is states[1].control, "one latent for one control image"
    assert not torch.equal(states[0].control, states[2].control) and states[0].control.shape == (1, 4, 1, 8, 8)


def test_silhouette_fills_enclosed_holes_and_edges_trace_the_outline():
    image = np.zeros((12, 12), np.uint8)
    image[2:10, 2:10] = 200
    image[4:8, 4:8] = 0  # a dark pattern inside the garment
    shape = silhouette(image)
    assert (shape[2:10, 2:10] == 255).all() and shape.sum() == 64 * 255
    outline = edges(np.where(shape > 0, 255, 0).astype(np.uint8))
    assert outline[5, 5] == 0 and outline[5, 2] == 255 and outline[0, 0] == 0
    batch = silhouette(np.stack([image, 255 - image]))
    assert np.array_equal(batch[0], shape)


def test_silhouettes_ink_starts_above_32_and_the_background_floods_from_every_border():
    """A pixel brighter than INK = 32 is garment; a frame's inside is filled, the ring outside it is not; and the
    background is flooded from each border row and column (a flood missing one fills that border's notch)."""
    frame = np.zeros((8, 8), np.uint8)
    frame[1, 1:7] = frame[6, 1:7] = frame[1:7, 1] = frame[1:7, 6] = 33
    shape = silhouette(frame)
    assert (shape[1:7, 1:7] == 255).all() and shape.sum() == 36 * 255, "the frame filled, the outer ring background"
    assert not silhouette(np.where(frame > 0, 32, 0).astype(np.uint8)).any(), "32 is background"
    notched = np.full((8, 8), 200, np.uint8)  # a garment filling the image but for a notch in each border
    notched[0, 3:5] = notched[-1, 3:5] = notched[3:5, 0] = notched[3:5, -1] = 0
    assert np.array_equal(silhouette(notched) == 0, notched == 0), "each notch open to its own border only"


def test_an_edge_is_a_gradient_above_a_quarter_of_the_largest():
    steps = np.repeat(np.array([[0, 0, 0, 50, 50, 50, 250, 250, 250]], np.uint8), 5, axis=0)
    outline = edges(steps)  # Sobel magnitudes 4·50 = 200 beside the first step, 4·200 = 800 beside the second
    assert outline[:, 5:7].all() and not outline[:, 2:4].any() and not outline[:, [0, 1, 4, 7, 8]].any()
    raised = steps.copy()
    raised[:, 3:6] = 51  # 204 > 800 / 4 (the peak is 4·199 = 796)
    assert edges(raised)[:, 2:4].all()


def test_a_control_is_a_grey_uint8_image_and_its_preprocessor_is_named_after_the_last_colon():
    from cardtool.core.sampling.control import parse_control

    for wrong in (np.zeros((4, 4), np.float32), np.zeros((4, 4, 3), np.uint8)):
        with pytest.raises(BadInput, match="a control image is a file, a PIL image or a grey uint8"):
            ControlImage.make(wrong, "none")
    assert parse_control("shirt.png:edges") == (Path("shirt.png"), "edges")
    assert parse_control("a:b/shirt.png:none") == (Path("a:b/shirt.png"), "none")
    for plain in ("edges", "shirt.png", "C:/x/shirt.png", "take:2.png"):  # no preprocessor: the name is the file's
        assert parse_control(plain) == (Path(plain), None), plain
    with pytest.raises(BadInput, match="unknown preprocessor 'blur'"):
        parse_control("shirt.png:blur")


def test_a_control_image_reads_by_its_modes_own_range(tmp_path):
    """A 16-bit mask, a float image, a cut-out with transparency and a photo stored sideways read as the garment they
    show: Pillow's plain grey conversion clipped 16-bit values (all white), truncated floats to 0 or 1 (all black),
    took a transparent pixel's colour instead of the background, and ignored the EXIF orientation."""
    from PIL import Image

    from cardtool.core.sampling.control import read_grey

    shape = np.zeros((28, 28), bool)
    shape[6:22, 9:19] = True  # a garment, bright on a dark background
    files = {"16.png": Image.fromarray(np.where(shape, 60000, 2000).astype(np.uint16)),  # background 8 of 255
             "float.tiff": Image.fromarray(np.where(shape, 0.9, 0.0).astype(np.float32)),
             "cutout.png": Image.fromarray(np.dstack([np.full((28, 28, 3), 230), np.where(shape, 255, 0)])
                                           .astype(np.uint8), "RGBA"),
             "keyed.png": Image.fromarray(np.where(shape, 0, 1).astype(np.uint8), "P")}  # index 1: white, clear
    files["keyed.png"].putpalette([230, 230, 230, 255, 255, 255])
    files["keyed.png"].info["transparency"] = 1
    for name, image in files.items():
        image.save(tmp_path / name)
        grey = read_grey(tmp_path / name, 28)
        assert np.array_equal(silhouette(grey) > 0, shape), name
        assert grey[shape].min() >= 200 and grey[~shape].max() <= 8, name
    Image.new("LA", (28, 28), (200, 128)).save(tmp_path / "half.png")  # half transparent: half its grey on black
    assert (read_grey(tmp_path / "half.png", 28) == 100).all()
    Image.new("LA", (28, 28), (255, 255)).save(tmp_path / "opaque.png")  # grey · alpha / 255: white stays white
    assert (read_grey(tmp_path / "opaque.png", 28) == 255).all()
    Image.fromarray(np.where(shape, 200, 0).astype(np.uint8)).save(tmp_path / "8.png")  # 8-bit grey as it was
    assert np.array_equal(read_grey(tmp_path / "8.png", 28), np.where(shape, 200, 0))
    # each mode's own range, rounded: 16-bit v / 257 (60000 → 233, 2000 → 8), float32 v · 255 (0.9 → 229.49…), NaN 0
    assert np.array_equal(read_grey(tmp_path / "16.png", 28), np.where(shape, 233, 8))
    Image.fromarray(np.full((28, 28), 65535, np.uint16)).save(tmp_path / "white16.png")
    assert (read_grey(tmp_path / "white16.png", 28) == 255).all(), "16-bit white is white"
    assert np.array_equal(read_grey(tmp_path / "float.tiff", 28), np.where(shape, 229, 0))
    Image.fromarray(np.where(shape, np.nan, 2.0).astype(np.float32)).save(tmp_path / "nan.tiff")
    assert np.array_equal(read_grey(tmp_path / "nan.tiff", 28), np.where(shape, 0, 255))
    for unreadable in (tmp_path / "missing.png", tmp_path):
        with pytest.raises(BadInput, match="cannot read control image: "):
            read_grey(unreadable, 28)
    (tmp_path / "half.txt").write_text("not an image")
    with pytest.raises(BadInput, match="cannot read image to start from .*half.txt: UnidentifiedImageError"):
        read_grey(tmp_path / "half.txt", 28, what="image to start from")
    with pytest.raises(BadInput, match="unknown control preprocessor 'blur'; choose one of: silhouette, edges, none"):
        ControlImage.make(np.zeros((28, 28), np.uint8), "blur")
    bar = np.zeros((28, 28), np.uint8)
    bar[2:10] = 200  # along the top as stored; a camera's EXIF orientation 6 shows it turned 90° clockwise
    photo = Image.fromarray(bar)
    exif = photo.getexif()
    exif[0x0112] = 6
    photo.save(tmp_path / "photo.jpg", exif=exif, quality=100)
    upright = read_grey(tmp_path / "photo.jpg", 28) > 100
    assert upright[:, 18:26].all() and not upright[:, :17].any(), "a bar down the right side, as a viewer shows it"


def test_a_damaged_image_or_one_in_another_format_is_refused_by_name(tmp_path):
    """Pillow raises SyntaxError for a PNG whose data runs into a broken chunk (it escaped as a traceback), and its
    rarer decoders (ICNS, DDS, …) errors of their own: only the usual formats are read, each failure said so."""
    import struct
    import zlib

    from PIL import Image

    from cardtool.core.sampling.control import read_grey
    from cardtool.core.sampling.images import _chunk

    rows = np.concatenate([np.zeros((28, 1), np.uint8), np.arange(28 * 28).reshape(28, 28).astype(np.uint8)], 1)
    data = zlib.compress(rows.tobytes())
    header = png_bytes(rows[:, 1:])[:33]  # the signature and IHDR
    (tmp_path / "broken.png").write_bytes(header + _chunk(b"IDAT", data[:11]) + struct.pack(">I", 4) +
                                          b"\x01\xcd \xcd" + data[11:] + _chunk(b"IEND", b""))
    with pytest.raises(BadInput, match=r"cannot read control image .*broken.png: SyntaxError: broken PNG file"):
        read_grey(tmp_path / "broken.png", 28)
    Image.new("RGBA", (32, 32)).save(tmp_path / "icon.icns")
    with pytest.raises(BadInput, match=r"icon.icns: UnidentifiedImageError: not a PNG, JPEG, WEBP, GIF, BMP, TIFF or "
                                       r"PPM image$"):
        read_grey(tmp_path / "icon.icns", 28)
    Image.fromarray(rows[:, 1:]).save(tmp_path / "scan.pgm")  # Netpbm, as scanners write
    assert np.array_equal(read_grey(tmp_path / "scan.pgm", 28), rows[:, 1:])


def test_cli_errors_exit_2(card, tmp_path):
    runner = CliRunner()
    base = ["generate", str(card.folder), "-p", "a bag", "--steps", "1", "--out", str(tmp_path / "o")]
    bad_image = tmp_path / "bad.png"
    bad_image.write_bytes(b"not a png")
    bomb = tmp_path / "bomb.png"  # 4,097 × 4,097 black pixels in a few kilobytes: refused before decoding
    bomb.write_bytes(png_bytes(np.zeros((4097, 4097), np.uint8), {}))
    adapters = ", ".join(card.manifest.adapters)
    good_image = tmp_path / "good.png"
    save_png(good_image, np.zeros((28, 28), np.uint8))
    for extra, message in [(["--adapter", "nope"], f"declares no adapter 'nope'; its adapters: {adapters}"),
                           (["--adapter", "a=big"], "is not a number"),
                           (["--adapter", "ctl"], "needs a control image"),
                           (["--control", str(bad_image)], "cannot read control image"),
                           (["--control", str(tmp_path / "missing.png")], "cannot read control image"),
                           (["--control", f"{bomb}:silhouette", "--adapter", "ctl"], "4097 × 4097 pixels, more than"),
                           (["--fuse"], "has none"),
                           (["--adapter", "a", "--adapter", "a=0.5"], "adapter 'a' is named twice"),
                           (["--adapter", "ctl=0.5", "--control", str(good_image), "--control-scale", "0.7"],
                            "give ControlNet 'ctl' one scale: NAME=SCALE in --adapter, or --control-scale")]:
        result = runner.invoke(app, base + extra)
        assert result.exit_code == 2 and message in result.output, (extra, result.output)
    shape = tmp_path / "shape.png"
    save_png(shape, np.full((28, 28), 255, np.uint8))
    no_net = runner.invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--control", str(shape),
                                 "--out", str(tmp_path / "o")])
    assert no_net.exit_code == 2 and "--control needs a ControlNet; card 'tiny-base' declares none" in no_net.output
    no_net = runner.invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--control",
                                 f"{shape}:silhouette", "--out", str(tmp_path / "o")])  # preprocessed: no net asked
    assert no_net.exit_code == 2 and "--control needs a ControlNet; card 'tiny-base' declares none" in no_net.output


def test_a_control_image_alone_adds_the_cards_one_controlnet_at_scale_1_or_control_scale(card):
    """`--control IMAGE` without the ControlNet in --adapter takes the card's only one, at 1 unless --control-scale
    says otherwise; named in --adapter, it keeps that stack's scale."""
    from cardtool.core.sampling.planning import plan_requests

    for extra, stack in (({}, (("ctl", 1.0),)), ({"control_scale": 0.3}, (("ctl", 0.3),)),
                         ({"adapters": [("a", 0.5), ("ctl", 0.7)]}, (("a", 0.5), ("ctl", 0.7)))):
        [request], _ = plan_requests(card, ["a bag"], control=control(0), **{"adapters": [], **extra})
        assert request.adapters == stack, extra


def test_eval_with_a_controlnet_says_it_takes_no_control_image_before_any_model_loads(card, monkeypatch):
    from cardtool.core.evaluation import evaluate as evaluate_module

    def never(*args, **kwargs):
        raise AssertionError("a model loaded before the requests were planned")

    monkeypatch.setattr(evaluate_module, "ModelInstance", never)
    with pytest.raises(BadInput, match="ControlNet 'ctl' needs a control image .*; eval makes its images without one"):
        evaluate_module.evaluate(str(card.folder), judge=str(EXAMPLE_CARDS / "tiny-judge"), per_class=1,
                                 adapters=[("ctl", 1.0)])


def test_a_lora_file_that_does_not_fit_is_refused(card, loop):
    torch.manual_seed(0)
    write_lora(card.folder / "adapters" / "b.safetensors", {"blocks.0.attn1.to_q": torch.randn(3, 7)},
               {"blocks.0.attn1.to_q": torch.randn(32, 3)}, rank=3, alpha=3)
    with pytest.raises(BadInput, match="does not fit"):
        loop.instance.adapters.get("b")
    result = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a bag", "--adapter", "b"])
    assert result.exit_code == 2 and "does not fit" in result.output
    result = CliRunner().invoke(app, ["cards", "validate", str(card.folder)])
    assert result.exit_code == 1 and "adapters.b.weights" in result.output, "the card's check reports it, located"


@pytest.mark.parametrize(("change", "message"), [
    ("header_rank", "its header says rank 5, the card 3"),
    ("header_alpha", "its header says alpha 6.0, the card 3"),
    ("integer", "is I32; LoRA weights are floating point"),
])
def test_a_lora_whose_header_or_dtype_disagrees_fails_validation_not_only_the_request(card, change, message):
    """`cards validate` checks what a request would: a card that validates must serve its adapters."""
    from safetensors.torch import load_file, save_file

    path = card.folder / "adapters" / "b.safetensors"
    tensors = load_file(str(path))
    metadata = {"rank": "3", "alpha": "3.0"}
    if change == "header_rank":
        metadata["rank"] = "5"
    elif change == "header_alpha":
        metadata["alpha"] = "6.0"
    else:
        first = sorted(tensors)[0]
        tensors[first] = (tensors[first] * 100).to(torch.int32)
    save_file(tensors, str(path), metadata=metadata)
    validated = CliRunner().invoke(app, ["cards", "validate", str(card.folder), "--json"])
    [problem] = [p for c in json.loads(validated.stdout)["results"] for p in c["problems"]]
    assert validated.exit_code == 1 and message in problem["message"] and problem["field"] == "adapters.b.weights"
    served = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a bag", "--steps", "1", "--adapter", "b",
                                      "--out", str(card.folder.parent / "o"), "--json"])
    assert served.exit_code == 2 and message in json.loads(served.stdout)["error"]["message"]


@pytest.mark.parametrize(("config", "field", "message"), [
    ("{blocks: two}", "adapters.ctl.config.blocks", "blocks must be a whole number in 1…2"),
    ("{blocks: 3}", "adapters.ctl.config.blocks", "blocks must be a whole number in 1…2"),
    ("{blocks: 1, depth: 2}", "adapters.ctl.config.depth", "a ControlNet's config takes only blocks"),
    ("{blocks: 2}", "adapters.ctl.weights", "tensors the config implies are missing: blocks.1."),
    ("reshaped", "adapters.ctl.weights", "controlnet_blocks.0.weight is [32, 31], the config implies [32, 32]"),
])
def test_a_controlnet_whose_config_or_weights_do_not_fit_fails_validation(card, config, field, message):
    """A ControlNet is checked against the DiT it copies blocks of, from the headers: a card that validates must
    serve it."""
    from safetensors.torch import load_file, save_file

    path, manifest = card.folder / "adapters" / "ctl.safetensors", card.folder / "card.yaml"
    if config == "reshaped":
        tensors = load_file(str(path))
        tensors["controlnet_blocks.0.weight"] = tensors["controlnet_blocks.0.weight"][:, :31].contiguous()
        save_file(tensors, str(path))
    else:
        manifest.write_text(manifest.read_text().replace("config: {blocks: 1}", f"config: {config}"))
    validated = CliRunner().invoke(app, ["cards", "validate", str(card.folder), "--json"])
    [problem] = [p for c in json.loads(validated.stdout)["results"] for p in c["problems"]]
    assert validated.exit_code == 1 and problem["field"] == field and message in problem["message"], problem


def test_control_from_a_file_through_the_cli(card, tmp_path):
    image = np.zeros((28, 28), np.uint8)
    image[4:24, 8:20] = 180
    save_png(tmp_path / "c.png", image)
    over = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a bag", "--steps", "2", "--control",
                                    f"{tmp_path / 'c.png'}:edges", "--out", str(tmp_path / "c.png"), "--json"])
    assert over.exit_code == 2 and json.loads(over.stdout)["error"]["message"].startswith(
        f"--out {tmp_path / 'c.png'} is the --control file this call reads"), "never written over its control image"
    result = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a bag", "--steps", "2", "--control",
                                      f"{tmp_path / 'c.png'}:edges", "--control-scale", "0.5", "--json",
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    meta = json.loads(result.stdout)["images"][0]
    assert meta["adapters"][0]["name"] == "ctl" and meta["adapters"][0]["scale"] == 0.5
    assert meta["control"]["preprocessor"] == "edges"
    made = Path(meta["path"])  # made again from its metadata: the control image, preprocessor and scale with it
    result = CliRunner().invoke(app, ["generate", str(card.folder), "--like", str(made), "--json",
                                      "--out", str(tmp_path / "again")])
    again = Path(json.loads(result.stdout)["images"][0]["path"])
    assert again.name == made.name and again.read_bytes() == made.read_bytes()


def test_a_control_image_as_a_file_a_pil_image_an_array_or_made_already_is_one_picture(card, tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    colour = Image.fromarray(rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8), "RGB")
    colour.save(tmp_path / "c.png")
    from cardtool.core.sampling.control import ControlImage, read_grey

    grey = read_grey(tmp_path / "c.png", 28)  # as an array, or made already: the same control image
    preprocessor = card.manifest.adapters["ctl"].control
    made = [LoadedCard(str(card.folder)).generate("a bag", steps=2, control=c, out=None).images[0]
            for c in (tmp_path / "c.png", colour, grey, ControlImage.make(grey, preprocessor))]
    assert all((m.pixels == made[0].pixels).all() for m in made)
    assert len({json.loads(m.metadata["control"])["sha256"] for m in made}) == 1
    with pytest.raises(BadInput, match="a control preprocessor needs a control image"):
        LoadedCard(str(card.folder)).generate("a bag", steps=2, preprocessor="edges", out=None)


def test_eval_takes_an_adapter_stack_and_names_it_in_the_report(card, tmp_path):
    from helpers import write_idx_folder

    data = write_idx_folder(tmp_path / "idx")
    base = ["eval", str(card.folder), "--judge", str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1", "--steps", "1",
            "--data", str(data), "--json"]
    result = CliRunner().invoke(app, [*base, "--adapter", "a=0.5", "--adapter", "b"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["adapters"] == [{"name": "a", "scale": 0.5}, {"name": "b", "scale": 1.0}]
    plain = json.loads(CliRunner().invoke(app, base).stdout)
    assert plain["adapters"] == [] and plain["rows"][0]["fid_fmnist"] != report["rows"][0]["fid_fmnist"]
    refused = CliRunner().invoke(app, [*base, "--adapter", "a", "--record"])
    assert refused.exit_code == 2 and "--record" in refused.output


def test_random_plans_give_every_row_its_own_stacks_delta_and_leave_the_others_bit_for_bit():
    """Random stacks (1–4 LoRAs of ranks 1–17, some skipping a module, scales ±), rows sorted by stack or not, with
    rows of none, through either CPU tier's kernel, with and without inference mode: each row gets x·(W0 + Σ its
    deltas)ᵀ, and a row without a LoRA on the module keeps the base output's bits."""
    import random

    from cardtool.backends import cpu_avx2
    from cardtool.backends.lora import LoraWeights

    torch.manual_seed(0)
    rng = random.Random(0)
    for case in range(150):
        loras = []
        for i in range(rng.randint(1, 4)):
            r, on = rng.choice([1, 2, 3, 5, 8, 12, 17]), [m for m in ("m", "n") if rng.random() < 0.7] or ["m"]
            loras.append(LoraWeights(f"{case}.{i}", r, rng.choice([1.0, float(r)]),
                                     {m: torch.randn(r, 12) for m in on}, {m: torch.randn(12, r) for m in on}))
        stacks = [tuple((lora, rng.choice([1.0, 0.5, -2.0])) for lora in rng.sample(loras, rng.randint(1, len(loras))))
                  for _ in range(rng.randint(1, 4))]
        rows = [rng.randrange(-1, len(stacks)) for _ in range(rng.randint(1, 9))]
        rows = sorted(rows) if rng.random() < 0.5 else rows
        x, w = torch.randn(len(rows), 3, 12), torch.randn(12, 12)
        base = x @ w.T
        for module in ("m", "n"):
            plan = LoraPlan(stacks, rows, rng.choice([lora_bgmv, cpu_avx2.lora_bgmv]), "cpu")
            with torch.inference_mode(rng.random() < 0.5):
                out = plan(module, x, base.clone())
            for i, slot in enumerate(rows):
                deltas = [lora.delta(module, s) for lora, s in (stacks[slot] if slot >= 0 else ()) if module in lora.a]
                if not deltas:
                    assert torch.equal(out[i], base[i]), (case, module, rows, i)
                    continue
                torch.testing.assert_close(out[i], x[i] @ (w + sum(deltas)).T, atol=1e-4, rtol=1e-5)


def test_a_scale_float32_cannot_hold_is_refused_before_sampling(card, tmp_path):
    """The products run in float32 at most: a scale beyond its range gave NaN images after the work (exit 1)."""
    result = CliRunner().invoke(app, ["generate", str(card.folder), "-p", "a bag", "--adapter", "a=1e308", "--steps",
                                      "1", "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 2, result.output
    assert "a scale of 1e+308 is beyond float32's range" in json.loads(result.stdout)["error"]["message"]
    with pytest.raises(BadInput, match="a scale of -1e\\+39 is beyond float32's range"):
        LoadedCard(str(card.folder)).generate(["a bag"], adapters=[("a", -1e39)], steps=1, out=tmp_path / "o")


Q = "blocks.0.attn1.to_q"
TARGET = {f"{Q}.weight": (32, 16), "blocks.0.norm_q.weight": (32,), "patch_embedding.weight": (32, 4, 1, 2, 2)}


def _pair(module: str, rank: int = 4, dtype: str = "F32", prefix: str = "") -> dict:
    return {f"{prefix}{module}.lora_A.weight": (dtype, (rank, 16)),
            f"{prefix}{module}.lora_B.weight": (dtype, (32, rank))}


@pytest.mark.parametrize(("header", "metadata", "targets", "reasons"), [
    (_pair(Q), {"rank": "4", "alpha": "4.0"}, None, []),
    (_pair(Q, prefix="transformer."), {}, None, []),  # diffusers' pipeline prefix on every tensor
    ({}, {}, None, ["the file holds no LoRA tensors"]),
    ({"x.weight": ("F32", (4, 16))}, {}, None,
     ["'x.weight' is not named <module>.lora_A.weight or <module>.lora_B.weight"]),
    ({f"{Q}.lora_A.weight": ("F32", (4, 16))}, {}, None, [f"'{Q}' has lora_A without its pair"]),
    (_pair("blocks.0.norm_q"), {}, None, ["'blocks.0.norm_q' is not a linear layer of the target"]),
    (_pair("blocks.9.attn1.to_q"), {}, None, ["'blocks.9.attn1.to_q' is not a linear layer of the target"]),
    (_pair(Q), {}, ["*.to_k"], [f"'{Q}' is not among the adapter's targets (*.to_k)"]),
    (_pair(Q, rank=8), {}, None, [f"'{Q}': lora_A [8, 16] and lora_B [32, 8] are not [4, 16] and [32, 4] (rank 4 on a "
                                  "[32, 16] layer)"]),
    (_pair(Q, dtype="I32"), {}, None, [f"'{Q}.lora_A.weight' is I32; LoRA weights are floating point (F64, F32, F16, "
                                       f"BF16)", f"'{Q}.lora_B.weight' is I32; LoRA weights are floating point (F64, "
                                       "F32, F16, BF16)"]),
    (_pair(Q), {"rank": "5", "alpha": "x"}, None, ["its header says rank 5, the card 4",
                                                   "its header says alpha x, the card 4.0"]),
    # diffusers' LoraConfig fields when the file has no plain ones; the plain ones when it has both
    (_pair(Q), {"lora_adapter_metadata": '{"transformer.r": 4, "transformer.lora_alpha": 8}'}, None,
     ["its header says alpha 8, the card 4.0"]),
    (_pair(Q), {"alpha": "4", "lora_adapter_metadata": '{"r": 4, "lora_alpha": 8}'}, None, []),
    # the pipeline prefix is dropped only when every tensor carries it
    ({**_pair(Q, prefix="transformer."), **_pair(Q)}, {}, None, [f"'transformer.{Q}' is not a linear layer of the "
                                                                 "target"]),
], ids=["fits", "prefixed", "empty", "misnamed", "unpaired", "no-linear", "no-module", "untargeted", "rank", "dtype",
        "header", "diffusers-header", "both-headers", "half-prefixed"])
def test_each_way_a_lora_file_misses_its_target_is_named(header, metadata, targets, reasons):
    """What `cards validate` and a request that loads the file say of it (lora_reasons), one reason each."""
    from types import SimpleNamespace

    from cardtool.core.cards.adapters import lora_reasons

    adapter = SimpleNamespace(rank=4, alpha=4.0, targets=targets)
    assert lora_reasons(header, metadata, adapter, TARGET) == reasons
