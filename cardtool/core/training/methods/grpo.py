"""Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470): the
likelihood-based baseline. Rollouts sample with the loop's `sde` solver, whose every step is a Gaussian with a
known log-probability, captured per step. An update recomputes the log-probability of each recorded transition
x_j → x_{j+1} under the current weights, and optimises PPO's clipped objective on the policy ratio
ρ = exp(logp_θ − logp_old) with group-normalised advantages, plus a KL term to the frozen reference,
mean(‖μ_θ − μ_ref‖²) / (2s²) with s = a·√(σ/(1 − σ)) the SDE's noise scale (ALGORITHMS.md, and Flow-GRPO's code): the
exact KL of the two steps' Gaussians, whose std is s·√(−Δt), times |Δt| — so β means what it meant in the paper's runs.
Defaults from the paper: noise level a = 0.7, clip ε = 1e-4, β = 0.04, 10 sampling steps in training."""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field

from cardtool.core.cards.loops import MAX_ETA
from cardtool.core.sampling.denoise import LoopState, shifted_sigmas
from cardtool.core.training.methods.rollouts import RewardTask, RolloutSettings, group_advantages

__all__ = ["GRPO_DEFAULTS", "GRPOSettings", "GRPOTask", "clipped_objective", "transition_log_probs"]

# what `cardtool rl --method flow_grpo` runs without --recipe (examples/recipes/fashion-grpo.yaml spells it out)
GRPO_DEFAULTS = {
    "method": "flow_grpo",
    "card": {"storage": "float16"},
    "loss": {"group_size": 16, "rollout_steps": 10, "eta": 0.7, "clip_range": 1.0e-4, "kl": 0.04,
             "updates_per_rollout": 2},
    "optim": {"lr": 1.0e-4, "betas": [0.9, 0.999], "weight_decay": 0.0, "grad_clip": 1.0, "warmup": 0,
              "batch_size": 4, "steps": 300},
    "train": {"seed": 0, "precision": "float32", "ema": 0.0, "checkpoint_every": 25, "log_every": 10},
}


class GRPOSettings(RolloutSettings):
    method = "flow_grpo"
    eta: float = Field(0.7, gt=0, le=MAX_ETA)  # the SDE's noise level a
    clip_range: float = Field(1e-4, gt=0)  # ε
    train_timesteps: int | None = Field(None, ge=1)  # trajectory steps trained per update (None: all of them)


def clipped_objective(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate, mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))), and the ratios ρ."""
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


def transition_log_probs(sde, model, latents: torch.Tensor, sigmas: np.ndarray, steps: list[int], text, mask,
                         eta: float):
    """Log-probabilities (S·N,) of the recorded transitions latents[j] → latents[j + 1] for each j in `steps`
    under `model`, with the SDE's means and stds; one forward over all S·N rows."""
    n = latents.shape[1]
    x = torch.cat([latents[j] for j in steps])
    x_next = torch.cat([latents[j + 1] for j in steps])
    sigma = torch.as_tensor(np.repeat(sigmas[steps], n), device=x.device, dtype=x.dtype)
    sigma_next = torch.as_tensor(np.repeat(sigmas[[j + 1 for j in steps]], n), device=x.device, dtype=x.dtype)
    v = model(x, sigma * 1000, text.repeat(len(steps), 1, 1), mask.repeat(len(steps), 1)).to(x.dtype)
    _, mean, std, log_probs = sde(x, v, sigma, sigma_next, prev_sample=x_next, eta=eta)
    return log_probs, mean, std


class GRPOTask(RewardTask):
    solver = "sde"
    settings_type = GRPOSettings
    keeps_log_probs = True

    def request_options(self) -> dict:
        return {"eta": self.settings.eta}

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        s = self.settings
        return np.clip(group_advantages(rewards, global_std=False), -s.advantage_clip, s.advantage_clip)

    def captured_log_probs(self, state: LoopState) -> list:
        return state.capture.log_probs

    def reference_model(self, x, timesteps, text, mask):
        """The reference velocity with the model's call signature (timesteps σ·1000)."""
        return self.reference_velocity(x, timesteps / 1000, text, mask)

    def loss(self, indices, generator):
        s = self.settings
        buffer, rows = self.batch()
        sigmas = shifted_sigmas(s.rollout_steps, self.shift)
        count = s.train_timesteps or s.rollout_steps
        steps = sorted(torch.randperm(s.rollout_steps, generator=generator)[:count].tolist())
        latents = buffer.latents[:, rows].to(self.device)
        text, mask = self.text(buffer.prompts[rows])
        log_probs, mean, std = transition_log_probs(self.loop.sde, self.policy, latents, sigmas, steps, text, mask,
                                                    s.eta)
        old = buffer.log_probs[steps][:, rows].reshape(-1).to(log_probs)
        advantages = buffer.advantages[rows].to(log_probs).repeat(len(steps))
        loss, ratio = clipped_objective(log_probs, old, advantages, s.clip_range)
        metrics = {"ratio_deviation": float((ratio.detach() - 1).abs().max()),
                   "clip_fraction": float(((ratio.detach() - 1).abs() > s.clip_range).float().mean())}
        if self.kl:
            with torch.no_grad():
                _, mean_ref, _ = transition_log_probs(self.loop.sde, self.reference_model, latents, sigmas, steps,
                                                      text, mask, s.eta)
            dims = tuple(range(1, mean.ndim))
            # s² from the step's std s·√(−Δt): each row's Δt from the grid, the rows in transition_log_probs' order
            gaps = np.repeat(sigmas[steps] - sigmas[[j + 1 for j in steps]], len(rows))
            scale = std.pow(2) / torch.as_tensor(gaps, device=std.device, dtype=std.dtype)
            kl = ((mean - mean_ref).pow(2).mean(dim=dims) / (2 * scale)).mean()
            loss = loss + self.kl * kl
            metrics["kl"] = float(kl.detach())
        return loss, {**metrics, **self.metrics(buffer)}
