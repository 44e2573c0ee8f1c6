"""The denoise loop: schedules, solvers, CFG, capture, and step-level batching equal to running alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cardtool.backends.platform import Platform
from cardtool.backends.torch_ops import flow_sde_step
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages, Request, shifted_sigmas
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.errors import BadInput

MIXED = [Request("an ankle boot", seed=1, steps=3, guidance=4.0),
         Request("a bag", seed=2, steps=5, guidance=1.0, solver="sde"),
         Request("a coat", seed=3, steps=4, guidance=2.0, shift=3.0, solver="sde"),
         Request("a coat", seed=4, steps=2, guidance=7.5, negative_prompt="a shirt"),
         Request("a shirt", seed=5, steps=4, guidance=3.0, guidance_interval=(0.0, 0.5)),  # σ 1, .75 unguided
         Request("a sneaker", seed=6, steps=3, guidance=1.0, solver="renoise"),
         Request("a dress", seed=7, steps=5, guidance=3.0, shift=2.0, solver="dpmpp_2m"),
         Request("a bag", seed=8, steps=4, guidance=1.0, solver="dpmpp_2m")]


@pytest.fixture(scope="module")
def loop():
    card = load_card("examples/cards/tiny-base")
    return DenoiseLoop(ModelInstance(card, Platform("cpu", "generic")), cache=TextFeatureCache(disk=False))


def final(states):
    return [s.latents.numpy() for s in states]


def test_shifted_sigmas_follow_sd3():
    np.testing.assert_allclose(shifted_sigmas(4, 1.0), [1, 0.75, 0.5, 0.25, 0])
    shifted = shifted_sigmas(4, 3.0)
    np.testing.assert_allclose(shifted[2], 3 * 0.5 / (1 + 2 * 0.5))
    assert shifted[0] == 1 and shifted[-1] == 0 and np.all(np.diff(shifted) < 0)


def test_a_mixed_batch_equals_each_request_alone(loop):
    batched = final(sample(loop, MIXED))
    for request, together in zip(MIXED, batched, strict=True):
        [alone] = final(sample(loop, [request]))
        assert np.abs(together - alone).max() <= 1e-5, request
    assert np.abs(batched[0]).max() > 0.1


def test_forwards_are_shared_and_capped_by_max_batch(loop, monkeypatch):
    sizes = []
    transformer = loop.instance.component("transformer")
    original = type(transformer).forward
    monkeypatch.setattr(type(transformer), "forward",
                        lambda self, x, *rest: sizes.append(x.shape[0]) or original(self, x, *rest))
    sample(loop, MIXED)
    assert sizes[0] == 2 + 1 + 2 + 2 + 1 + 1 + 2 + 1, "one forward for all eight requests, guided ones twice"
    assert sizes[2] == 2 + 1 + 2 + 2 + 1 + 2 + 1, "the third step: one request done, the interval one now guided"
    assert len(sizes) == 5, "as many forwards as the longest request has steps"
    sizes.clear()
    capped = final(sample(loop, MIXED, max_batch=2))
    assert max(sizes) <= 2
    assert all(np.abs(a - b).max() <= 1e-5 for a, b in zip(capped, final(sample(loop, MIXED)), strict=True))


def test_same_seed_same_image_other_seed_other_image(loop):
    a, b, c = final(sample(loop, [Request("a bag", seed=7, steps=3), Request("a bag", seed=7, steps=3),
                                  Request("a bag", seed=8, steps=3)]))
    assert np.abs(a - b).max() <= 1e-6 and np.abs(a - c).max() > 0.1


def test_capture_records_training_inputs_without_changing_samples(loop):
    plain = final(sample(loop, MIXED[:3]))
    captured = sample(loop, MIXED[:3], capture=True)
    for state, expected in zip(captured, plain, strict=True):
        assert np.abs(state.latents.numpy() - expected).max() <= 1e-6
        capture = state.capture
        assert len(capture.latents) == state.request.steps + 1 and len(capture.velocities) == state.request.steps
        assert torch.equal(capture.x0, state.latents)
        seed_noise = np.random.default_rng(state.request.seed).standard_normal((1, *loop.latent_shape()))
        np.testing.assert_allclose(capture.noise.numpy(), seed_noise, rtol=1e-6, atol=1e-6)  # the request's own
        assert (capture.log_probs[0] is None) == (state.request.solver == "euler")


def test_states_sharing_a_solver_call_capture_each_its_own_rows(loop):
    """Two renoise and two SDE requests of one η, each pair stepped in one kernel call: each state takes its own row
    of the sample, the log-probability and the velocity, as alone."""
    requests = [Request("a bag", seed=s, steps=3, guidance=g, solver=solver)
                for solver in ("renoise", "sde") for s, g in ((1, 1.0), (2, 3.0))]
    together = sample(loop, requests, capture=True)
    for state in together:
        [alone] = sample(loop, [state.request], capture=True)
        torch.testing.assert_close(state.latents, alone.latents, rtol=0, atol=1e-6)
        for field in ("latents", "velocities", "log_probs"):
            mine, theirs = getattr(state.capture, field), getattr(alone.capture, field)
            assert [None if x is None else tuple(x.shape) for x in mine] == \
                [None if x is None else tuple(x.shape) for x in theirs], field
            for x, y in zip(mine, theirs, strict=True):
                if x is not None:
                    torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


def test_captured_sde_log_probs_rescore_exactly(loop):
    [state] = sample(loop, [MIXED[1]], capture=True)
    c = state.capture
    for i in range(state.request.steps):
        logp = flow_sde_step(c.latents[i], c.velocities[i], c.sigmas[i], c.sigmas[i + 1],
                             prev_sample=c.latents[i + 1])[3]
        torch.testing.assert_close(logp, c.log_probs[i], rtol=1e-5, atol=1e-5)


def test_renoise_predicts_x0_and_renoises_with_the_requests_own_noise(loop):
    """DMD2's few-step rule by hand: x̂0 = x − σ·v, then (1 − σ')·x̂0 + σ'·ε with ε the request's next normal draws."""
    request = Request("a sneaker", seed=6, steps=3, guidance=1.0, solver="renoise")
    [state] = loop.init([request])
    rng = np.random.default_rng(request.seed)
    rng.standard_normal(state.latents.shape)  # the initial noise
    model = loop.instance.component("transformer")
    x = state.latents
    with torch.no_grad():
        for sigma, sigma_next in zip(state.sigmas[:-1], state.sigmas[1:], strict=True):
            x0 = x - sigma * model(x, torch.tensor([sigma * 1000.0]), *state.cond)
            x = (1 - sigma_next) * x0 + sigma_next * torch.as_tensor(rng.standard_normal(x.shape), dtype=x.dtype)
    [sampled] = final(sample(loop, [request]))
    assert np.abs(sampled - x.numpy()).max() <= 1e-5
    [euler] = final(sample(loop, [Request("a sneaker", seed=6, steps=3, guidance=1.0)]))
    assert np.abs(sampled - euler).max() > 1e-3, "a different rule from the ODE"


def test_guidance_one_needs_no_unconditional_pass(loop):
    [state] = loop.init([Request("a bag", guidance=1.0)])
    assert state.uncond is None and loop.next(state).x.shape[0] == 1


def test_guidance_interval_guides_only_the_steps_inside_it(loop):
    """Euler by hand: v_c alone where σ > 0.5, v_u + w·(v_c − v_u) where σ ≤ 0.5 (bounds inclusive)."""
    request = Request("an ankle boot", seed=3, steps=4, guidance=3.0, guidance_interval=(0.0, 0.5))
    [state] = loop.init([request])
    model = loop.instance.component("transformer")
    x = state.latents
    with torch.no_grad():
        for sigma, sigma_next in zip(state.sigmas[:-1], state.sigmas[1:], strict=True):
            t = torch.tensor([sigma * 1000.0])
            v = model(x, t, *state.cond)
            if sigma <= 0.5:
                v_u = model(x, t, *state.uncond)
                v = v_u + 3.0 * (v - v_u)
            x = x + (sigma_next - sigma) * v
    [sampled] = final(sample(loop, [request]))
    assert np.abs(sampled - x.numpy()).max() <= 1e-5
    everywhere, nowhere = final(sample(loop, [Request("an ankle boot", seed=3, steps=4, guidance=3.0),
                                              Request("an ankle boot", seed=3, steps=4, guidance=1.0)]))
    # both differ by far more than the 1e-5 the hand loop is held to
    assert np.abs(sampled - everywhere).max() > 1e-3 and np.abs(sampled - nowhere).max() > 1e-3
    [empty] = final(sample(loop, [Request("an ankle boot", seed=3, steps=4, guidance=3.0,
                                          guidance_interval=(0.1, 0.2))]))
    assert np.abs(empty - nowhere).max() <= 1e-6, "an interval holding no step's σ is unguided sampling"


def test_the_guidance_interval_holds_its_bounds_up_to_the_grids_rounding():
    request = Request("x", guidance_interval=(0.25, 0.5))
    assert [request.guides_at(s) for s in shifted_sigmas(4, 1.0)[:-1]] == [False, False, True, True]
    # what reports count as model evaluations per image: two rows on a guided step; a start from an image on the grid
    # point at its strength (σ 1, 0.75, 0.5, 0.25: strength 0.5 starts at the third step)
    assert Request("x", steps=4, guidance=3.0, guidance_interval=(0.25, 0.5)).model_evaluations() == 6
    assert Request("x", steps=4, guidance=1.0).model_evaluations() == 4
    assert Request("x", steps=4, guidance=3.0, strength=0.5).model_evaluations() == 4
    assert [Request("x", steps=4, strength=s).first_step(shifted_sigmas(4, 1.0)) for s in (1.0, 0.75, 0.6, 0.5, 0.01)] \
        == [0, 1, 2, 2, 3]
    assert request.guides_at(0.25 - 1e-12) and request.guides_at(0.5 + 1e-12), "bounds inclusive, rounding allowed"
    assert not request.guides_at(0.25 - 1e-6) and not request.guides_at(0.5 + 1e-6)


@pytest.mark.parametrize(("request_", "message"), [
    (Request("x", steps=0), "steps must be in 1…1000"),
    (Request("x", solver="heun"), "unknown solver 'heun'"),
    (Request("x", shift=0), "shift must be in 0.01…100, got 0"),
    (Request("x", shift=1e-300), "shift must be in 0.01…100"),
    (Request("x", guidance=1e308), "guidance must be in -100…100"),
    (Request("x", guidance=float("nan")), "guidance must be a finite number, got nan"),
    (Request("x", shift=float("inf")), "shift must be a finite number, got inf"),
    (Request("x", solver="sde", eta=float("nan")), "eta must be a finite number"),
    (Request("x", solver="sde", eta=-0.5), "eta .the SDE's noise level. must be in 0…10"),
    (Request("x", seed=-1), "seed must be in"),
    (Request("x", seed=2**63), "seed must be in"),
    (Request("x", strength=0.0), "strength must be in"),
    (Request("x", strength=1.5), "strength must be in"),
    (Request("x", adapters=(("a", float("nan")),)), "an adapter is NAME with a finite scale"),
    (Request("x", adapters=((1, 0.5),)), "an adapter is NAME with a finite scale"),
    (Request("x", adapters=(("a", "0.5"),)), "an adapter is NAME with a finite scale"),
    (Request("x", guidance_interval=(0.6, 0.2)), "0 ≤ LO ≤ HI ≤ 1"),
    (Request("x", guidance_interval=(0.0, 1.5)), "0 ≤ LO ≤ HI ≤ 1"),
    (Request("a \udcff shirt"), r"the prompt holds \\udcff, which is not a character"),  # bytes not UTF-8
    (Request("x", negative_prompt="\ud800"), "the negative prompt holds"),
    (Request("x" * 70_000), "the prompt is 70,000 characters; at most 65,536"),
    (Request(None), "the prompt must be text, got NoneType"),
])
def test_bad_requests_are_refused(loop, request_, message):
    with pytest.raises(BadInput, match=message):
        loop.init([request_])


def test_numpy_platform_runs_the_same_loop(loop):
    card = loop.instance.card
    torch64 = DenoiseLoop(ModelInstance(card, Platform("cpu", "generic"), "float64"), cache=loop.cache)
    numpy64 = DenoiseLoop(ModelInstance(card, Platform("numpy", "generic"), "float64"), cache=loop.cache)
    expected = final(sample(torch64, MIXED))
    for actual, wanted in zip(sample(numpy64, MIXED), expected, strict=True):
        assert np.abs(actual.latents - wanted).max() <= 1e-12


def test_text_keys_and_values_are_computed_once_per_run_and_change_nothing(loop, monkeypatch):
    dit = loop.instance.component("transformer")
    requests = [Request("a bag", seed=s, steps=4, guidance=3.0) for s in range(3)]
    with torch.inference_mode():
        expected = []
        for state in loop.init(requests):  # the plain forward, text projected on every call
            while (inputs := loop.next(state)) is not None:
                assert inputs.t.tolist() == [state.sigmas[state.step] * 1000.0] * 2, "σ·1000, on both CFG rows"
                loop.advance([state], dit(inputs.x, inputs.t, inputs.text, inputs.mask))
            expected.append(state.latents.numpy())
    [unguided] = loop.init([Request("a bag", steps=4, guidance=1.0)])
    assert loop.next(unguided).t.tolist() == [1000.0] and len(loop.next(unguided).x) == 1, "one row without CFG"
    calls = []
    monkeypatch.setattr(dit, "text_context", lambda text: calls.append(text.shape) or type(dit).text_context(dit, text))
    actual = final(sample(loop, requests))
    assert calls == [(2, 16, 384)], "one projection of the batch's two texts (prompt, negative), reused on all steps"
    np.testing.assert_allclose(np.concatenate(actual), np.concatenate(expected), atol=1e-6)
    calls.clear()
    mixed = [Request(p, seed=1, steps=2, guidance=g) for p, g in (("a bag", 3.0), ("a coat", 1.0), ("a bag", 1.0))]
    together = final(sample(loop, mixed))
    assert calls == [(3, 16, 384)], "'a bag', its negative, 'a coat': each projected once for the four rows"
    for request, image in zip(mixed, together, strict=True):  # the copied rows are the rows computed alone
        np.testing.assert_allclose(image, final(sample(loop, [request]))[0], atol=1e-6)
    with torch.enable_grad():
        calls.clear()
        sample(loop, requests[:2], grad=True)
    assert calls == [(4, 16, 384)], "with autograd on, each row its own: a gradient is not summed over copies"

    class Projected:  # another transformer's context, which cannot pick rows: the batch's rows projected each
        def __init__(self, context):
            self.context, self.keys_values = context

    calls.clear()
    monkeypatch.setattr(dit, "text_context", lambda text: calls.append(len(text)) or Projected(
        type(dit).text_context(dit, text)))
    np.testing.assert_allclose(np.concatenate(final(sample(loop, requests))), np.concatenate(expected), atol=1e-6)
    assert calls == [2, 6]


def test_a_request_with_strength_starts_from_its_source_re_noised_on_the_grid(loop):
    request = Request("a bag", seed=9, steps=10, guidance=1.0, strength=0.35)
    sigmas = shifted_sigmas(10, 1.0)
    assert request.first_step(sigmas) == 7 and sigmas[7] == pytest.approx(0.3)  # the first σ ≤ 0.35
    assert request.model_evaluations() == 3 and Request("x", steps=10, guidance=1.0).model_evaluations() == 10
    assert Request("x", steps=4, strength=1e-6).first_step(shifted_sigmas(4, 1.0)) == 3  # always one step
    source = torch.full((1, *loop.latent_shape()), 0.5)
    (state,) = loop.init([request], sources=[source])
    noise = np.random.default_rng(9).standard_normal((1, *loop.latent_shape()))
    np.testing.assert_allclose(state.latents.numpy(), 0.7 * 0.5 + 0.3 * noise, rtol=1e-6, atol=1e-6)
    assert state.step == 7
    (done,) = sample(loop, [request], sources=[source])
    assert done.step == 10 and done.done
    with pytest.raises(BadInput, match="starts from an image"):
        loop.init([request])
    with pytest.raises(BadInput, match="strength must be in"):
        loop.init([Request("x", strength=0.0)], sources=[source])
    with pytest.raises(BadInput, match="2 source latents and 1 masks for 1 requests"):
        loop.init([request], sources=[source, source], keeps=[None])
    with pytest.raises(BadInput, match="a mask keeps part of an image: the request needs the image too"):
        loop.init([Request("x")], keeps=[loop.latent_mask(np.zeros((28, 28), np.uint8))])


def test_a_loop_the_card_does_not_have_is_refused_by_name(loop):
    with pytest.raises(BadInput, match="card 'tiny-base' has no loop 'upscale'"):
        DenoiseLoop(loop.instance, "upscale")


def test_non_finite_images_are_named_three_at_most_with_how_many_more():
    requests = [Request("a very long prompt about a garment " * 3, seed=s) for s in range(5)]
    message = str(NonFiniteImages("c", requests, 8, written=3, precision="float32"))
    shown = repr(requests[0].prompt[:40])
    assert message == (f"'c' made NaN or inf for 5 of 8 images ({shown} seed 0, {shown} seed 1, {shown} seed 2 and 2 "
                       "more); the other 3 are written: check its weights or the settings (guidance, shift)")
    assert " more" not in str(NonFiniteImages("c", requests[:3], 3))


def test_decoding_maps_the_vaes_minus_one_to_one_onto_0_to_255_and_encoding_back(loop, monkeypatch):
    """uint8 = round((y + 1)·127.5), clipped; a NaN or inf image is black and flagged, and `finalize` names exactly
    the requests whose images those are. Encoding reads pixels as p / 127.5 − 1, times the VAE's scaling factor."""
    vae = loop.instance.component(loop.vae)
    values = torch.tensor([-1.0, 0.0, 1.0, 0.5, -2.0, 2.0], dtype=torch.float64)
    decoded = torch.zeros((3, 1, 28, 28), dtype=torch.float64)
    decoded[0, 0, 0, :6] = values
    decoded[1, 0, 5, 5] = float("nan")
    decoded[2, 0, 0, 0] = float("inf")
    monkeypatch.setattr(vae, "decode", lambda latents: decoded[:len(latents)].to(latents.dtype))
    states = loop.init([Request(f"image {i}", seed=i) for i in range(3)])
    images, finite = loop.decode(states)
    assert images.dtype == np.uint8 and images[0, 0, :6].tolist() == [0, 128, 255, 191, 0, 255]
    assert finite.tolist() == [True, False, False] and images[1:].max() == 0, "broken images black"
    with pytest.raises(NonFiniteImages) as caught:
        loop.finalize(states)
    assert caught.value.images == [("image 1", 1), ("image 2", 2)], "exactly the broken images named"
    monkeypatch.setattr(vae, "encode", lambda x: (x, None))
    pixels = np.zeros((1, 28, 28), np.uint8)
    pixels[0, 0, :3] = [0, 255, 51]
    [latent] = loop.encode(pixels)
    assert loop.encode(np.zeros((0, 28, 28), np.uint8)) == [], "no images, no latents"
    with pytest.raises(BadInput, match="card 'tiny-base' takes 28×28 images, got 24×20"):
        loop.encode(np.zeros((1, 20, 24), np.uint8))
    scale = vae.config.scaling_factor
    np.testing.assert_allclose(np.asarray(latent)[0, 0, 0, 0, :3], np.array([-1.0, 1.0, -0.6]) * scale, rtol=1e-6)
