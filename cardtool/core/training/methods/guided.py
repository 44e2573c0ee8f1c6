"""A frozen card's velocity as its card serves it: classifier-free guidance at the card's scale on the samples whose
t lies in its guidance interval (DMD2's real score; reward fine-tuning's CFG reference)."""

from __future__ import annotations

import torch

__all__ = ["GuidedVelocity"]


class GuidedVelocity:
    """v_u + w·(v_c − v_u) where t ∈ [lo, hi] and w ≠ 1, else v_c; `empty` is the null condition's (states, mask)."""

    def __init__(self, model, cfg, empty, guidance: float, interval: tuple[float, float], device):
        self.model, self.cfg, self.guidance, self.interval = model, cfg, guidance, interval
        self.empty = tuple(torch.as_tensor(a, device=device) for a in empty)

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        v = self.model(x_t, t * 1000, text, mask)
        low, high = self.interval
        guided = ((t >= low - 1e-9) & (t <= high + 1e-9)).nonzero().flatten() if self.guidance != 1 else []
        if len(guided):
            empty, empty_mask = (a[None].expand(len(guided), *a.shape) for a in self.empty)
            v_uncond = self.model(x_t[guided], t[guided] * 1000, empty.to(text.dtype), empty_mask)
            v = v.clone()
            v[guided] = self.cfg(v_uncond, v[guided], self.guidance).to(v.dtype)
        return v
