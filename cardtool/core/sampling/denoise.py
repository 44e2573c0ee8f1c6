"""The denoise loop — the one sampler of the project (DESIGN.md invariant 2): `generate` runs it, and so
will distillation and RL rollouts, with capture switched on.

A driven loop: `init` makes a request's state (its seed's noise, its shifted σ grid, its text features);
`next` says what the model must evaluate for it; `step` evaluates many states' inputs in one forward;
`advance` applies CFG and the solver to a batch of states (`euler`, the flow ODE; `dpmpp_2m`, the same ODE by
DPM-Solver++(2M), second order at one evaluation a step; `sde`, Flow-GRPO's SDE with per-step log-probabilities;
`renoise`, DMD2's few-step rule: predict x̂0, re-noise it to the next σ with fresh noise); `finalize` decodes.
Everything per request lives in its LoopState: its own numpy RNG (so samples do not depend on batch composition or
platform), σ grid, guidance, the solver's memory and captured tensors.

CFG applies on the steps whose σ lies in the request's `guidance_interval` (Kynkäänniemi et al. 2024,
"Applying Guidance in a Limited Interval Improves Sample and Distribution Quality in Diffusion Models"):
guidance at high noise mostly collapses diversity, so a card may guide only the later steps; an unguided
step evaluates the conditional branch alone (one row, not two).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import numpy as np

from cardtool.backends.registry import KERNELS
from cardtool.core.cards.loops import MAX_ETA, MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_STEPS, SHIFTS, SOLVERS
from cardtool.core.sampling.control import ControlImage
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache, encode_prompts
from cardtool.errors import BadInput, RunFailed

__all__ = ["SOLVERS", "Request", "Capture", "LoopState", "DenoiseLoop", "NonFiniteImages", "shifted_sigmas"]

# images a VAE call decodes or encodes while sampling (DenoiseLoop._grouped): groups of VAE_GROUP where a trial shows
# they give an image the bits groups of SMALL_GROUP do, the rest in groups of SMALL_GROUP
SMALL_GROUP, VAE_GROUP = 4, 16
_groups_agree: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per VAE module: {"decode": bool, …}


class NonFiniteImages(RunFailed):
    """The model made NaN or inf where an image should be: no such image is written (`written`: how many of the
    others were, where a command writes the finite ones)."""

    def __init__(self, card: str, requests: list, total: int, written: int | None = None,
                 partial: dict | None = None, precision: str | None = None):
        self.images = [(r.prompt, r.seed) for r in requests]  # (prompt, seed) of each broken image
        shown = ", ".join(f"{p[:40]!r} seed {s}" for p, s in self.images[:3])
        more = f" and {len(requests) - 3} more" if len(requests) > 3 else ""
        stack = {a for r in requests for a in r.adapters}
        cause = "its weights, the adapters' (" + ", ".join(f"{n}={v:g}" for n, v in sorted(stack)) + ")" if stack \
            else "its weights"
        kept = f"; the other {written} are written" if written else ""
        # at float32 or wider, overflow is the weights' or the settings' doing: a narrower precision is no cure
        overflow = "" if precision in ("float32", "float64") else \
            ", or a precision that overflows (try --precision float32)"
        super().__init__(f"'{card}' made NaN or inf for {len(requests)} of {total} images ({shown}{more}){kept}: check "
                         f"{cause}{',' if overflow else ' or'} the settings (guidance, shift){overflow}", partial)


def shifted_sigmas(steps: int, shift: float) -> np.ndarray:
    """σ grid from 1 to 0 in `steps` steps, shifted t' = s·t / (1 + (s − 1)·t) as in SD3 / Wan2.1."""
    t = np.linspace(1.0, 0.0, steps + 1)
    return shift * t / (1 + (shift - 1) * t)


def _dpm_c(previous: tuple | None, sigma: float, sigma_next: float) -> float:
    """DPM-Solver++(2M)'s c = h / (2·h_prev) over the log-SNR λ = log((1 − σ)/σ): 0 — the first-order step — with
    no previous estimate, after the step from σ = 1 (λ = −∞) and on the last step to σ = 0 (as k-diffusion's
    sample_dpmpp_2m and diffusers' DPMSolverMultistepScheduler do)."""
    if previous is None or previous[0] >= 1 or sigma_next <= 0:
        return 0.0
    lam_prev, lam, lam_next = (math.log((1 - s) / s) for s in (previous[0], sigma, sigma_next))
    return (lam_next - lam) / (2 * (lam - lam_prev)) if lam > lam_prev else 0.0  # a grid step rounded to nothing


def _check_text(name: str, text) -> None:
    """A prompt is text the encoder and the PNG metadata can hold: a str, valid UTF-8, of bounded length."""
    if not isinstance(text, str):
        raise BadInput(f"the {name} must be text, got {type(text).__name__}")
    if len(text) > MAX_PROMPT_CHARS:
        raise BadInput(f"the {name} is {len(text):,} characters; at most {MAX_PROMPT_CHARS:,}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(f"the {name} holds {text[e.start:e.end].encode('utf-8', 'backslashreplace').decode()}, "
                       "which is not a character (a lone surrogate: the input was not valid UTF-8)") from None


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
    guidance_interval: tuple[float, float] = (0.0, 1.0)  # the σ range (inclusive) of the steps CFG applies to
    strength: float = 1.0  # < 1: start from a given image re-noised to this σ, skipping the grid's noisier steps
    adapters: tuple[tuple[str, float], ...] = ()  # the card's adapters this request uses, with their scales
    control: ControlImage | None = None  # the control image of the ControlNet in `adapters`

    def check(self) -> None:
        for name in ("prompt", "negative_prompt"):
            _check_text(name.replace("_", " "), getattr(self, name))
        if not 1 <= self.steps <= MAX_STEPS:
            raise BadInput(f"steps must be in 1…{MAX_STEPS}, got {self.steps}")
        for name in ("guidance", "shift", "eta"):
            if not math.isfinite(getattr(self, name)):
                raise BadInput(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.solver not in SOLVERS:
            raise BadInput(f"unknown solver '{self.solver}'; choose one of: {', '.join(SOLVERS)}")
        if not abs(self.guidance) <= MAX_GUIDANCE:
            raise BadInput(f"guidance must be in -{MAX_GUIDANCE}…{MAX_GUIDANCE}, got {self.guidance:g}")
        if not SHIFTS[0] <= self.shift <= SHIFTS[1]:
            raise BadInput(f"shift must be in {SHIFTS[0]:g}…{SHIFTS[1]:g}, got {self.shift:g}")
        if not 0 <= self.eta <= MAX_ETA:
            raise BadInput(f"eta (the SDE's noise level) must be in 0…{MAX_ETA}, got {self.eta:g}")
        if not 0 <= self.seed < 2**63:
            raise BadInput(f"seed must be in [0, 2⁶³), got {self.seed}")
        if not 0 < self.strength <= 1:
            raise BadInput(f"strength must be in (0, 1] (the σ an input image is re-noised to), got {self.strength}")
        for name, scale in self.adapters:
            if not isinstance(name, str) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
                raise BadInput(f"an adapter is NAME with a finite scale, got {name!r}={scale!r}")
        low, high = self.guidance_interval
        if not 0 <= low <= high <= 1:
            raise BadInput(f"guidance interval must be LO,HI with 0 ≤ LO ≤ HI ≤ 1 (a σ range), got {low:g},{high:g}")

    def model_evaluations(self) -> int:
        """Transformer evaluations this request costs: two on each guided step, one on the others."""
        guided = self.guidance != 1
        sigmas = shifted_sigmas(self.steps, self.shift)
        return sum(2 if guided and self.guides_at(sigma) else 1 for sigma in sigmas[self.first_step(sigmas):-1])

    def first_step(self, sigmas: np.ndarray) -> int:
        """The grid step a request starts at: 0 from noise, else the first whose σ is at most `strength` (and
        never past the last step, so an image is always denoised at least once)."""
        if self.strength >= 1:
            return 0
        return min(int(np.argmax(sigmas <= self.strength + 1e-9)), self.steps - 1)

    def guides_at(self, sigma: float) -> bool:
        """Whether σ (a step's starting σ) is in the guidance interval, bounds inclusive up to the grid's rounding."""
        low, high = self.guidance_interval
        return low - 1e-9 <= sigma <= high + 1e-9


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


@dataclass(eq=False)  # identity: a state is one request's run, never equal to another
class LoopState:
    request: Request
    sigmas: np.ndarray
    rng: np.random.Generator
    latents: object  # (1, C, F, H, W) in the loop's array namespace
    cond: tuple  # (text states (1, L, d), mask (1, L))
    uncond: tuple | None  # the negative prompt's, when guidance ≠ 1
    step: int = 0
    capture: Capture | None = None
    adapters: tuple = ()  # the AdapterUses the request started with (its versions until it finishes)
    control: object = None  # the control image's latent (1, C, F, H, W), when a ControlNet conditions it
    keep: tuple | None = None  # inpainting: (mask (1, 1, 1, H, W), 1 where kept; the image's latent; starting noise)
    previous: tuple | None = None  # dpmpp_2m: (σ of the step before, its clean estimate x̂0)

    @property
    def done(self) -> bool:
        return self.step >= self.request.steps

    @property
    def guided(self) -> bool:
        """Whether this step uses CFG (two model rows) or the conditional branch alone."""
        return self.uncond is not None and not self.done and self.request.guides_at(self.sigmas[self.step])


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
        self.renoise = KERNELS.resolve("flow_renoise_step", platform)[1]
        self.dpm = KERNELS.resolve("flow_dpm_step", platform)[1]
        self.cfg = KERNELS.resolve("cfg_combine", platform)[1]
        self._text_rows = None
        self.fused = None  # the LoRA stack merged into the base weights (see `fused`), whose rows add nothing

    def latent_shape(self) -> tuple[int, ...]:
        config = self.instance.component(self.vae).config
        return (config.latent_channels, 1, config.latent_size, config.latent_size)

    def init(self, requests: list[Request], capture: bool = False, sources: list | None = None,
             keeps: list | None = None) -> list[LoopState]:
        """States for `requests`, their prompts encoded in one batch (or read from the cache). A request with
        strength < 1 starts from its source latent (see `encode`) re-noised with its own seed's noise to the first
        grid σ at or below the strength: x = (1 − σ)·x0 + σ·ε, the flow's forward process (SDEdit, Meng et al.
        2022, in the rectified-flow form). A request with a keep mask (`latent_mask`; inpainting) has its kept
        cells set back to (1 − σ)·x0 + σ·ε after every step (`advance`), at any strength up to 1."""
        for request in requests:
            request.check()
        sources = sources if sources is not None else [None] * len(requests)
        keeps = keeps if keeps is not None else [None] * len(requests)
        if not len(sources) == len(keeps) == len(requests):
            raise BadInput(f"{len(sources)} source latents and {len(keeps)} masks for {len(requests)} requests")
        for request, source, keep in zip(requests, sources, keeps, strict=True):
            if keep is not None and source is None:
                raise BadInput("a mask keeps part of an image: the request needs the image too")
            if keep is None and (request.strength < 1) != (source is not None):
                raise BadInput("a request starts from an image exactly when its strength is below 1")
        stacks = [self._stack(r) for r in requests]
        controls = self._control_latents(requests)
        prompts = [r.prompt for r in requests] + [r.negative_prompt for r in requests if r.guidance != 1]
        features = iter(encode_prompts(self.instance, prompts, self.cache, self.text_encoder))
        conds = [next(features) for _ in requests]
        texts = {}  # a prompt's features are one object (the cache's): its rows one pair of arrays, however many ask

        def text(feature):
            if id(feature) not in texts:
                texts[id(feature)] = self._text(feature)
            return texts[id(feature)]

        shape, states = self.latent_shape(), []
        for request, cond, source, keep, stack in zip(requests, conds, sources, keeps, stacks, strict=True):
            uncond = next(features) if request.guidance != 1 else None
            rng = np.random.default_rng(request.seed)
            noise = latents = self.arrays.asarray(rng.standard_normal((1, *shape)))
            sigmas = shifted_sigmas(request.steps, request.shift)
            start = request.first_step(sigmas)
            if source is not None and request.strength < 1:
                latents = (1 - sigmas[start]) * source + sigmas[start] * latents
            state = LoopState(request, sigmas, rng, latents, text(cond), text(uncond) if uncond is not None else None,
                              step=start, capture=Capture(sigmas) if capture else None, adapters=stack,
                              control=controls.get(request.control.digest) if request.control else None,
                              keep=(keep, source, noise) if keep is not None else None)
            if state.capture is not None:
                state.capture.latents.append(latents)
            states.append(state)
        return states

    def _stack(self, request: Request) -> tuple:
        """The request's adapters as loaded versions (a scale of 0 drops one), checked against its control image."""
        stack = self.instance.adapters.resolve(request.adapters) if request.adapters else ()
        declared = self.instance.card.manifest.adapters
        nets = [name for name, _ in request.adapters if declared[name].kind == "controlnet"]
        if nets and request.control is None:
            raise BadInput(f"ControlNet '{nets[0]}' needs a control image (--control IMAGE)")
        if request.control is not None and not nets:
            raise BadInput("a control image needs a ControlNet in the request's adapters (--adapter NAME); card "
                           f"'{self.instance.card.id}' declares: {self.instance.adapters.declared()}")
        return stack

    def _control_latents(self, requests: list[Request]) -> dict:
        """The VAE latent of each distinct control image, by digest."""
        images = {r.control.digest: r.control.image for r in requests if r.control is not None}
        if not images:
            return {}
        size = self.instance.component(self.vae).config.image_size
        for image in images.values():
            if image.shape != (size, size):
                raise BadInput(f"a control image for this card is {size}×{size}, got {image.shape[1]}×{image.shape[0]}")
        latents = self.encode(np.stack(list(images.values())))
        return dict(zip(images, latents, strict=True))

    def _text(self, feature):
        states, mask = feature
        return self.arrays.asarray(states[None]), self.arrays.asarray(mask[None])

    def next(self, state: LoopState) -> StepInput | None:
        """The model evaluation `state` needs for its next step; None once it is done."""
        if state.done:
            return None
        t = self.arrays.asarray(np.full(2 if state.guided else 1, state.sigmas[state.step] * 1000.0))
        if not state.guided:
            return StepInput(state.latents, t, *state.cond)
        a = self.arrays
        return StepInput(a.cat([state.latents, state.latents]), t, a.cat([state.cond[0], state.uncond[0]]),
                         a.cat([state.cond[1], state.uncond[1]]))

    def advance(self, states: list[LoopState], velocity) -> None:
        """One solver step for each state, given the model's velocity rows in `next` order (each state's
        conditional row, then its unconditional row when it uses CFG). CFG and the solvers are element-wise
        kernels with per-sample σ and guidance, so a batch of states advances in a few calls."""
        a = self.arrays
        guided = [state.guided for state in states]
        scales = [state.request.guidance if g else 1.0 for state, g in zip(states, guided, strict=True)]
        # the usual batches — every state guided, or none — take their rows as views: gathering them by index costs
        # more than the element-wise steps themselves at one image (the same values either way)
        if all(guided):
            v_cond, v_uncond = velocity[0::2], velocity[1::2]
        elif not any(guided):
            v_cond = v_uncond = velocity  # unguided: v_c + 1·(v_c − v_c) = v_c exactly
        else:
            first = np.cumsum([0] + [2 if g else 1 for g in guided[:-1]])
            v_cond, v_uncond = velocity[first.tolist()], velocity[(first + np.array(guided)).tolist()]
        v = self.cfg(v_uncond, v_cond, a.asarray(np.array(scales)))
        x = a.cat([s.latents for s in states])
        sigma = np.array([s.sigmas[s.step] for s in states])
        sigma_next = np.array([s.sigmas[s.step + 1] for s in states])
        solved, log_probs = [None] * len(states), [None] * len(states)
        euler = [i for i, s in enumerate(states) if s.request.solver == "euler"]
        if euler:
            every = len(euler) == len(states)
            stepped = self.euler(x if every else x[euler], v if every else v[euler], a.asarray(sigma[euler]),
                                 a.asarray(sigma_next[euler]))
            for j, i in enumerate(euler):
                solved[i] = stepped[j:j + 1]
        dpm = [i for i, s in enumerate(states) if s.request.solver == "dpmpp_2m"]
        if dpm:
            every = len(dpm) == len(states)
            c = np.array([_dpm_c(states[i].previous, sigma[i], sigma_next[i]) for i in dpm])
            # a first-order step (c = 0) reads no previous estimate: x stands in for it, multiplied by 0
            prev = a.cat([states[i].previous[1] if c[j] else x[i:i + 1] for j, i in enumerate(dpm)])
            stepped, x0 = self.dpm(x if every else x[dpm], v if every else v[dpm], a.asarray(sigma[dpm]),
                                   a.asarray(sigma_next[dpm]), prev, a.asarray(c))
            for j, i in enumerate(dpm):
                solved[i], states[i].previous = stepped[j:j + 1], (sigma[i], x0[j:j + 1])
        renoise = [i for i, s in enumerate(states) if s.request.solver == "renoise"]
        if renoise:
            noise = a.asarray(np.concatenate([states[i].rng.standard_normal((1, *x.shape[1:])) for i in renoise]))
            stepped = self.renoise(x[renoise], v[renoise], a.asarray(sigma[renoise]), a.asarray(sigma_next[renoise]),
                                   noise)
            for j, i in enumerate(renoise):
                solved[i] = stepped[j:j + 1]
        for eta in sorted({s.request.eta for s in states if s.request.solver == "sde"}):
            group = [i for i, s in enumerate(states) if s.request.solver == "sde" and s.request.eta == eta]
            noise = a.asarray(np.concatenate([states[i].rng.standard_normal((1, *x.shape[1:])) for i in group]))
            sample, _, _, logp = self.sde(x[group], v[group], a.asarray(sigma[group]), a.asarray(sigma_next[group]),
                                          noise=noise, eta=eta)
            for j, i in enumerate(group):
                solved[i], log_probs[i] = sample[j:j + 1], logp[j:j + 1]
        for i, state in enumerate(states):
            if state.keep is not None:  # inpainting: the kept cells follow the image's own path to σ'
                kept, source, noise = state.keep
                solved[i] = kept * ((1 - sigma_next[i]) * source + sigma_next[i] * noise) + (1 - kept) * solved[i]
            state.latents = solved[i]
            state.step += 1
            if state.capture is not None:
                state.capture.latents.append(solved[i])
                state.capture.velocities.append(v[i:i + 1])
                state.capture.log_probs.append(log_probs[i])

    def step(self, states: list[LoopState]) -> None:
        """Advance every unfinished state by one step, sharing one transformer forward between them."""
        active = [s for s in states if not s.done]
        if not active:
            return
        a = self.arrays
        rows = [s for s in active for _ in range(2 if s.guided else 1)]
        t = a.asarray(np.array([s.sigmas[s.step] * 1000.0 for s in rows]))
        text, mask, context, adapters = self._batch_text(active)
        transformer = self.instance.component(self.transformer)
        x = a.cat([s.latents for s in rows])
        velocity = transformer(x, t, text, mask, **adapters) if context is None else \
            transformer(x, t, text, mask, context, **adapters)
        self.advance(active, a.to_state(velocity))  # CFG and the solver in the state's dtype, whatever the precision

    def _batch_text(self, states: list[LoopState]):
        """The text rows of a batch and, from a transformer that offers `text_context`, what its
        cross-attention derives from them (Wan: every block's keys and values) — rebuilt only when the states or
        their guided steps change, not every step."""
        # states compared by identity, kept alive with the rows, and by the adapter versions and scales they hold
        # (what the transformer computes here depends on them); a step with autograd on (a training rollout's
        # differentiated step) never reuses keys and values computed without it
        key = (tuple((s, s.guided, tuple((u.adapter.version, u.scale) for u in s.adapters)) for s in states),
               self.arrays.grad_enabled(), self.fused)
        if self._text_rows is None or self._text_rows[0] != key:
            parts = [part for s in states for part in ((s.cond, s.uncond) if s.guided else (s.cond,))]
            a = self.arrays
            text, mask = a.cat([p[0] for p in parts]), a.cat([p[1] for p in parts])
            transformer = self.instance.component(self.transformer)
            encode = getattr(transformer, "text_context", None)
            rows = [s for s in states for _ in range(2 if s.guided else 1)]
            adapters = self._adapter_rows(rows, transformer)
            # requests with one prompt share its rows (`init`); a row's text context depends on its LoRA stack too
            keys = [(id(part), self._lora_stack(state)) for part, state in zip(parts, rows, strict=True)]
            distinct = {}
            for k, part, state in zip(keys, parts, rows, strict=True):
                distinct.setdefault(k, (part, state))
            context = None
            if encode is not None and len(distinct) < len(parts) and not a.grad_enabled():
                # an eval's 1,000 requests name 11 texts: each projected once, its rows copied (the same bits where
                # products are batch-invariant, as a request's are alone and in a batch)
                order = {k: i for i, k in enumerate(distinct)}
                once = a.cat([part[0] for part, _ in distinct.values()])
                lora = self._adapter_rows([state for _, state in distinct.values()], transformer).get("lora")
                projected = encode(once, lora) if lora is not None else encode(once)
                if hasattr(projected, "rows"):  # Wan's TextContext; another transformer's is projected row by row
                    context = projected.rows(a.asarray(np.array([order[k] for k in keys])))
            if encode is not None and context is None:
                context = encode(text, adapters["lora"]) if adapters else encode(text)
            self._text_rows = (key, text, mask, context, adapters)
        return self._text_rows[1:]

    def _lora_stack(self, state: LoopState) -> tuple:
        """The LoRAs (adapter, scale) a state's rows add to the transformer: none where they are the fused stack."""
        loras = tuple((u.adapter, u.scale) for u in state.adapters if u.adapter.kind == "lora")
        return () if loras == self.fused else loras

    def _adapter_rows(self, rows: list[LoopState], transformer) -> dict:
        """The DiT's per-row adapter work for a batch whose model rows belong to `rows`: one LoRA plan for all the
        stacks in it (rows of the fused stack, and rows without LoRA, add nothing) and each ControlNet's rows."""
        if not any(s.adapters for s in rows):
            return {}
        from cardtool.backends.adapter_rows import adapter_arguments

        slots, stacks, index, nets = {}, [], [], {}
        for row, state in enumerate(rows):
            loras = self._lora_stack(state)
            if not loras:
                index.append(-1)
            else:
                if loras not in slots:
                    slots[loras] = len(stacks)
                    stacks.append(tuple((adapter.value, scale) for adapter, scale in loras))
                index.append(slots[loras])
            for use in state.adapters:
                if use.adapter.kind == "controlnet":
                    nets.setdefault(use.adapter.value, []).append((row, state.control, use.scale))
        return adapter_arguments(transformer, stacks, index, nets)

    def latent_mask(self, mask: np.ndarray):
        """A keep mask (1, 1, 1, h, w) on the latent grid from a pixel mask (H, W) whose white (≥ 128) is to be
        generated anew: a latent cell is generated if any pixel it covers is (the image padded as the VAE pads it,
        the padding kept), else kept, 1."""
        config = self.instance.component(self.vae).config
        size, padded, cells = config.image_size, getattr(config, "padded_size", config.image_size), config.latent_size
        if mask.shape != (size, size) or padded % cells:
            raise BadInput(f"a mask for card '{self.instance.card.id}' is {size}×{size}, got "
                           f"{mask.shape[1]}×{mask.shape[0]}")
        low = (padded - size) // 2
        grid = np.zeros((padded, padded), dtype=bool)
        grid[low:low + size, low:low + size] = mask >= 128
        factor = padded // cells
        generated = grid.reshape(cells, factor, cells, factor).any(axis=(1, 3))
        return self.arrays.asarray((~generated).astype(np.float64)[None, None, None])

    def encode(self, images: np.ndarray) -> list:
        """Latents (1, C, 1, H, W) of uint8 images (B, H, W) — the VAE's posterior mean, scaled as the DiT sees
        them — for requests that start from an image."""
        vae = self.instance.component(self.vae)
        if not hasattr(vae, "encode"):
            raise BadInput(f"the VAE of '{self.instance.card.id}' on {self.instance.platform.device} has no encoder; "
                           "starting from an image needs the torch platform")
        size = vae.config.image_size
        if images.shape[1:] != (size, size):
            raise BadInput(f"card '{self.instance.card.id}' takes {size}×{size} images, got "
                           f"{images.shape[-1]}×{images.shape[-2]}")
        x = self.arrays.asarray(images.astype(np.float64)[:, None] / 127.5 - 1.0)
        with self.arrays.inference():
            latents = self._grouped(vae, "encode", lambda group: vae.encode(group)[0], x) * vae.config.scaling_factor
        latents = self.arrays.to_state(latents)[:, :, None]
        return [latents[i:i + 1] for i in range(len(images))]

    def finalize(self, states: list[LoopState]) -> np.ndarray:
        """Decode finished states to uint8 images (B, H, W); NonFiniteImages if any is NaN or inf."""
        images, finite = self.decode(states)
        if not finite.all():  # cast to uint8, NaN would be written as an arbitrary image
            broken = [s.request for s, ok in zip(states, finite, strict=True) if not ok]
            raise NonFiniteImages(self.instance.card.id, broken, len(states), precision=self.instance.precision)
        return images

    def decode(self, states: list[LoopState]) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images (B, H, W) of finished states, and which of them are finite (the others are black)."""
        vae = self.instance.component(self.vae)
        latents = self.arrays.cat([s.latents for s in states])[:, :, 0] / vae.config.scaling_factor
        with self.arrays.inference():
            images = self.arrays.to_numpy(self._grouped(vae, "decode", vae.decode, latents))[:, 0].astype(np.float64)
        finite = np.isfinite(images).all(axis=(1, 2))
        images[~finite] = -1.0
        return np.clip(np.round((images + 1) * 127.5), 0, 255).astype(np.uint8), finite

    def _grouped(self, vae, kind: str, vae_call, x):
        """`vae_call` (the VAE's `kind`, decode or encode) on x in fixed groups, the last padded with zeros, off CUDA:
        oneDNN's convolutions round differently for different batch sizes, so an image decoded with others would
        depend on them (the parity ladder's C2); in groups of one fixed size it does not. Groups of SMALL_GROUP keep
        one image cheap (3.3 ms on the 2-core AMX Xeon, 7.8 in a group of 16); groups of VAE_GROUP make many cheaper
        (0.45 instead of 0.75 ms an image, most of a 1-step student's time) and are used where a trial on this VAE —
        the first VAE_GROUP images, both ways — gives the same bits: the bits never depend on the verdict."""
        if self.instance.platform.device == "cuda" or len(x) == 0:
            return vae_call(x)
        a = self.arrays

        def in_groups(part, size) -> list:
            out = []
            for i in range(0, len(part), size):
                group = part[i:i + size]
                short = size - len(group)
                out.append(vae_call(a.cat([group, *[part[:1] * 0] * short]) if short else group)[:len(group)])
            return out

        large = len(x) // VAE_GROUP * VAE_GROUP
        try:
            verdicts = _groups_agree.setdefault(vae, {})
        except TypeError:  # a VAE that cannot be weakly referenced: tried on each call
            verdicts = {}
        if not large or verdicts.get(kind) is False:
            return a.cat(in_groups(x, SMALL_GROUP))
        first = []
        if kind not in verdicts:
            small, first = a.cat(in_groups(x[:VAE_GROUP], SMALL_GROUP)), [vae_call(x[:VAE_GROUP])]
            verdicts[kind] = np.array_equal(a.to_numpy(small), a.to_numpy(first[0]), equal_nan=True)
            if not verdicts[kind]:
                return a.cat([small, *in_groups(x[VAE_GROUP:], SMALL_GROUP)])
        return a.cat([*first, *in_groups(x[len(first) * VAE_GROUP:large], VAE_GROUP),
                      *in_groups(x[large:], SMALL_GROUP)])
