"""Training plumbing that speaks torch: optimizer state as safetensors
(checkpoints never pickle), and the classifier CNN the reward card serves."""

from __future__ import annotations

import json

import torch
from torch import nn

__all__ = ["optimizer_tensors", "load_optimizer_tensors", "FashionCNN"]


def optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str = "optim") -> tuple[dict, str]:
    """An optimizer's per-parameter state as flat tensors, plus its param groups as JSON."""
    state = optimizer.state_dict()
    tensors = {f"{prefix}.{index}.{name}": value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
               for index, entries in state["state"].items() for name, value in entries.items()}
    return tensors, json.dumps(state["param_groups"])


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict, groups: str, prefix: str = "optim"):
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith(prefix + "."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(groups)})


class FashionCNN(nn.Module):
    """A small CNN for 28×28 grey images: two conv stages (28 → 14 → 7), then a penultimate layer over the
    flattened 7×7 maps (the features FID is computed on) and a linear head over the classes."""

    def __init__(self, classes: int = 10, width: int = 32, features: int = 256, dropout: float = 0.3):
        super().__init__()
        w = width
        self.conv = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.GroupNorm(8, w), nn.SiLU(),
            nn.Conv2d(w, w, 3, padding=1), nn.GroupNorm(8, w), nn.SiLU(), nn.MaxPool2d(2),  # 14×14
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.GroupNorm(8, 2 * w), nn.SiLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.GroupNorm(8, 2 * w), nn.SiLU(), nn.MaxPool2d(2))  # 7×7
        self.features = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(2 * w * 49, features), nn.SiLU())
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(features, classes))

    def embed(self, images):
        """Penultimate features (B, features) of images (B, 1, 28, 28) in [−1, 1]."""
        return self.features(self.conv(images))

    def forward(self, images):
        return self.head(self.embed(images))
