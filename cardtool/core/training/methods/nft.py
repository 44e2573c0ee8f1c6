"""DiffusionNFT (Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv
2509.16117): reward fine-tuning on the forward process. The old policy samples with a deterministic solver (Euler, or
DPM-Solver++(2M): `loss.rollout_solver`); only the clean samples x0 and their rewards are kept — no likelihoods.
For fresh t and ε at x_t = (1 − t)·x0 + t·ε, the current velocity v_θ and the old one define an implicit positive
policy v⁺ = β·v_θ + (1 − β)·v_old and a negative one v⁻ = (1 + β)·v_old − β·v_θ; the reward-weighted x̂0 losses
(ALGORITHMS.md)

    L = mean(c·[r·ℓ⁺ + (1 − r)·ℓ⁻] / β) + β_KL·mean((v_θ − v_ref)²),   ℓ± = mean((x̂0± − x0)² / sg(mean|x̂0± − x0|)),

with r = clip(A, −c, c)/(2c) + ½ the advantage mapped to [0, 1] (c the advantage clip), pull v⁺ toward the well
rewarded samples and v⁻ toward the poorly rewarded ones. After each rollout the old policy follows the current one,
θ_old ← d·θ_old + (1 − d)·θ with d = min(0.001·rollout, 0.5) (the paper's type-1 schedule).

The KL term's reference may be the base as its card serves it, with CFG (`reference_guidance: null`): measured on
fashion-base, a reward alone buys class accuracy with diversity (FID), while the guided reference holds the CFG-free
policy near the guided sampler's distribution, which is how the tuned card gets CFG-level FID without CFG."""

from __future__ import annotations

import copy
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from cardtool.core.training.methods.rollouts import RewardTask, RolloutSettings, group_advantages
from cardtool.core.training.parallel import whole

__all__ = ["NFT_DEFAULTS", "NFTSettings", "NFTTask", "nft_loss", "old_policy_decay"]

# what `cardtool rl --method diffusion_nft` runs without --recipe (examples/recipes/fashion-nft.yaml spells it out)
NFT_DEFAULTS = {
    "method": "diffusion_nft",
    "card": {"storage": "float16"},
    "loss": {"group_size": 16, "rollout_steps": 20, "beta": 1.0, "kl": 5.0, "reference_guidance": None,
             "timesteps": 2},
    "optim": {"lr": 1.0e-4, "betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": 1.0, "warmup": 0,
              "batch_size": 4, "steps": 600},
    "train": {"seed": 0, "precision": "bfloat16", "ema": 0.0, "checkpoint_every": 25, "log_every": 10},
}


class NFTSettings(RolloutSettings):
    method = "diffusion_nft"
    beta: float = Field(1.0, gt=0)  # how far the implicit policies sit from the old one
    timesteps: int = Field(2, ge=1)  # (t, ε) draws per sample per update
    t_range: tuple[float, float] = (0.0, 1.0)
    decay_rate: float = Field(1e-3, ge=0)  # d = min(decay_rate·rollout, decay_max)
    decay_max: float = Field(0.5, ge=0, lt=1)
    # the old policy's deterministic solver: dpmpp_2m is second order, near Euler's samples at half the steps
    rollout_solver: Literal["euler", "dpmpp_2m"] = "euler"


def old_policy_decay(rollout: int, rate: float = 1e-3, cap: float = 0.5) -> float:
    """The old policy's EMA decay after `rollout` rollouts: 0 at first (the old policy is the current one)."""
    return min(rate * rollout, cap)


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             advantages: torch.Tensor, *, beta: float = 1.0, clip: float = 5.0) -> tuple[torch.Tensor, dict]:
    """DiffusionNFT's policy loss (without the KL term) for velocities v (grad) and v_old at x_t, per-sample t."""
    dims = tuple(range(1, v.ndim))
    tb = t.reshape(-1, *(1,) * (v.ndim - 1))
    v_old = v_old.detach()
    positive = x_t - tb * (beta * v + (1 - beta) * v_old)
    negative = x_t - tb * ((1 + beta) * v_old - beta * v)

    def weighted(x0_hat: torch.Tensor) -> torch.Tensor:
        error = x0_hat - x0
        weight = error.detach().abs().mean(dim=dims, keepdim=True).clamp_min(1e-5)
        return (error.pow(2) / weight).mean(dim=dims)

    r = (advantages.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)
    l_pos, l_neg = weighted(positive), weighted(negative)
    loss = (clip * (r * l_pos + (1 - r) * l_neg) / beta).mean()
    return loss, {"positive_loss": float(l_pos.mean().detach()), "negative_loss": float(l_neg.mean().detach())}


class NFTTask(RewardTask):
    settings_type = NFTSettings

    @property
    def solver(self) -> str:
        return self.settings.rollout_solver

    def sampler(self) -> torch.nn.Module:
        self.old = copy.deepcopy(self.policy).requires_grad_(False).eval()
        return self.old

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        return group_advantages(rewards, global_std=True)

    def prepare(self, step: int) -> None:
        super().prepare(step)
        if step > 0 and self.update == 0:  # a rollout's updates are done: the old policy follows
            s = self.settings
            d = old_policy_decay(self.rollout_count - 1, s.decay_rate, s.decay_max)
            with torch.no_grad():
                for old, new in zip(self.old.parameters(), self.policy.parameters(), strict=True):
                    old.lerp_(whole(new), 1 - d)  # the old policy is whole on every rank, for its rollouts

    def loss(self, indices, generator):
        s = self.settings
        buffer, rows = self.batch()
        x0 = buffer.latents[-1][rows].to(self.device)
        text, mask = self.text(buffer.prompts[rows])
        advantages = buffer.advantages[rows].to(self.device, torch.float32)
        n, draws = len(rows), s.timesteps
        low, high = s.t_range
        t = (low + (high - low) * torch.rand(n * draws, generator=generator)).to(self.device)
        noise = torch.randn((n * draws, *x0.shape[1:]), generator=generator).to(self.device)
        x0, text, mask, advantages = (a.repeat(draws, *(1,) * (a.ndim - 1)) for a in (x0, text, mask, advantages))
        tb = t.reshape(-1, *(1,) * (x0.ndim - 1))
        x_t = (1 - tb) * x0 + tb * noise
        v = self.policy(x_t, t * 1000, text, mask).float()
        with torch.no_grad():
            v_old = self.old(x_t, t * 1000, text, mask).float()
            v_ref = self.reference_velocity(x_t, t, text, mask).float() if self.kl else None
        loss, metrics = nft_loss(v, v_old, x_t, x0, t, advantages, beta=s.beta, clip=s.advantage_clip)
        if v_ref is not None:
            kl = (v - v_ref).pow(2).mean()
            loss = loss + self.kl * kl
            metrics["kl"] = float(kl.detach())
        return loss, {**metrics, **self.metrics(buffer)}

    def state(self) -> dict[str, torch.Tensor]:
        return {**super().state(), **{f"old.{k}": v for k, v in self.old.state_dict().items()}}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        super().load_state(tensors)
        self.old.load_state_dict({k[len("old."):]: v for k, v in tensors.items() if k.startswith("old.")})
