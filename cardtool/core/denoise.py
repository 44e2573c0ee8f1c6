"""The denoise loop — the one sampler of the project (DESIGN.md invariant 2): `generate` runs it, and so
will distillation and RL rollouts, with capture switched on.

A driven loop: `init` makes a request's state (its seed's noise, its shifted σ grid, its text features);
`next` says what the model must evaluate for it; `step` evaluates many states' inputs in one forward;
`advance` applies CFG and the solver (`euler`, the flow ODE; `sde`, Flow-GRPO's SDE with per-step
log-probabilities); `finalize` decodes. Everything per request lives in its LoopState: its own numpy RNG
(so samples do not depend on batch composition or platform), σ grid, guidance and captured tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cardtool.backends.registry import KERNELS
from cardtool.core.instance import ModelInstance
from cardtool.core.text_cache import TextFeatureCache, encode_prompts
from cardtool.errors import BadInput

__all__ = ["SOLVERS", "Request", "Capture", "LoopState", "DenoiseLoop", "shifted_sigmas"]

SOLVERS = ("euler", "sde")


def shifted_sigmas(steps: int, shift: float) -> np.ndarray:
    """σ grid from 1 to 0 in `steps` steps, shifted t' = s·t / (1 + (s − 1)·t) as in SD3 / Wan2.1."""
    t = np.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


@dataclass(frozen=True)
class Request:
    """One image to make: everything that decides it, and nothing shared with other requests."""

    prompt: str
    seed: int = 0
    steps: int = 30
    guidance: float = 4.0
    shift: float = 1.0
    solver: str = "euler"
    negative_prompt: str = ""  # the empty prompt is the null condition
    eta: float = 0.7  # the SDE's noise level (Flow-GRPO's a)

    def check(self) -> None:
        if self.steps < 1:
            raise BadInput(f"steps must be at least 1, got {self.steps}")
        if self.solver not in SOLVERS:
            raise BadInput(f"unknown solver '{self.solver}'; choose one of: {', '.join(SOLVERS)}")
        if self.shift <= 0:
            raise BadInput(f"shift must be positive, got {self.shift}")
        if not 0 <= self.seed < 2**63:
            raise BadInput(f"seed must be in [0, 2⁶³), got {self.seed}")


@dataclass
class Capture:
    """What training needs from a rollout: x before each step and after the last, the guided velocity
    of each step, and (sde) each step's log-probability. Recording changes nothing in the sample."""

    sigmas: np.ndarray
    latents: list = field(default_factory=list)  # steps + 1 entries, the first is the initial noise
    velocities: list = field(default_factory=list)
    log_probs: list = field(default_factory=list)

    @property
    def noise(self):
        return self.latents[0]

    @property
    def x0(self):
        return self.latents[-1]


@dataclass
class LoopState:
    request: Request
    sigmas: np.ndarray
    rng: np.random.Generator
    latents: object  # (1, C, F, H, W) in the loop's array namespace
    cond: tuple  # (text states (1, L, d), mask (1, L))
    uncond: tuple | None  # the negative prompt's, when guidance ≠ 1
    step: int = 0
    capture: Capture | None = None

    @property
    def done(self) -> bool:
        return self.step >= self.request.steps


@dataclass
class StepInput:
    x: object  # (k, C, F, H, W): k = 2 with CFG (conditional first), else 1
    t: object  # (k,) timesteps σ·1000
    text: object
    mask: object


class DenoiseLoop:
    """The `denoise` loop of a card on its instance's platform."""

    def __init__(self, instance: ModelInstance, loop: str = "denoise", cache: TextFeatureCache | None = None):
        spec = instance.card.manifest.loops.get(loop)
        if spec is None:
            raise BadInput(f"card '{instance.card.id}' has no loop '{loop}'")
        self.instance, self.cache = instance, cache or TextFeatureCache(disk=False)
        kinds = {instance.card.manifest.components[name].kind: name for name in spec.uses}
        missing = {"text_encoder", "vae", "dit"} - set(kinds)
        if missing:
            raise BadInput(f"loop '{loop}' of card '{instance.card.id}' uses no {', '.join(sorted(missing))} component")
        self.text_encoder, self.vae, self.transformer = kinds["text_encoder"], kinds["vae"], kinds["dit"]
        self.arrays = instance.arrays
        platform = instance.platform
        self.euler = KERNELS.resolve("flow_match_step", platform)[1]
        self.sde = KERNELS.resolve("flow_sde_step", platform)[1]
        self.cfg = KERNELS.resolve("cfg_combine", platform)[1]

    def latent_shape(self) -> tuple[int, ...]:
        config = self.instance.component(self.vae).config
        return (config.latent_channels, 1, config.latent_size, config.latent_size)

    def init(self, requests: list[Request], capture: bool = False) -> list[LoopState]:
        """States for `requests`, their prompts encoded in one batch (or read from the cache)."""
        for request in requests:
            request.check()
        prompts = [r.prompt for r in requests] + [r.negative_prompt for r in requests if r.guidance != 1]
        features = iter(encode_prompts(self.instance, prompts, self.cache, self.text_encoder))
        conds = [next(features) for _ in requests]
        shape, states = self.latent_shape(), []
        for request, cond in zip(requests, conds, strict=True):
            uncond = next(features) if request.guidance != 1 else None
            rng = np.random.default_rng(request.seed)
            latents = self.arrays.asarray(rng.standard_normal((1, *shape)))
            sigmas = shifted_sigmas(request.steps, request.shift)
            state = LoopState(request, sigmas, rng, latents, self._text(cond),
                              self._text(uncond) if uncond is not None else None,
                              capture=Capture(sigmas) if capture else None)
            if state.capture is not None:
                state.capture.latents.append(latents)
            states.append(state)
        return states

    def _text(self, feature):
        states, mask = feature
        return self.arrays.asarray(states[None]), self.arrays.asarray(mask[None])

    def next(self, state: LoopState) -> StepInput | None:
        """The model evaluation `state` needs for its next step; None once it is done."""
        if state.done:
            return None
        t = self.arrays.asarray(np.full(2 if state.uncond else 1, state.sigmas[state.step] * 1000.0))
        if state.uncond is None:
            return StepInput(state.latents, t, *state.cond)
        a = self.arrays
        return StepInput(a.cat([state.latents, state.latents]), t, a.cat([state.cond[0], state.uncond[0]]),
                         a.cat([state.cond[1], state.uncond[1]]))

    def advance(self, state: LoopState, velocity) -> None:
        """Combine the conditional and unconditional velocities and take one solver step."""
        request, i = state.request, state.step
        v = velocity[:1] if state.uncond is None else self.cfg(velocity[1:2], velocity[:1], request.guidance)
        sigma, sigma_next = float(state.sigmas[i]), float(state.sigmas[i + 1])
        log_prob = None
        if request.solver == "euler":
            state.latents = self.euler(state.latents, v, sigma, sigma_next)
        else:
            noise = self.arrays.asarray(state.rng.standard_normal(tuple(state.latents.shape)))
            state.latents, _, _, log_prob = self.sde(state.latents, v, sigma, sigma_next, noise=noise, eta=request.eta)
        state.step += 1
        if state.capture is not None:
            state.capture.latents.append(state.latents)
            state.capture.velocities.append(v)
            state.capture.log_probs.append(log_prob)

    def step(self, states: list[LoopState]) -> None:
        """Advance every unfinished state by one step, sharing one transformer forward between them."""
        work = [(s, inputs) for s in states if (inputs := self.next(s)) is not None]
        if not work:
            return
        a = self.arrays
        batch = [inputs for _, inputs in work]
        velocity = self.instance.component(self.transformer)(
            a.cat([b.x for b in batch]), a.cat([b.t for b in batch]), a.cat([b.text for b in batch]),
            a.cat([b.mask for b in batch]))
        start = 0
        for state, inputs in work:
            size = int(inputs.x.shape[0])
            self.advance(state, velocity[start:start + size])
            start += size

    def finalize(self, states: list[LoopState]) -> np.ndarray:
        """Decode finished states to uint8 images (B, H, W)."""
        vae = self.instance.component(self.vae)
        latents = self.arrays.cat([s.latents for s in states])[:, :, 0] / vae.config.scaling_factor
        images = self.arrays.to_numpy(vae.decode(latents))[:, 0]
        return np.clip(np.round((images.astype(np.float64) + 1) * 127.5), 0, 255).astype(np.uint8)
