"""The `dpmpp_2m` solver: DPM-Solver++(2M) on the flow ODE, against an exact answer and against diffusers' scheduler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache

torch.set_num_threads(1)

MU, STD = 0.7, 0.5  # the data: every latent element N(μ, s²)


@pytest.fixture(scope="module")
def loop():
    card = load_card("examples/cards/tiny-base")
    return DenoiseLoop(ModelInstance(card, Platform("cpu", "generic"), "float64"), cache=TextFeatureCache(disk=False))


def exact_velocity(x, sigma):
    """The flow's velocity for Gaussian data: (x − E[x0 | x_σ]) / σ, the posterior mean linear in x_σ."""
    a = 1 - sigma
    x0 = MU + a * STD**2 / (a**2 * STD**2 + sigma**2) * (x - a * MU)
    return (x - x0) / sigma


def solve(loop, solver: str, steps: int, shift: float = 1.0):
    """(the loop's x0 under the exact velocity, the starting noise, the state)."""
    [state] = loop.init([Request("a bag", seed=0, steps=steps, guidance=1.0, solver=solver, shift=shift)])
    noise = state.latents.clone()
    while not state.done:
        loop.advance([state], exact_velocity(state.latents, state.sigmas[state.step]))
    return state.latents, noise, state


def test_dpm_solver_is_far_more_accurate_than_euler_at_equal_steps(loop):
    """The ODE from ε ends at μ + s·ε (the flow maps N(0, 1) onto N(μ, s²) monotonically)."""
    errors = {}
    for solver in ("euler", "dpmpp_2m"):
        for steps in (16, 32, 64):
            x0, noise, _ = solve(loop, solver, steps)
            errors[solver, steps] = float((x0 - (MU + STD * noise)).abs().max())
    for steps in (32, 64):
        assert errors["euler", steps - steps // 2] / errors["euler", steps] == pytest.approx(2, rel=0.1), \
            "Euler is first order"
        assert errors["dpmpp_2m", steps] < errors["euler", steps] / 5
    assert errors["dpmpp_2m", 32] / errors["dpmpp_2m", 64] > 2.5, "second order, short of 4 at the σ = 1 and 0 ends"


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # inside diffusers' scheduler
def test_dpm_solver_matches_diffusers_dpm_solver_multistep_step_for_step(loop):
    from diffusers import DPMSolverMultistepScheduler

    for steps, shift in ((6, 1.0), (10, 3.0)):
        ours, noise, state = solve(loop, "dpmpp_2m", steps, shift)
        scheduler = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                flow_shift=shift, algorithm_type="dpmsolver++", solver_order=2,
                                                final_sigmas_type="zero")
        scheduler.set_timesteps(steps)
        scheduler.sigmas = torch.tensor(state.sigmas)  # our grid: diffusers' starts at σ = 1 − 1/1000
        x = noise
        for i, t in enumerate(scheduler.timesteps):
            x = scheduler.step(exact_velocity(x, state.sigmas[i]), t, x).prev_sample
        assert float((x - ours).abs().max()) <= 1e-6  # diffusers rounds through float32


def test_the_first_two_steps_and_the_last_are_euler_steps(loop):
    """No previous estimate, then one from σ = 1 (log-SNR −∞), then the step to σ = 0: first order, as diffusers."""
    for steps in (1, 2, 3):
        dpm, noise, _ = solve(loop, "dpmpp_2m", steps)
        euler, _, _ = solve(loop, "euler", steps)
        np.testing.assert_allclose(dpm.numpy(), euler.numpy(), atol=1e-12)
    dpm, _, _ = solve(loop, "dpmpp_2m", 4)
    euler, _, _ = solve(loop, "euler", 4)
    assert float((dpm - euler).abs().max()) > 1e-3, "the third of four steps is second order"


def test_the_second_order_weight_is_zero_where_there_is_no_earlier_step_to_lean_on():
    """c = h / (2·h_prev) on log-SNR steps; 0 without an earlier estimate, after σ = 1, on the step to σ = 0, and where
    the earlier step rounded to nothing (h_prev = 0 would divide by zero)."""
    import math

    from cardtool.core.sampling.denoise import _dpm_c

    lam = [math.log((1 - s) / s) for s in (0.75, 0.5, 0.25)]
    assert _dpm_c((0.75, None), 0.5, 0.25) == pytest.approx((lam[2] - lam[1]) / (2 * (lam[1] - lam[0])))
    assert _dpm_c(None, 0.5, 0.25) == 0.0 and _dpm_c((1.0, None), 0.5, 0.25) == 0.0
    assert _dpm_c((0.75, None), 0.5, 0.0) == 0.0 and _dpm_c((0.5, None), 0.5, 0.25) == 0.0
