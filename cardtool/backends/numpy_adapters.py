"""The numpy reference of the DiT's adapters (DESIGN.md invariants 4 and 7): a batch's per-row LoRA deltas through
the reference `lora_bgmv` (Hu et al. 2021, arXiv 2106.09685: h = W0·x + scale·(α/r)·B·A·x), and the ControlNet branch
(Zhang et al. 2023, arXiv 2302.05543; PixArt-δ, arXiv 2401.05252) over its own state dict — what `lora.py` and
`controlnet.py` compute in torch, so that one adapter file runs on both platforms and `parity` compares them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from cardtool.backends import reference as ops
from cardtool.backends.numpy_wan_dit import NumpyWanDiT
from cardtool.backends.wan_config import WanDiTConfig

__all__ = ["NumpyLoraPlan", "NumpyControlNet", "NumpyControlRows", "adapter_plan", "fused"]


class NumpyLoraPlan:
    """One batch's LoRA work: `stacks` one entry per distinct stack, a tuple of (LoraWeights with numpy arrays,
    scale); `rows` the slot of every row (−1: none). Each slot's A and B concatenate its LoRAs along the rank, B
    times scale·α/r — the sum of the stack's scaled deltas — and smaller slots are zero-padded, which adds nothing."""

    def __init__(self, stacks: list[tuple], rows: list[int]):
        self.index = np.asarray(rows)
        self.slots = {}
        for module in sorted({m for stack in stacks for lora, _ in stack for m in lora.a}):
            parts = [[(lora.a[module], lora.b[module] * (scale * lora.scaling)) for lora, scale in stack
                      if module in lora.a] for stack in stacks]
            d_in, d_out = next((a.shape[1], b.shape[0]) for part in parts for a, b in part)
            rank = max(sum(a.shape[0] for a, _ in part) for part in parts)
            dtype = next(a.dtype for part in parts for a, _ in part)
            a_slots, b_slots = np.zeros((len(stacks), rank, d_in), dtype), np.zeros((len(stacks), d_out, rank), dtype)
            for s, part in enumerate(parts):
                if part:
                    a = np.concatenate([a for a, _ in part])
                    a_slots[s, :len(a)], b_slots[s, :, :len(a)] = a, np.concatenate([b for _, b in part], axis=1)
            self.slots[module] = (a_slots, b_slots)

    def __call__(self, module: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The base output `y` of linear `module` on input `x`, plus every row's own LoRA delta."""
        if module not in self.slots:
            return y
        a, b = self.slots[module]
        return ops.lora_bgmv(x, y, a, b, None, self.index)


class NumpyControlNet:
    """The branch over its state dict (diffusers' SD3 names, as `WanControlNet` writes them): the control latent's
    zero-init patch projection added to the base's patch tokens, the copied blocks, each block's zero-init output."""

    def __init__(self, config: WanDiTConfig, depth: int, state: dict[str, np.ndarray]):
        self.depth, self.branch = depth, NumpyWanDiT(config, state)

    def __call__(self, h, control, modulation, context, grid, text_mask):
        """The residual after each branch block, (B, L, D) each, for base tokens `h` and control latents."""
        branch = self.branch
        h = h + branch.patchify("control_embedding", control.astype(h.dtype))
        outputs = []
        for i in range(self.depth):
            h = branch.block(i, h, context, modulation, grid, text_mask)
            outputs.append(branch._linear(f"controlnet_blocks.{i}", h))
        return outputs


@dataclass
class NumpyControlRows:
    """One ControlNet's work in a batch: the rows it conditions, their control latents (k, C, F, H, W) and
    conditioning scales (k,)."""

    net: NumpyControlNet
    rows: np.ndarray
    latents: np.ndarray
    scales: np.ndarray

    def __call__(self, h, modulation, context, grid, text_mask):
        mask = None if text_mask is None else text_mask[self.rows]
        outputs = self.net(h[self.rows], self.latents, modulation[self.rows], context[self.rows], grid, mask)
        return self.rows, [o * self.scales[:, None, None].astype(o.dtype) for o in outputs]


def adapter_plan(stacks: list[tuple], index: list[int], nets: dict[object, list[tuple]]) -> dict:
    """`lora` and `control` for the numpy DiT's call, as `adapter_rows.adapter_arguments` makes them for torch's."""
    control = [NumpyControlRows(net, np.array([r for r, _, _ in uses]),
                                np.concatenate([np.asarray(latent) for _, latent, _ in uses]),
                                np.array([scale for _, _, scale in uses]))
               for net, uses in nets.items()]
    return {"lora": NumpyLoraPlan(stacks, index) if stacks else None, "control": control or None}


@contextlib.contextmanager
def fused(model: NumpyWanDiT, stack: tuple):
    """One stack merged into the base weights (`W0 + Σ scale·(α/r)·B·A`) for the block; the original arrays are
    put back on exit."""
    originals = {}
    try:
        for module in sorted({m for lora, _ in stack for m in lora.a}):
            key = f"{module}.weight"
            originals[key] = model.state[key]
            merged = originals[key].copy()
            for lora, scale in stack:
                if module in lora.a:
                    merged += lora.delta(module, scale).astype(merged.dtype)
            model.state[key] = merged
        yield model
    finally:
        model.state.update(originals)
