"""Parity of a card: each component with a numpy forward, run by torch and by numpy on the card's weights;
a short generation through the denoise loop on the torch platform and on the numpy platform, comparing the final
latents (the same loop, the same seeds, the same cached text features) — with no adapter, and with each of the card's
adapters in one mixed batch; and the consistency the card's manifest promises (`parity.consistency`, a level of the
schema's LADDER), checked on this platform."""

from __future__ import annotations

import functools
import math

import numpy as np

from cardtool.backends.component_parity import COMPONENT_TOLERANCES, component_rows
from cardtool.backends.parity import TOLERANCES, ParityRow, compare_arrays
from cardtool.backends.platform import Platform
from cardtool.backends.registry import COMPONENTS, NoCellAvailable
from cardtool.core.cards.loader import Card
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache, encode_prompts

__all__ = ["card_parity", "card_parts", "adapter_rows", "contract_rows", "generation_rows", "unchecked"]


# one CFG request on the ODE, one unguided request on the SDE with a shifted grid, one on the re-noising rule, one
# guided on DPM-Solver++(2M) (its third step the first second-order one)
PARITY_REQUESTS = (Request("an ankle boot", seed=0, steps=3, guidance=3.0, guidance_interval=(0.0, 0.7)),
                   Request("", seed=1, steps=3, guidance=1.0, shift=2.0, solver="sde"),
                   Request("a bag", seed=2, steps=3, guidance=1.0, solver="renoise"),
                   Request("a coat", seed=3, steps=4, guidance=2.0, solver="dpmpp_2m"))


def card_parity(card: Card, platform: Platform, on_part=None) -> list[ParityRow]:
    """The rows of each part of `card_parts`, calling `on_part()` after each."""
    rows = []
    for part in card_parts(card, platform):
        rows += part()
        if on_part:
            on_part()
    return rows


def card_parts(card: Card, platform: Platform) -> list:
    """What `parity --card` runs, in order, each a call giving rows: a component against its numpy forward (each
    one with weights or a source), the generation, the adapters and the contract."""
    parts = [functools.partial(component_rows, name, component.impl, component.config,
                               card.weights_file(name) if component.weights else None, platform,
                               card.source_path(name))
             for name, component in card.manifest.components.items() if component.weights or component.source]
    return parts + [functools.partial(made, card, platform) for made in (generation_rows, adapter_rows, contract_rows)]


def unchecked(card: Card, platform: Platform, rows: list[ParityRow]) -> list[dict]:
    """The card's components and adapters no row held to numpy, each with why: a passing report covers what it
    compared, and a CI gate should see what it did not."""
    out = []
    for name, spec in card.manifest.components.items():
        if _compared(rows, name, spec.impl):
            continue
        if platform.device == "numpy":
            why = "numpy is the reference: nothing to compare it with"
        elif not any(c.key[0] == spec.impl and c.key[1] == "numpy" for c in COMPONENTS.cells()):
            why = f"{spec.impl} has no numpy forward"
        elif not (spec.weights or spec.source):
            why = "it has no weights file or source folder to compare on"
        elif _runs_numpy(spec.impl, platform):
            why = f"the {platform.device} platform runs its numpy forward itself"
        else:  # component_rows had none: the numpy forward refused this one
            why = f"the numpy forward of {spec.impl} does not run this one (numpy's text encoder is BERT's only)" \
                if spec.kind == "text_encoder" else f"the numpy forward of {spec.impl} does not run this one"
        out.append({"name": name, "impl": spec.impl, "why": why})
    for name, adapter in card.manifest.adapters.items():
        if _compared(rows, f"adapters.{name}", adapter.kind):
            continue
        why = ("numpy is the reference: nothing to compare it with" if platform.device == "numpy" else
               f"the card has no {ADAPTER_LOOP} loop to run it in" if ADAPTER_LOOP not in card.manifest.loops else
               "no generation with it was compared")
        out.append({"name": f"adapters.{name}", "impl": adapter.kind, "why": why})
    return out


def _compared(rows: list[ParityRow], name: str, impl: str) -> bool:
    return any(row.cell.startswith(f"{name}:{impl}/") for row in rows)


def _runs_numpy(impl: str, platform: Platform) -> bool:
    try:
        return COMPONENTS.resolve(impl, platform)[0].key[1] == "numpy"
    except NoCellAvailable:
        return False


def contract_rows(card: Card, platform: Platform, loop: str = "denoise") -> list[ParityRow]:
    """The card's promised consistency (LADDER), checked here at its precision on PARITY_REQUESTS — final latents
    and decoded images: C1 two fresh loads (separate instances and text caches) giving the same bits; C2 each request
    alone (its prompt encoded alone) giving the bits it gets in the batch; C3 is the generation rows against numpy;
    C4 needs a second device and fails as unverifiable. On numpy, whose text encoder is BERT's only, each load's cache
    holds the prompts as torch encodes them on the host CPU (as `generate` on numpy reads them from the disk cache),
    so that any card's contract can be checked there."""
    level = int(card.manifest.parity.consistency[1])
    if level == 0 or loop not in card.manifest.loops:
        return []
    precision = card.manifest.recipe.assumes.precision
    name = f"contract:{card.manifest.parity.consistency}/{platform.device}/{platform.arch}"

    def row(what: str, actual: np.ndarray, expected: np.ndarray) -> ParityRow:
        result = ParityRow(name, precision, what, [f"{len(PARITY_REQUESTS)} requests × 3–4 steps"], 0.0, 0.0, 0.0, 0.0,
                           True)
        result.max_abs_err, result.max_rel_err, result.passed = compare_arrays(actual, expected, 0.0, 0.0)
        return result

    # numpy may run no encoder of the card's kind: each load's cache gets the features the disk cache would give it
    encoder = ModelInstance(card, Platform("cpu", "generic"), precision) if platform.device == "numpy" else None
    prompts = [r.prompt for r in PARITY_REQUESTS] + [r.negative_prompt for r in PARITY_REQUESTS]

    def fresh(instance: ModelInstance | None = None) -> DenoiseLoop:
        instance = instance or ModelInstance(card, platform, precision)
        denoise = DenoiseLoop(instance, loop, TextFeatureCache(disk=False))
        if encoder is not None:
            encode_prompts(encoder, prompts, denoise.cache, denoise.text_encoder)
        return denoise

    first = fresh()
    batched = _sampled(first, list(PARITY_REQUESTS))
    rows = [row("a 2nd load", _sampled(fresh(), list(PARITY_REQUESTS)), batched)]
    if level >= 2:  # each alone with a cache of its own: its prompt encoded alone too
        alone = np.concatenate([_sampled(fresh(first.instance), [request]) for request in PARITY_REQUESTS])
        rows.append(row("alone", alone, batched))
    if level >= 4:
        rows.append(ParityRow(name, precision, "another device", [], math.inf, math.inf, 0.0,
                              0.0, False, "needs a second device to compare with; not verifiable on one machine"))
    return rows


def generation_rows(card: Card, platform: Platform, loop: str = "denoise") -> list[ParityRow]:
    """Final latents of the torch platform (float64, float32) against the numpy platform (float64), and at the
    platform's fast low precisions (bfloat16 where it has fast bf16, float16 on CUDA) against its float32."""
    if loop not in card.manifest.loops or platform.device == "numpy":
        return []
    requests, rows = list(PARITY_REQUESTS), []
    for dtype, actual, reference, atol, rtol in _by_precision(card, platform, loop, requests):
        low = dtype not in ("float64", "float32")
        row = ParityRow(f"generate:{loop}/{platform.device}/{platform.arch}", dtype,
                        "the same loop in float32" if low else "numpy float64",
                        [f"{len(requests)} requests × 3–4 steps, mixed precision" if low else
                         f"{len(requests)} requests × 3–4 steps: euler with CFG, sde with shift, renoise, dpmpp_2m"],
                        0.0, 0.0, atol, rtol, True)
        row.max_abs_err, row.max_rel_err, row.passed = compare_arrays(actual, reference, atol, rtol)
        rows.append(row)
    return rows


ADAPTER_LOOP = "denoise"  # the loop `generate` serves adapters in


def adapter_rows(card: Card, platform: Platform) -> list[ParityRow]:
    """Each of the card's adapters in one mixed batch (a request each, at scale 1, a ControlNet's on a fixed control
    image through its preprocessor, beside a request with none), compared as `generation_rows` compares: a row per
    adapter and precision, its request's final latents."""
    adapters = card.manifest.adapters
    if not adapters or ADAPTER_LOOP not in card.manifest.loops or platform.device == "numpy":
        return []
    from cardtool.core.sampling.control import ControlImage

    probe = DenoiseLoop(ModelInstance(card, platform), ADAPTER_LOOP, TextFeatureCache(disk=False))
    size = probe.instance.component(probe.vae).config.image_size
    garment = np.zeros((size, size), np.uint8)  # a bright block with a darker band, the size of a garment
    garment[size // 7:size - size // 7, size // 4:size - size // 4] = 200
    garment[size // 2 - 1:size // 2 + 1, size // 4:size - size // 4] = 90
    requests = [Request("a shirt", seed=7, steps=3, guidance=2.0)]
    for i, (name, spec) in enumerate(adapters.items()):
        control = ControlImage.make(garment, spec.control or "none") if spec.kind == "controlnet" else None
        requests.append(Request(PARITY_REQUESTS[i % len(PARITY_REQUESTS)].prompt or "a bag", seed=8 + i, steps=3,
                                guidance=2.0 if i % 2 else 1.0, adapters=((name, 1.0),), control=control))
    rows = []
    for dtype, actual, reference, atol, rtol in _by_precision(card, platform, ADAPTER_LOOP, requests):
        against = "numpy float64" if dtype in ("float64", "float32") else "the same batch in float32"
        for i, (name, spec) in enumerate(adapters.items(), start=1):
            row = ParityRow(f"adapters.{name}:{spec.kind}/{platform.device}/{platform.arch}", dtype, against,
                            [f"1 of {len(requests)} requests × 3 steps, scale 1" +
                             (f", control '{spec.control or 'none'}'" if spec.kind == "controlnet" else "")],
                            0.0, 0.0, atol, rtol, True)
            row.max_abs_err, row.max_rel_err, row.passed = compare_arrays(actual[i:i + 1], reference[i:i + 1],
                                                                          atol, rtol)
            rows.append(row)
    return rows


def _by_precision(card: Card, platform: Platform, loop: str, requests: list[Request]) -> list[tuple]:
    """(dtype, latents, reference, atol, rtol) of `requests` on the platform: float64 and float32 against the numpy
    platform's float64, the platform's fast low precisions against its float32."""
    cache = TextFeatureCache(disk=False)  # the numpy run reads the features the float64 torch run encodes
    runs = {dtype: _latents(ModelInstance(card, platform, dtype), loop, cache, requests)
            for dtype in ("float64", "float32")}
    expected = _latents(ModelInstance(card, Platform("numpy", "generic"), "float64"), loop, cache, requests)
    out = [(dtype, actual, expected, *COMPONENT_TOLERANCES[dtype]) for dtype, actual in runs.items()]
    low = (["bfloat16"] if platform.supports_bf16 else []) + (["float16"] if platform.device == "cuda" else [])
    for dtype in low:
        out.append((dtype, _latents(ModelInstance(card, platform, dtype), loop, cache, requests), runs["float32"],
                    *TOLERANCES[dtype]["generate"]))
    return out


def _latents(instance: ModelInstance, loop: str, cache: TextFeatureCache, requests: list[Request]) -> np.ndarray:
    states = sample(DenoiseLoop(instance, loop, cache), requests)
    return np.concatenate([instance.arrays.to_numpy(s.latents).astype(np.float64) for s in states])


def _sampled(loop: DenoiseLoop, requests: list[Request]) -> np.ndarray:
    """Each request's final latents and decoded image (its uint8 pixels), one row per request."""
    states = sample(loop, requests)
    latents = np.concatenate([loop.instance.arrays.to_numpy(s.latents).astype(np.float64) for s in states])
    images, _ = loop.decode(states)
    return np.concatenate([latents.reshape(len(states), -1), images.reshape(len(states), -1)], axis=1)
