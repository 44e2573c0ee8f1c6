"""Component parity (`cardtool parity --card`): a card's torch DiT and VAE decode against their numpy
forwards on the card's own weights — float64 tightly, float32 within a tolerance for deep networks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cardtool.backends.parity import ParityRow, compare_arrays
from cardtool.backends.platform import Platform
from cardtool.backends.precision import full_float32
from cardtool.backends.registry import COMPONENTS

__all__ = ["COMPONENT_TOLERANCES", "component_rows"]

# dtype → (atol, rtol) for whole networks: float32 error grows with depth, float64 should stay at rounding
COMPONENT_TOLERANCES = {"float64": (1e-9, 1e-9), "float32": (1e-4, 1e-4)}


def component_rows(name: str, impl: str, config: dict, weights: Path, platform: Platform) -> list[ParityRow]:
    """Rows for one component if it has a numpy forward (wan-dit, conv-vae decode), else none."""
    if impl not in ("wan-dit", "conv-vae") or platform.device == "numpy":
        return []
    rows = []
    for dtype in ("float64", "float32"):
        atol, rtol = COMPONENT_TOLERANCES[dtype]
        label = f"{name}:{impl}/{platform.device}/generic"  # the op column shows the component
        row = ParityRow(label, dtype, "numpy float64", [], 0.0, 0.0, atol, rtol, True)
        try:
            torch_model = COMPONENTS.resolve(impl, platform)[1](config, weights, None, platform, dtype)
            numpy_model = COMPONENTS.resolve(impl, Platform("numpy", "generic"))[1](config, weights, None,
                                                                                     platform, "float64")
            for shapes, actual, expected in _run(impl, torch_model, numpy_model, platform, dtype):
                abs_err, rel_err, ok = compare_arrays(actual, expected, atol, rtol)
                row.max_abs_err, row.max_rel_err = max(row.max_abs_err, abs_err), max(row.max_rel_err, rel_err)
                row.passed &= ok
                row.shapes.append(shapes)
        except Exception as error:  # noqa: BLE001 - a component that cannot run is a failed row
            row.passed, row.error = False, f"{type(error).__name__}: {error}"
        rows.append(row)
    return rows


def _run(impl, torch_model, numpy_model, platform, dtype):
    import torch

    device = platform.torch_device
    rng = np.random.default_rng(0)
    tensor = lambda a: torch.as_tensor(a, device=device).to(getattr(torch, dtype))  # noqa: E731
    rounded = lambda a: a.astype(dtype).astype(np.float64)  # noqa: E731 - both sides see the same numbers
    if impl == "wan-dit":
        c = torch_model.config
        # a grid the patch tiles, at least 2 patches a side (a patch of 3 or 16 does not tile 8 × 8)
        frames, rows, cols = c.patch[0], c.patch[1] * max(2, 8 // c.patch[1]), c.patch[2] * max(2, 8 // c.patch[2])
        x = rounded(rng.standard_normal((2, c.in_channels, frames, rows, cols)))
        t = np.array([999.0, 250.0])
        text = rounded(rng.standard_normal((2, 8, c.text_dim)))
        mask = np.ones((2, 8), dtype=bool)
        mask[1, 5:] = False
        with torch.no_grad(), full_float32(platform):
            actual = torch_model(tensor(x), tensor(t), tensor(text), torch.as_tensor(mask, device=device))
        yield f"2x{c.in_channels}x{frames}x{rows}x{cols}, text 2x8 masked", actual.double().cpu().numpy(), \
            numpy_model(x, t, text, mask)
    else:
        c = torch_model.config
        z = rounded(rng.standard_normal((2, c.latent_channels, c.latent_size, c.latent_size)))
        with torch.no_grad(), full_float32(platform):
            actual = torch_model.decode(tensor(z))
        yield f"decode 2x{c.latent_channels}x{c.latent_size}x{c.latent_size}", actual.double().cpu().numpy(), \
            numpy_model.decode(z)
