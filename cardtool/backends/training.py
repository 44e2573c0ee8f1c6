"""Training plumbing that speaks torch: optimizer state as safetensors
(checkpoints never pickle), and the classifier CNN the reward card serves."""

from __future__ import annotations

import json

import torch
from torch import nn

from cardtool.files import parse_json

__all__ = ["optimizer_tensors", "check_optimizer_tensors", "load_optimizer_tensors", "FashionCNN"]


def optimizer_tensors(optimizer: torch.optim.Optimizer, prefix: str = "optim") -> tuple[dict, str]:
    """An optimizer's per-parameter state as flat tensors, plus its param groups as JSON."""
    state = optimizer.state_dict()
    tensors = {f"{prefix}.{index}.{name}": value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
               for index, entries in state["state"].items() for name, value in entries.items()}
    return tensors, json.dumps(state["param_groups"])


def check_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict, groups: str, prefix: str = "optim"):
    """Raise a ValueError saying what of a checkpoint's optimizer state (full tensors, as `optimizer_tensors` saved
    them) does not fit `optimizer`: groups or indices other than its own, a state tensor of another shape or kind
    than its parameter, Adam's state incomplete or impossible (a negative step or second moment makes every update
    NaN). Checked before loading, because torch loads all of these and fails only at the next step."""
    own = optimizer.state_dict()["param_groups"]
    try:
        saved = parse_json(groups)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"param_groups is not JSON ({e})") from None
    if not (isinstance(saved, list) and len(saved) == len(own) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and len(g["params"]) == len(o["params"])
            for g, o in zip(saved, own, strict=True))):
        raise ValueError("param_groups are not this optimizer's groups")
    params = [(p, group) for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if not key.startswith(prefix + "."):
            continue
        parts = key.split(".", 2)
        index, name = (parts[1], parts[2]) if len(parts) == 3 else ("", "")
        if not index.isdecimal() or int(index) >= len(params) or not name:
            raise ValueError(f"'{key}' names no parameter of this optimizer")
        param = params[int(index)][0]
        if name == "step" and (value.numel() != 1 or value.dtype == torch.bool or float(value) < 0
                               or not float(value).is_integer()):  # inf and NaN are no count either
            raise ValueError(f"'{key}' is not a count of steps")
        if name != "step" and (not value.is_floating_point() or value.shape != param.shape):
            raise ValueError(f"'{key}' is {str(value.dtype).removeprefix('torch.')} {list(value.shape)}, its "
                             f"parameter {str(param.dtype).removeprefix('torch.')} {list(param.shape)}")
        if name in ("exp_avg_sq", "max_exp_avg_sq") and bool((value < 0).any()):
            raise ValueError(f"'{key}' holds negative second moments")
        state.setdefault(int(index), {})[name] = value
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        for index, entries in state.items():
            group = params[index][1]
            needed = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set())
            if set(entries) != needed:
                raise ValueError(f"the state of parameter {index} holds {sorted(entries)}, Adam's is {sorted(needed)}")


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: dict, prefix: str = "optim"):
    """Restore the per-parameter state `optimizer_tensors` saved (checked by `check_optimizer_tensors`); the
    optimizer keeps its own hyperparameters — the recipe's, the same as the checkpoint's by its fingerprint."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith(prefix + "."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})


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
