"""A whole generation in diffusers and in cardtool: the same text states, σ grid, CFG, Euler steps and weights give
the same latents (Wan2.1 semantics: zero-padded text states, attended to in full)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request, shifted_sigmas
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache

diffusers = pytest.importorskip("diffusers")


def test_a_cfg_euler_generation_matches_diffusers_scheduler_and_transformer(examples):
    card = load_card(examples / "tiny-base")
    loop = DenoiseLoop(ModelInstance(card, Platform("cpu", "generic"), "float32"), cache=TextFeatureCache(disk=False))
    request = Request("an ankle boot", seed=3, steps=6, guidance=4.0, shift=3.0)  # CFG on every step
    [state] = sample(loop, [request], capture=True)

    config = WanDiTConfig.from_card(card.manifest.components["transformer"].config, "wan-dit")
    theirs = diffusers.WanTransformer3DModel(**config.to_diffusers()).eval()
    theirs.load_state_dict({k: v.float() for k, v in load_file(str(card.weights_file("transformer"))).items()},
                           strict=True)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=request.shift)
    scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 0.0, request.steps + 1)[:-1]))
    np.testing.assert_allclose(scheduler.sigmas.numpy(), shifted_sigmas(request.steps, request.shift), atol=1e-6)

    text = torch.cat([state.cond[0], state.uncond[0]])  # zero beyond each prompt, as Wan2.1 pads
    x = state.capture.noise.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            v_cond, v_uncond = theirs(torch.cat([x, x]), t.expand(2), text, return_dict=False)[0].chunk(2)
            x = scheduler.step(v_uncond + request.guidance * (v_cond - v_uncond), t, x, return_dict=False)[0]
    assert (state.latents - state.capture.noise).abs().max() > 0.2, "the model moved the latents (0.41 measured)"
    assert (x - state.latents).abs().max().item() <= 1e-4
