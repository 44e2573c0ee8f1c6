"""Reward fine-tuning's shared half (DiffusionNFT and Flow-GRPO): groups of K rollouts per prompt through the
project's one denoise loop with capture on (DESIGN.md invariant 2), their rewards from a reward card, group-centred
advantages, and a rollout buffer that `updates_per_rollout` optimiser steps share.

One trainer step is one optimiser update. On every `updates_per_rollout`-th step the task samples the trainer's
batch of prompts K times each (RL runs without CFG: guidance 1), scores the decoded images, and keeps what its
method trains on; each update takes its share of the buffer's rows, and each micro-batch its share of those. The
buffer is the whole step's, sampled once for all micro-batches: under torchrun each rank samples and scores its
share of the requests and every rank receives all of them, so advantages are normalised over the global batch and
the buffer is the one a single process makes. It is part of the checkpoint, so a run resumed between two updates
continues on the same samples."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field, model_validator

from cardtool.backends.platform import Platform
from cardtool.core import distributed
from cardtool.core.cards.loader import Card
from cardtool.core.cards.loops import MAX_GUIDANCE, MAX_STEPS, SHIFTS
from cardtool.core.evaluation.reward import Reward
from cardtool.core.sampling.denoise import LoopState, Request
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import encode_prompts
from cardtool.core.training.lora_settings import LORA_UNSHARDABLE, lora_settings
from cardtool.core.training.methods.frozen import FrozenCard
from cardtool.core.training.recipes import LossSettings, Recipe, check_unit_intervals
from cardtool.core.training.trainer import Task
from cardtool.errors import BadInput

__all__ = ["RolloutSettings", "Rollouts", "RewardTask", "group_advantages", "stack_captured"]


class RolloutSettings(LossSettings):
    """The `loss:` keys both methods share."""

    group_size: int = Field(16, ge=2)  # K samples per prompt; advantages compare within a group
    rollout_steps: int = Field(10, ge=1, le=MAX_STEPS)  # the sampler's steps in training (both papers: 10)
    shift: float | None = Field(None, ge=SHIFTS[0], le=SHIFTS[1])  # None: the base card's loop default
    updates_per_rollout: int = Field(1, ge=1)  # optimiser steps sharing one rollout buffer
    kl: float = Field(0.0, ge=0)  # weight of the KL term to the frozen reference (at the last update)
    kl_start: float | None = Field(None, ge=0)  # the weight at the first update, moving linearly to `kl`; None: `kl`
    # the reference's CFG scale in that term: 1 is the base's conditional velocity alone; None is the base as its card
    # serves it (its loop's guidance and interval), so the tuned policy is held near the guided sampler
    reference_guidance: float | None = Field(1.0, ge=1, le=MAX_GUIDANCE)
    reference_interval: tuple[float, float] | None = None  # the σ range that scale guides (None: the card's)
    advantage_clip: float = Field(5.0, gt=0)
    # rewards above the cap count as the cap in the advantages: samples the reward already rates that high are
    # equally good, so the policy is pushed away from the poorly rated ones, not toward the reward's mode
    reward_cap: float | None = None

    @model_validator(mode="after")
    def _interval(self):
        check_unit_intervals(self, "reference_interval")
        return self


def group_advantages(rewards: np.ndarray, *, global_std: bool) -> np.ndarray:
    """(R − mean of its group) / (std + 1e-4) for rewards (P, K): the group's std (Flow-GRPO) or the whole batch's
    (DiffusionNFT's `global_std`, which keeps near-uniform groups from being blown up)."""
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    std = rewards.std() if global_std else rewards.std(axis=1, keepdims=True)
    return centred / (std + 1e-4)


@dataclass
class Rollouts:
    """One rollout buffer: per sample its prompt (an index into the task's prompts), reward and advantage, the
    captured latents (T + 1, N, C, F, H, W) and, from the SDE, each step's log-probability (T, N)."""

    prompts: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    latents: torch.Tensor
    log_probs: torch.Tensor | None = None
    order: torch.Tensor | None = None  # the permutation the updates take their rows from

    def rows(self, update: int, updates: int) -> torch.Tensor:
        return self.order.tensor_split(updates)[update]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def restored(cls, tensors: dict[str, torch.Tensor], *, rows: int, steps: int, latent: tuple[int, ...],
                 prompts: int, log_probs: bool) -> Rollouts:
        """A buffer as a checkpoint holds it (`tensors`), checked against the run that resumes on it — `rows`
        samples of `steps`-step rollouts of `latent`-shaped latents over `prompts` prompts; a ValueError says what
        does not fit (training on it would fail at the next update, or train on rows that are not samples)."""
        names = {"prompts", "rewards", "advantages", "latents", "order"} | ({"log_probs"} if log_probs else set())
        if set(tensors) != names:
            raise ValueError(f"the rollout buffer holds {sorted(tensors)}, this method's {sorted(names)}")
        shapes = {"prompts": (rows,), "rewards": (rows,), "advantages": (rows,), "order": (rows,),
                  "latents": (steps + 1, rows, *latent), "log_probs": (steps, rows)}
        for name, value in tensors.items():
            indices = name in ("prompts", "order")
            kind = "integer" if indices else "floating"
            if tuple(value.shape) != shapes[name] or value.is_floating_point() == indices or value.dtype == torch.bool:
                raise ValueError(f"the rollout buffer's {name} is {str(value.dtype).removeprefix('torch.')} "
                                 f"{list(value.shape)}, not {kind} {list(shapes[name])}")
        if not bool(((tensors["prompts"] >= 0) & (tensors["prompts"] < prompts)).all()):
            raise ValueError(f"the rollout buffer's prompts index past the run's {prompts}")
        if not torch.equal(tensors["order"].sort().values, torch.arange(rows)):
            raise ValueError("the rollout buffer's order is not a permutation of its rows")
        return cls(**tensors)


class RewardTask(Task):
    """The policy (`transformer`, written to the output card) fine-tuned on a reward; `reference_velocity` is the
    frozen base's for the KL term. Methods say which module samples (`sampler`), which solver, and what they train
    on."""

    solver = "euler"
    settings_type = RolloutSettings
    keeps_log_probs = False  # whether `captured_log_probs` keeps them (the buffer then holds them)
    even_forwards = False  # each rank samples its share of a rollout: shares, and so policy forwards, may differ

    def __init__(self, recipe: Recipe, platform: Platform, base: Card, reward: Reward, prompts: list[str]):
        self.settings = s = self.settings_type.from_recipe(recipe.loss)
        if not prompts:
            raise BadInput("no prompts to train on")
        frozen = FrozenCard(base, platform, "card", "reward fine-tuning")
        self.lora = lora_settings(recipe, "tuned", base.id)
        if self.lora is not None:
            self.unshardable = LORA_UNSHARDABLE
        self.base, self.reward, self.prompts = base, reward, prompts
        self.updates, self.kl = recipe.optim.steps, s.kl  # self.kl: this update's KL weight (`prepare`)
        self.rows = recipe.optim.batch_size * s.group_size  # samples in one rollout buffer
        self.device, self.name, self.cache = platform.torch_device, frozen.name, frozen.cache
        # the KL term's reference: the plain base (guidance 1), or the base as its card serves it (None)
        self.reference_velocity = frozen.guided(s.reference_guidance, s.reference_interval)
        torch.manual_seed(recipe.train.seed)
        self.policy = frozen.copy(self.lora)
        self.loop = frozen.serving(self.sampler())
        self.shift = s.shift if s.shift is not None else frozen.defaults.shift
        self.buffer: Rollouts | None = None
        self.update, self.rollout_count = 0, 0
        self.platform, self.part, self.parts, self.fresh = platform, 0, 1, True
        self.reward_history: list[float] = []

    def sampler(self) -> torch.nn.Module:
        """The module rollouts sample: the current policy unless the method keeps an older one."""
        return self.policy

    def modules(self):
        return {"transformer": self.policy}

    def dataset_size(self) -> int:
        return len(self.prompts)

    def prepare(self, step: int) -> None:
        s = self.settings
        if s.kl_start is not None:
            self.kl = s.kl_start + (s.kl - s.kl_start) * step / max(1, self.updates - 1)
        self.update = step % self.settings.updates_per_rollout
        self.rollout_count = step // self.settings.updates_per_rollout
        self.fresh = True

    def micro_batch(self, part: int, parts: int, batch: np.ndarray, shared: torch.Generator) -> None:
        """On a rollout step's first micro-batch, sample the buffer for the whole step's batch."""
        if self.fresh and (self.update == 0 or self.buffer is None):
            self.buffer = self.collect(batch, shared)
        self.fresh, self.part, self.parts = False, part, parts

    def requests(self, indices: np.ndarray, generator: torch.Generator) -> list[Request]:
        s, k = self.settings, self.settings.group_size
        seeds = torch.randint(0, 2**62, (len(indices) * k,), generator=generator).tolist()
        return [Request(self.prompts[i], seed=seed, steps=s.rollout_steps, guidance=1.0, shift=self.shift,
                        solver=self.solver, **self.request_options())
                for i, seed in zip(np.repeat(indices, k), seeds, strict=True)]

    def request_options(self) -> dict:
        return {}

    def collect(self, indices: np.ndarray, generator: torch.Generator) -> Rollouts:
        """Sample each prompt of `indices` K times with the sampler module, score the images, and keep the capture;
        under torchrun the ranks share the sampling (every request owns its seed, so the samples are the same)."""
        requests = self.requests(indices, generator)
        made = distributed.ranks(self.platform.device).spread(requests, self._sample)
        latents, log_probs, rewards = zip(*made, strict=True)
        rewards = np.asarray(rewards, dtype=np.float64)
        if not np.isfinite(rewards).all():
            raise BadInput(f"reward '{self.reward.card_id}' returned a non-finite score")
        grouped = rewards.reshape(len(indices), self.settings.group_size)
        if self.settings.reward_cap is not None:
            grouped = np.minimum(grouped, self.settings.reward_cap)
        advantages = self.advantages(grouped).reshape(-1)
        self.reward_history.append(float(rewards.mean()))
        order = torch.randperm(len(requests), generator=generator)
        return Rollouts(torch.as_tensor(np.repeat(indices, self.settings.group_size)), torch.as_tensor(rewards),
                        torch.as_tensor(advantages), stack_captured(latents),
                        stack_captured(log_probs) if log_probs[0] is not None else None, order)

    def _sample(self, requests: list[Request]) -> list[tuple]:
        """Each request's captured latents, captured log-probabilities (None without them) and reward."""
        with torch.no_grad():
            # not inference mode for a sharded policy: the weights FSDP2 gathers here serve the backward to come
            states = sample(self.loop, requests, capture=True, max_batch=256, grad=self.sharded)
            images = self.loop.finalize(states)
        rewards = self.reward.score(images, [r.prompt for r in requests])
        return [(st.capture.latents, self.captured_log_probs(st), float(reward))
                for st, reward in zip(states, rewards, strict=True)]

    @abstractmethod
    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages (P, K) of rewards (P, K), normalised as the method's paper does."""

    def captured_log_probs(self, state: LoopState) -> list | None:
        """The per-step log-probabilities a method keeps from a rollout's capture (None: it keeps none)."""
        return None

    def batch(self) -> tuple[Rollouts, torch.Tensor]:
        """The buffer and the rows this micro-batch of this update trains on."""
        rows = self.buffer.rows(self.update, self.settings.updates_per_rollout)
        return self.buffer, rows[self.part::self.parts]

    def text(self, prompt_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached text states and masks of the buffer's prompts (each prompt encoded once per run)."""
        features = encode_prompts(self.loop.instance, [self.prompts[int(i)] for i in prompt_rows], self.cache,
                                  self.loop.text_encoder)
        states = torch.as_tensor(np.stack([f[0] for f in features]), device=self.device)
        mask = torch.as_tensor(np.stack([f[1] for f in features]), device=self.device)
        return states, mask

    def metrics(self, buffer: Rollouts) -> dict[str, float]:
        lookups = self.cache.hits + self.cache.misses
        return {"reward": float(buffer.rewards.mean()), "reward_std": float(buffer.rewards.std()),
                "text_cache_hit_rate": self.cache.hits / lookups if lookups else 0.0}

    def state(self) -> dict[str, torch.Tensor]:
        held = {f"buffer.{k}": v for k, v in self.buffer.tensors().items()} if self.buffer is not None else {}
        return {**held, "reward_history": torch.tensor(self.reward_history, dtype=torch.float64)}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        buffer = {k[len("buffer."):]: v for k, v in tensors.items() if k.startswith("buffer.")}
        self.buffer = Rollouts.restored(buffer, rows=self.rows, steps=self.settings.rollout_steps,
                                        latent=self.loop.latent_shape(), prompts=len(self.prompts),
                                        log_probs=self.keeps_log_probs) if buffer else None
        history = tensors.get("reward_history", torch.zeros(0))
        if history.dim() != 1 or not history.is_floating_point():
            raise ValueError(f"reward_history is {str(history.dtype).removeprefix('torch.')} {list(history.shape)}, "
                             "not a list of mean rewards")
        self.reward_history = history.tolist()


def stack_captured(per_sample: list[list[torch.Tensor]]) -> torch.Tensor:
    """(T, N, …) from each sample's captured list of T (1, …) tensors (latents, log-probabilities), as ordinary
    tensors that training may differentiate through (the capture was made in inference mode)."""
    return torch.stack([torch.cat(step) for step in zip(*per_sample, strict=True)]).clone()
