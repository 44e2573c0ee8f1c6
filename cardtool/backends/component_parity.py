"""Component parity (`cardtool parity --card`): a card's component, built by the platform's cell, against its numpy
forward on the card's own weights — float64 tightly, float32 within a tolerance for deep networks — on the inputs
its implementation registers (`components.register_inputs`; the DiT's, the VAE's, the judge classifier's and the
text encoder's are below)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from cardtool.backends.parity import ParityRow, as_dtype, as_float64, compare_arrays, fixed_on, is_case, rounded_to
from cardtool.backends.platform import Platform
from cardtool.backends.precision import full_float32
from cardtool.backends.registry import COMPONENTS, NoCellAvailable
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.backends.wan_config import WanDiTConfig

__all__ = ["COMPONENT_TOLERANCES", "component_rows", "conv_vae_inputs", "fashion_cnn_inputs", "hf_encoder_inputs",
           "wan_dit_inputs"]

# dtype → (atol, rtol) for whole networks: float32 error grows with depth, float64 should stay at rounding
COMPONENT_TOLERANCES = {"float64": (1e-9, 1e-9), "float32": (1e-4, 1e-4)}
NUMPY = Platform("numpy", "generic")


def component_rows(name: str, impl: str, config: dict, weights: Path | None, platform: Platform,
                   source: Path | None = None) -> list[ParityRow]:
    """Rows for one component whose implementation has a numpy forward or parity inputs, else none; on numpy, or
    where the platform's chain ends at the numpy forward itself, there is nothing to compare either."""
    inputs = COMPONENTS.parity_inputs(impl)
    numpy_forward = any(c.key[0] == impl and c.key[1] == "numpy" for c in COMPONENTS.cells())
    if platform.device == "numpy" or not (inputs or numpy_forward):
        return []
    try:
        cell = COMPONENTS.resolve(impl, platform)[0]
    except NoCellAvailable:
        cell = None  # each row says why
    if cell is not None and cell.key[1] == "numpy":
        return []
    given = inputs.tolerances if inputs else {}
    failure, numpy_model = None, None  # the numpy forward, built once: its float64 serves both rows
    try:
        numpy_build = COMPONENTS.resolve(impl, NUMPY)[1]
    except NoCellAvailable as error:  # inputs without a numpy forward: each row says so
        failure = error
    else:
        if inputs is not None and cell is not None:
            try:
                numpy_model = numpy_build(config, weights, source, platform, "float64")
            except NoCellAvailable:  # the forward refuses this one (a text encoder not BERT's): `unchecked` says so
                return []
            except Exception as error:  # noqa: BLE001 - a failed row, as below
                failure = error
    rows, references = [], {}  # numpy's outputs of a case without floats: the same inputs at every dtype
    for dtype in ("float64", "float32"):
        atol, rtol = given.get(dtype, COMPONENT_TOLERANCES[dtype])
        label = f"{name}:{impl}/{platform.device}/generic"  # the op column shows the component
        row = ParityRow(label, dtype, "numpy float64", [], 0.0, 0.0, atol, rtol, True,
                        source=getattr(cell or inputs, "source", "builtin"))
        try:
            if inputs is None:
                raise LookupError(f"'{impl}' has a numpy forward but no parity inputs: the plugin that adds it "
                                  "registers none (components.register_inputs)")
            torch_model = COMPONENTS.resolve(impl, platform)[1](config, weights, source, platform, dtype)
            if failure is not None:
                raise failure
            for k, case in enumerate(_cases(inputs, config)):
                key = (k, dtype if case[2] else "")
                actual, expected = _run(case, torch_model, numpy_model, platform, dtype, references.get(key))
                references[key] = expected
                for a, e in zip(actual, expected, strict=True):
                    abs_err, rel_err, ok = compare_arrays(a, e, atol, rtol)
                    row.max_abs_err, row.max_rel_err = max(row.max_abs_err, abs_err), max(row.max_rel_err, rel_err)
                    row.passed &= ok
                row.shapes.append(case[0])
        except Exception as error:  # noqa: BLE001 - a component that cannot run is a failed row
            row.passed, row.error = False, f"{type(error).__name__}: {error}"
        rows.append(row)
    return rows


def _run(case: tuple, torch_model, numpy_model, platform: Platform, dtype: str,
         expected: list | None = None) -> tuple[list, list]:
    """The outputs of one case's method, by torch in `dtype` (in full float32 on CUDA) and by numpy in float64 (unless
    `expected` holds them already), on the same inputs rounded to `dtype`."""
    import torch

    _, method, floats, fixed = case
    rounded = {k: rounded_to(v, dtype) for k, v in floats.items()}
    with torch.no_grad(), full_float32(platform):
        actual = as_float64(getattr(torch_model, method)(**as_dtype(rounded, platform.torch_device, dtype),
                                                       **fixed_on(fixed, platform.torch_device)))
    return actual, expected if expected is not None else as_float64(getattr(numpy_model, method)(**rounded, **fixed))


def _cases(inputs, config: dict) -> list[tuple]:
    made = inputs.load()(copy.deepcopy(config), np.random.default_rng(0))  # the card's own stays as loaded
    if not isinstance(made, (list, tuple)) or not made or not all(is_case(item, texts=2) for item in made):
        raise TypeError(f"{inputs.target} ({inputs.source}), the parity inputs of '{inputs.name}', must return a list "
                        f"of (label, method, floats, fixed): two texts, then two dicts of keyword arguments; got "
                        f"{made!r}"[:400])
    return made


def wan_dit_inputs(config: dict, rng) -> list[tuple]:
    """Two latents at noise levels 999 and 250 with 8 text tokens, the second's last three masked, on a grid the
    patch tiles with at least 2 patches a side (a patch of 3 or 16 does not tile 8 × 8)."""
    c = WanDiTConfig.from_card(config, "wan-dit")
    frames, rows, cols = c.patch[0], c.patch[1] * max(2, 8 // c.patch[1]), c.patch[2] * max(2, 8 // c.patch[2])
    mask = np.ones((2, 8), dtype=bool)
    mask[1, 5:] = False
    floats = dict(x=rng.standard_normal((2, c.in_channels, frames, rows, cols)), t=np.array([999.0, 250.0]),
                  text=rng.standard_normal((2, 8, c.text_dim)))
    return [(f"2x{c.in_channels}x{frames}x{rows}x{cols}, text 2x8 masked", "__call__", floats, {"text_mask": mask})]


def conv_vae_inputs(config: dict, rng) -> list[tuple]:
    """Two latents at the VAE's latent size, decoded; two images (uniform in [−1, 1]), encoded."""
    c = ConvVAEConfig.from_card(config, "conv-vae")
    z = rng.standard_normal((2, c.latent_channels, c.latent_size, c.latent_size))
    images = rng.uniform(-1.0, 1.0, (2, c.image_channels, c.image_size, c.image_size))
    return [(f"decode 2x{c.latent_channels}x{c.latent_size}x{c.latent_size}", "decode", {"latents": z}, {}),
            (f"encode 2x{c.image_channels}x{c.image_size}x{c.image_size}", "encode", {"images": images}, {})]


def fashion_cnn_inputs(config: dict, rng) -> list[tuple]:
    """Three images (uniform in [−1, 1]) at the CNN's 28 × 28 (7 × 7 after its two pools): their features (what
    FID is computed on) and their logits."""
    images = rng.uniform(-1.0, 1.0, (3, 1, 28, 28))
    return [("features of 3x1x28x28", "embed", {"images": images}, {}),
            ("logits of 3x1x28x28", "__call__", {"images": images}, {})]


def hf_encoder_inputs(config: dict, rng) -> list[tuple]:
    """Four prompts, one empty (the null condition) and one past `max_length` (cut there), encoded together."""
    prompts = ["an ankle boot", "", "a long pleated summer dress with a belt, buttons, two pockets and a wide collar "
               "in a light fabric", "a bag"]
    return [("4 prompts, one empty, one cut at max_length", "__call__", {}, {"prompts": prompts})]
