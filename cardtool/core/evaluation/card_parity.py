"""Parity of a card: each component with a numpy forward, run by torch and by numpy on the card's weights;
and a short generation through the denoise loop on the torch platform and on the numpy platform,
comparing the final latents (the same loop, the same seeds, the same cached text features)."""

from __future__ import annotations

import numpy as np

from cardtool.backends.component_parity import COMPONENT_TOLERANCES, component_rows
from cardtool.backends.parity import TOLERANCES, ParityRow, compare_arrays
from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import Card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache

__all__ = ["card_parity", "generation_rows"]

# one CFG request on the ODE, one unguided request on the SDE with a shifted grid, one on the re-noising rule
PARITY_REQUESTS = (Request("an ankle boot", seed=0, steps=3, guidance=3.0, guidance_interval=(0.0, 0.7)),
                   Request("", seed=1, steps=3, guidance=1.0, shift=2.0, solver="sde"),
                   Request("a bag", seed=2, steps=3, guidance=1.0, solver="renoise"))


def card_parity(card: Card, platform: Platform) -> list[ParityRow]:
    rows = []
    for name, component in card.manifest.components.items():
        if component.weights:
            rows += component_rows(name, component.impl, component.config, card.weights_file(name), platform)
    return rows + generation_rows(card, platform)


def generation_rows(card: Card, platform: Platform, loop: str = "denoise") -> list[ParityRow]:
    """Final latents of the torch platform (float64, float32) against the numpy platform (float64), and at the
    platform's fast low precisions (bfloat16 where it has fast bf16, float16 on CUDA) against its float32."""
    if loop not in card.manifest.loops or platform.device == "numpy":
        return []
    cache = TextFeatureCache(disk=False)  # the numpy run reads the features the float64 torch run encodes
    requests = list(PARITY_REQUESTS)
    runs = {dtype: _latents(ModelInstance(card, platform, dtype), loop, cache, requests)
            for dtype in ("float64", "float32")}
    expected = _latents(ModelInstance(card, Platform("numpy", "generic"), "float64"), loop, cache, requests)
    rows = []
    for dtype, actual in runs.items():
        atol, rtol = COMPONENT_TOLERANCES[dtype]
        row = ParityRow(f"generate:{loop}/{platform.device}/{platform.arch}", dtype, "numpy float64",
                        [f"{len(requests)} requests × 3 steps: euler with CFG, sde with shift, renoise"], 0.0, 0.0,
                        atol, rtol, True)
        row.max_abs_err, row.max_rel_err, row.passed = compare_arrays(actual, expected, atol, rtol)
        rows.append(row)
    low = (["bfloat16"] if platform.supports_bf16 else []) + (["float16"] if platform.device == "cuda" else [])
    for dtype in low:
        actual = _latents(ModelInstance(card, platform, dtype), loop, cache, requests)
        atol, rtol = TOLERANCES[dtype]["generate"]
        row = ParityRow(f"generate:{loop}/{platform.device}/{platform.arch}", dtype, "the same loop in float32",
                        [f"{len(requests)} requests × 3 steps, mixed precision"], 0.0, 0.0, atol, rtol, True)
        row.max_abs_err, row.max_rel_err, row.passed = compare_arrays(actual, runs["float32"], atol, rtol)
        rows.append(row)
    return rows


def _latents(instance: ModelInstance, loop: str, cache: TextFeatureCache, requests: list[Request]) -> np.ndarray:
    states = sample(DenoiseLoop(instance, loop, cache), requests)
    return np.concatenate([instance.arrays.to_numpy(s.latents).astype(np.float64) for s in states])
