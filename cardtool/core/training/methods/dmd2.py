"""DMD2 (Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image Synthesis", arXiv
2405.14867) in flow-matching form (ALGORITHMS.md): a few-step generator G, initialised from the teacher, is
trained so that its samples' distribution matches the teacher's.

Each iteration: the student samples with the project's one denoise loop (`renoise`, its own k-step rule) from
noise for a random number of grid steps without gradient (backward simulation), then takes the next step — with
gradient on the generator's turn — whose clean estimate x = x_j − σ_j·G(x_j) is the generator's sample. Noised to a
random t, the frozen teacher with CFG gives x̂_real and the critic (fake score, initialised from the teacher) gives
x̂_fake; the distribution-matching gradient g = (x̂_fake − x̂_real) / mean|x − x̂_real| enters as
½·‖x − sg(x − g)‖². The critic learns the generator's distribution with the ordinary flow-matching loss on sg(x).
Two time-scale updates: the critic every iteration, the generator every `generator_every`-th.

`gan: true` adds DMD2's GAN term: a classifier head on the critic's last-block features, trained to tell noised
real latents (the data, the prompt's class) from noised generator samples (softplus losses, weight λ_D), while the
generator is pushed to look real to it (λ_G) — the critic's weights are held fixed for that term. `gan_real:
teacher` calls the teacher sampler's outputs for the same prompt real instead of the data.

`real: sampler` replaces the guided teacher as the real score by a second critic (initialised from the teacher and
trained like the fake one, with the flow-matching loss) on samples of the teacher's own sampler at its card's loop
defaults: the distribution it approximates is then what `cardtool generate TEACHER` makes — with interval-guided
CFG that is neither the guided nor the unguided model's marginals, which the DM gradient otherwise follows.

`regression: λ > 0` adds DMD's regression loss (Yin et al. 2023, "One-step Diffusion with Distribution Matching
Distillation", arXiv 2311.18828, eq. 9): a fixed set of (noise, teacher output) pairs — the teacher's own sampler,
at its card's loop defaults, from each pair's seed — and on the generator's turn λ·‖G(z) − y‖² between the
student's first clean estimate from that noise and the teacher's image. DMD2 dropped it; it anchors the student
to the distribution the teacher's *sampler* makes, where interval-guided CFG is not the guided marginals the
distribution-matching gradient follows.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import Card
from cardtool.core.cards.loops import MAX_GUIDANCE, MAX_STEPS, SHIFTS
from cardtool.core.data import Split
from cardtool.core.prompts import training_prompts
from cardtool.core.sampling.denoise import Request
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import encode_prompts
from cardtool.core.training.lora_settings import LORA_UNSHARDABLE, lora_settings
from cardtool.core.training.methods.frozen import FrozenCard
from cardtool.core.training.methods.vae import latents
from cardtool.core.training.recipes import LossSettings, Recipe, check_unit_intervals
from cardtool.core.training.trainer import Task
from cardtool.errors import BadInput

__all__ = ["DEFAULTS", "DMD2Settings", "DMD2Task", "dm_gradient", "generator_turn", "critic_loss"]

# what `cardtool distill` runs without --recipe (examples/recipes/fashion-dmd2.yaml spells the same values out):
# DMD2's optimiser (lr 2e-5 for both networks, Adam β1 = 0 as in its ImageNet runs, weight decay 0.01, clip 10)
DEFAULTS = {
    "method": "dmd2",
    "card": {"storage": "float16"},
    "loss": {"student_steps": 4, "generator_every": 5, "t_range": [0.02, 0.98]},
    "optim": {"lr": 2.0e-5, "betas": [0.0, 0.999], "weight_decay": 0.01, "grad_clip": 10.0, "warmup": 0,
              "batch_size": 64, "steps": 3000},
    "train": {"seed": 0, "precision": "bfloat16", "ema": 0.0, "checkpoint_every": 100, "log_every": 20},
}


class DMD2Settings(LossSettings):
    """A DMD2 recipe's `loss:` section."""

    method = "dmd2"
    student_steps: int = Field(4, ge=1, le=MAX_STEPS)  # the student's grid: shifted_sigmas(steps, shift)
    shift: float = Field(1.0, ge=SHIFTS[0], le=SHIFTS[1])
    guidance: float | None = Field(None, ge=1, le=MAX_GUIDANCE)  # the teacher's CFG scale (None: its card's)
    guidance_interval: tuple[float, float] | None = None  # the σ range it guides (None: the card's)
    generator_every: int = Field(5, ge=1)  # two time-scale update rule: critic steps per generator step
    critic_lr_scale: float = Field(1.0, gt=0)  # the critic's learning rate over the generator's (DMD2: the same)
    t_range: tuple[float, float] = (0.02, 0.98)  # where the DM loss and the critic are evaluated (DMD2's 2%…98%)
    gan: bool = False  # the GAN head on the critic's features (needs the training images)
    gan_generator_weight: float = Field(3e-3, ge=0)  # λ_G
    gan_critic_weight: float = Field(1e-2, ge=0)  # λ_D
    gan_head_lr_scale: float = Field(50.0, gt=0)  # the fresh head's learning rate over the networks' (2e-5 → 1e-3)
    gan_real: Literal["data", "teacher"] = "data"  # what the head calls real: training images or teacher samples
    gan_t_range: tuple[float, float] | None = None  # the GAN term's noise levels (None: the critic's t, DMD2's)
    real: Literal["guided", "sampler"] = "guided"  # the real score: the teacher with CFG, or fit to its samples
    real_lr_scale: float = Field(10.0, gt=0)  # the real critic's learning rate over the networks' (it fits fixed data)
    regression: float = Field(0.0, ge=0)  # DMD's λ_reg on (noise, teacher sample) pairs; 0: DMD2 as published
    teacher_samples: int = Field(2048, ge=1, le=1 << 20)  # (noise, sample) pairs the teacher makes at the start

    @model_validator(mode="after")
    def _ranges(self):
        check_unit_intervals(self, "guidance_interval", "t_range", "gan_t_range")
        return self


def generator_turn(step: int, every: int) -> bool:
    """The two time-scale update rule: the generator moves on steps 0, every, 2·every, …; the critic on all."""
    return step % every == 0


def dm_gradient(x: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor) -> torch.Tensor:
    """DMD's distribution-matching gradient, normalised per sample (DMD eq. 8, DMD2 code):
    (x̂_fake − x̂_real) / mean|x − x̂_real|."""
    scale = (x - x0_real).abs().mean(dim=tuple(range(1, x.ndim)), keepdim=True)
    return torch.nan_to_num((x0_fake - x0_real) / scale)


def critic_loss(critic, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor, text, mask) -> torch.Tensor:
    """The fake score's ordinary flow-matching loss on the generator's samples x (held constant):
    ‖v(x_t, t) − (ε − x)‖² at x_t = (1 − t)·x + t·ε."""
    x = x.detach()
    v = critic(noised(x, t, noise), t * 1000, text, mask)
    return (v.float() - (noise - x)).pow(2).mean()


def noised(x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x + t·ε, one t per row."""
    tb = t.reshape(-1, *(1,) * (x.ndim - 1))
    return (1 - tb) * x + tb * noise


class GANHead(torch.nn.Module):
    """DMD2's classifier on the critic's features: token-averaged last-block states → one real/fake logit."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, dim), torch.nn.SiLU(),
                                       torch.nn.Linear(dim, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features.float().mean(dim=1)).squeeze(-1)


class DMD2Task(Task):
    """Generator (`transformer`, written to the student card) and critic, trained against the frozen teacher."""

    modules_take_turns = True  # the generator joins every generator_every-th step
    even_forwards = False  # a micro-batch's rollout depth, and so its generator forwards, differ between ranks

    def __init__(self, recipe: Recipe, platform: Platform, teacher: Card, train: Split | None = None):
        self.settings = s = DMD2Settings.from_recipe(recipe.loss)
        self.prompts = [p for options in training_prompts() for p in options]  # (class, phrasing) pairs
        by_class = _gan_data(s, len(self.prompts), train)  # before the teacher samples or the images are encoded
        self.teacher, self.device = teacher, platform.torch_device
        frozen = FrozenCard(teacher, platform, "teacher", "DMD2")
        self.lora = lora_settings(recipe, "student", teacher.id)
        if self.lora is not None:
            self.unshardable = LORA_UNSHARDABLE
        elif s.gan:
            self.unshardable = ("loss.gan's generator term freezes the critic's weights in place mid-step, which "
                                "FSDP2's gathered copies do not follow")
        self.name, self.config, self.cache = frozen.name, frozen.config, frozen.cache
        self.real = frozen.module
        torch.manual_seed(recipe.train.seed)
        self.generator, self.critic = frozen.copy(self.lora), frozen.copy()  # the fake score trains whole
        self.loop = frozen.serving(self.generator)
        # the teacher as its card serves it (or as the recipe guides it): CFG on the steps in the guidance interval
        self.real_velocity = frozen.guided(s.guidance, s.guidance_interval)
        self.turn = True
        self.per_class = len(training_prompts()[0])
        self.head = None
        self.real_critic = None
        if s.regression > 0 or s.real == "sampler" or (s.gan and s.gan_real == "teacher"):
            self.pairs = teacher_samples(frozen, self.prompts, s.teacher_samples)
        if s.gan:
            self.head = GANHead(self.config.dim).to(self.device)
            self.critic.blocks[-1].register_forward_hook(self._keep_features)
            if s.gan_real == "teacher":  # each row's real: a teacher sample of the same prompt
                self.real_latents = self.pairs[2].to(self.device)
                owner = np.array(self.pairs[0])
                self.real_rows = [np.flatnonzero(owner == p) for p in self.prompts]
            else:  # each row's real: a training image of the prompt's class
                self.real_latents = latents(frozen.instance.component(frozen.loop.vae), train.images,
                                            self.device)[0]
                self.real_rows = [by_class[i // self.per_class] for i in range(len(self.prompts))]
        if s.real == "sampler":
            self.real_critic = frozen.copy()
            self.real_velocity = lambda x_t, t, text, mask: self.real_critic(x_t, t * 1000, text, mask)
            prompts = self.pairs[0]
            text = encode_prompts(frozen.instance, sorted(set(prompts)), self.cache, frozen.loop.text_encoder)
            rows = dict(zip(sorted(set(prompts)), text, strict=True))
            self.pair_text = tuple(torch.as_tensor(np.stack([rows[p][i] for p in prompts])).to(self.device)
                                   for i in (0, 1))

    def _keep_features(self, module, inputs, output) -> None:
        self._features = output

    def modules(self):
        heads = {"gan_head": self.head} if self.head is not None else {}
        real = {"real_critic": self.real_critic} if self.real_critic is not None else {}
        return {"transformer": self.generator, "critic": self.critic, **real, **heads}

    def dataset_size(self) -> int:
        return len(self.prompts)

    def lr_scales(self) -> dict[str, float]:
        s = self.settings
        return {"critic": s.critic_lr_scale, "gan_head": s.gan_head_lr_scale, "real_critic": s.real_lr_scale}

    def prepare(self, step: int) -> None:
        self.turn = generator_turn(step, self.settings.generator_every)

    def rollout(self, prompts: list[str], seeds: list[int], depth: int, *, grad: bool):
        """The student's sample at grid step `depth`: `depth` steps of its own sampling rule from each seed's noise
        without gradient, then step `depth` (differentiable when `grad`); returns (x̂0, text, mask)."""
        s, loop = self.settings, self.loop
        requests = [Request(p, seed=seed, steps=s.student_steps, guidance=1.0, shift=s.shift, solver="renoise")
                    for p, seed in zip(prompts, seeds, strict=True)]
        states = loop.init(requests, capture=True)
        with torch.no_grad(), loop.arrays.compute():
            for _ in range(depth):
                loop.step(states)
        with torch.set_grad_enabled(grad), loop.arrays.compute():
            loop.step(states)
        x = torch.cat([st.capture.latents[depth] for st in states])
        v = torch.cat([st.capture.velocities[depth] for st in states])
        sigma = float(states[0].sigmas[depth])
        # the renoise rule's own clean estimate (its step to σ = 0): what the student hands on at this depth
        x0 = loop.renoise(x, v, loop.arrays.asarray(np.full(len(x), sigma)), loop.arrays.asarray(np.zeros(len(x))),
                          torch.zeros_like(x))
        text = torch.cat([st.cond[0] for st in states])
        mask = torch.cat([st.cond[1] for st in states])
        return x0, text, mask

    def loss(self, indices, generator):
        s = self.settings
        n = len(indices)
        prompts = [self.prompts[i] for i in indices]
        seeds = torch.randint(0, 2**62, (n,), generator=generator).tolist()
        depth = int(torch.randint(0, s.student_steps, (1,), generator=generator))
        x, text, mask = self.rollout(prompts, seeds, depth, grad=self.turn)
        low, high = s.t_range
        t = (low + (high - low) * torch.rand(n, generator=generator)).to(self.device)
        noise = torch.randn(x.shape, generator=generator).to(self.device)
        critic_t = (low + (high - low) * torch.rand(n, generator=generator)).to(self.device)
        critic_noise = torch.randn(x.shape, generator=generator).to(self.device)
        loss = critic_loss(self.critic, x, critic_t, critic_noise, text, mask)
        metrics = {"critic_loss": float(loss.detach())}
        if self.real_critic is not None:  # the real score keeps fitting the teacher's samples, at the critic's pace
            real_loss = self._real_critic_loss(n, generator)
            loss = loss + real_loss
            metrics["real_critic_loss"] = float(real_loss.detach())
        if self.head is not None:
            gan_t, gan_noise = critic_t, critic_noise
            if s.gan_t_range is not None:  # its own noise levels: one more critic forward on the fake samples
                gan_t, gan_noise = self._gan_noise(x.shape, generator)
                self.critic(noised(x.detach(), gan_t, gan_noise), gan_t * 1000, text, mask)
            fake_logit = self.head(self._features)  # the last critic forward saw the noised fake samples
            real = self._real(indices, gan_t, generator)
            self.critic(real, gan_t * 1000, text, mask)
            d_loss = F.softplus(fake_logit).mean() + F.softplus(-self.head(self._features)).mean()
            loss = loss + s.gan_critic_weight * d_loss
            metrics["d_loss"] = float(d_loss.detach())
        if self.turn:
            tb = t.reshape(-1, 1, 1, 1, 1)
            with torch.no_grad():
                x_t = noised(x, t, noise)
                x0_real = x_t - tb * self.real_velocity(x_t, t, text, mask).float()
                x0_fake = x_t - tb * self.critic(x_t, t * 1000, text, mask).float()
                g = dm_gradient(x, x0_real, x0_fake)
            dm = 0.5 * F.mse_loss(x.float(), (x - g).detach().float())
            loss = loss + dm
            metrics["dm_loss"] = float(dm.detach())
            if self.head is not None:
                with _frozen(self.critic, self.head):  # the generator's term moves the generator alone
                    gan_t, gan_noise = (t, noise) if s.gan_t_range is None else self._gan_noise(x.shape, generator)
                    self.critic(noised(x, gan_t, gan_noise), gan_t * 1000, text, mask)
                    g_loss = F.softplus(-self.head(self._features)).mean()
                loss = loss + s.gan_generator_weight * g_loss
                metrics["g_loss"] = float(g_loss.detach())
            if s.regression > 0:
                reg = self._regression(n, generator)
                loss = loss + s.regression * reg
                metrics["reg_loss"] = float(reg.detach())
        return loss, metrics

    def _gan_noise(self, shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
        """A t in `gan_t_range` and a noise draw for each row of a batch of latents of this shape."""
        low, high = self.settings.gan_t_range
        t = (low + (high - low) * torch.rand(shape[0], generator=generator)).to(self.device)
        return t, torch.randn(shape, generator=generator).to(self.device)

    def _real_critic_loss(self, n: int, generator) -> torch.Tensor:
        """The flow-matching loss of the real critic on n of the teacher's samples, with their prompts' text."""
        low, high = self.settings.t_range
        picks = torch.randint(0, len(self.pairs[1]), (n,), generator=generator)
        x = self.pairs[2][picks].to(self.device)
        t = (low + (high - low) * torch.rand(n, generator=generator)).to(self.device)
        noise = torch.randn(x.shape, generator=generator).to(self.device)
        text, mask = (a[picks.to(a.device)] for a in self.pair_text)
        return critic_loss(self.real_critic, x, t, noise, text, mask)

    def _regression(self, n: int, generator) -> torch.Tensor:
        """‖G(z) − y‖² on n pairs: the student's first clean estimate from each pair's noise against the teacher's
        sample from the same noise."""
        prompts, seeds, targets = self.pairs
        picks = torch.randint(0, len(seeds), (n,), generator=generator).tolist()
        x, _, _ = self.rollout([prompts[i] for i in picks], [seeds[i] for i in picks], 0, grad=True)
        return F.mse_loss(x.float(), targets[picks].to(x.device))

    def _real(self, indices, t, generator) -> torch.Tensor:
        """Real latents for each row's prompt (`gan_real`), noised to that row's t."""
        picks = [self.real_rows[i] for i in indices]
        rows = [int(p[int(torch.randint(0, len(p), (1,), generator=generator))]) for p in picks]
        x0 = self.real_latents[rows]
        return noised(x0, t, torch.randn(x0.shape, generator=generator).to(self.device))


PAIR_SEEDS = 1 << 40  # the pairs' seeds start here, far from the seeds eval samples (0, 1, …)


def _gan_data(s: DMD2Settings, prompts: int, train: Split | None) -> list[np.ndarray] | None:
    """For `loss.gan` on training images, the rows of each class's (None otherwise); what it needs, checked."""
    if not s.gan:
        return None
    if s.gan_real == "teacher":
        if s.teacher_samples < prompts:
            raise BadInput(f"loss.gan_real=teacher needs loss.teacher_samples ≥ {prompts} (one sample per training "
                           f"prompt), got {s.teacher_samples}")
        return None
    if train is None:
        raise BadInput("loss.gan needs the training images (Fashion-MNIST, or --data DIR)")
    by_class = [np.flatnonzero(train.labels == c) for c in range(len(training_prompts()))]
    if not all(len(rows) for rows in by_class):
        missing = [train.class_names[c] for c, rows in enumerate(by_class) if not len(rows)]
        raise BadInput(f"loss.gan takes each prompt's real images from its class, and the training images hold none "
                       f"of: {', '.join(missing)}")
    return by_class


def teacher_samples(frozen: FrozenCard, prompts: list[str], count: int) -> tuple[list[str], list[int], torch.Tensor]:
    """`count` (prompt, seed, teacher latent) triples: the prompts in turn, seeds PAIR_SEEDS + i, each sampled
    by the teacher's loop at its card's defaults (deterministic, so a resumed run rebuilds the same pairs)."""
    d = frozen.defaults
    chosen = [prompts[i % len(prompts)] for i in range(count)]
    seeds = [PAIR_SEEDS + i for i in range(count)]
    requests = [Request(p, seed=seed, steps=d.steps, guidance=d.guidance, shift=d.shift, solver=d.solver,
                        guidance_interval=d.guidance_interval) for p, seed in zip(chosen, seeds, strict=True)]
    states = sample(frozen.loop, requests)
    return chosen, seeds, torch.cat([torch.as_tensor(st.latents) for st in states]).float()


class _frozen:
    """Modules whose parameters take no gradient inside the block (the graph through their inputs remains)."""

    def __init__(self, *modules: torch.nn.Module):
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)
