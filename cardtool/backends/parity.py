"""`cardtool parity`: every available kernel cell run on seeded inputs and compared to its oracle.

float64 and float32 cells are compared with the numpy reference (computed in float64 on the same,
dtype-rounded inputs); float16/bfloat16 cells, and the bf16 variants, with the same op in float32 on the
same device — as PyTorch's own tests do. Tolerances are per dtype, with per-op entries where an op's
conditioning differs (an error `e` passes where |e| ≤ atol + rtol·|expected| element-wise).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from cardtool.backends.platform import Platform
from cardtool.backends.registry import KERNELS, Cell

__all__ = ["TOLERANCES", "ParityRow", "as_dtype", "as_float64", "cases", "compare_arrays", "fixed_on", "is_case",
           "rounded_to", "run_parity"]

# dtype → op → (atol, rtol); "*" is the dtype's default.
TOLERANCES: dict[str, dict[str, tuple[float, float]]] = {
    "float64": {"*": (1e-10, 1e-10)},
    "float32": {"*": (1e-5, 1e-5),
                # cos/sin of arguments up to 1000 rad: float32 rounding of the argument alone is ~6e-5
                "timestep_embedding": (2e-4, 1e-5)},
    # "generate": a card's whole 3-step generation against float32 (card_parity.py). Each forward's error is
    # the per-op one through the network's depth; CFG multiplies it by up to 2w + 1 (7 at the parity requests'
    # w = 3) and the steps add up. Measured on fashion-base: 2.9e-3 (float16), 2.1e-2 (bfloat16).
    "float16": {"*": (2e-3, 2e-3), "generate": (1e-2, 2e-3)},
    "bfloat16": {"*": (1.6e-2, 1.6e-2),
                 # x·A·B rounds x, A, B and the rank-r product to 8 bits each (~4 × 2⁻⁹ on terms of size ~3),
                 # like PyTorch's own bf16 overrides for bmm/baddbmm
                 "lora_bgmv": (5e-2, 1.6e-2),
                 "generate": (8e-2, 1.6e-2)},
}


@dataclass
class ParityRow:
    cell: str
    dtype: str
    against: str  # "numpy" or the torch op in float32
    shapes: list[str]
    max_abs_err: float
    max_rel_err: float
    atol: float
    rtol: float
    passed: bool
    error: str = ""
    source: str = "builtin"  # the distribution whose entry point registered the cell checked

    def to_json(self) -> dict:
        """Errors that are not finite (inf or NaN outputs) are null: strict JSON has no inf or NaN."""
        row = asdict(self)
        for key in ("max_abs_err", "max_rel_err"):
            row[key] = row[key] if math.isfinite(row[key]) else None
        return row


@dataclass
class Case:
    shapes: str
    floats: dict  # float64 arrays or python floats, converted to the cell's dtype
    fixed: dict  # integer/boolean arrays and parameters, passed as they are


def cases(op: str) -> list[Case]:
    """Seeded inputs at several shapes for `op`, covering its options (masks, per-sample σ, adapters); for an op a
    plugin adds, those it registers (`kernels.register_inputs`, registry.ParityInputs)."""
    if op in _CASES:
        return _CASES[op](np.random.default_rng(0))
    given = KERNELS.parity_inputs(op)
    if given is None:
        raise KeyError(f"no parity inputs for op '{op}': the plugin that adds it registers none "
                       "(kernels.register_inputs)")
    made = given.load()(np.random.default_rng(0))
    if not isinstance(made, (list, tuple)) or not made or not all(is_case(item) for item in made):
        raise TypeError(f"{given.target} ({given.source}), the parity inputs of '{op}', must return a list of "
                        f"(label, floats, fixed): text, then two dicts of keyword arguments; got {made!r}"[:400])
    return [Case(label, dict(floats), dict(fixed)) for label, floats, fixed in made]


def is_case(item, texts: int = 1) -> bool:
    """Whether a plugin's parity input is `texts` texts (an op's label; a component's label and method), then two
    dicts of keyword arguments (floats, fixed)."""
    return isinstance(item, (list, tuple)) and len(item) == texts + 2 and all(
        isinstance(t, str) for t in item[:texts]) and all(
        isinstance(part, dict) and all(isinstance(k, str) for k in part) for part in item[texts:])


def _flow_match_step(rng):
    n = rng.standard_normal
    return [Case("2x4x1x8x8, per-sample σ", dict(x=n((2, 4, 1, 8, 8)), v=n((2, 4, 1, 8, 8)),
                                                sigma=np.array([1.0, 0.5]), sigma_next=np.array([0.9, 0.25])), {}),
            Case("1x16x1x4x4, scalar σ", dict(x=n((1, 16, 1, 4, 4)), v=n((1, 16, 1, 4, 4)), sigma=0.75,
                                              sigma_next=0.5), {})]


def _flow_sde_step(rng):
    n = rng.standard_normal
    return [Case("2x4x1x8x8, σ=1 first step", dict(x=n((2, 4, 1, 8, 8)), v=n((2, 4, 1, 8, 8)),
                                                  sigma=np.array([1.0, 0.5]), sigma_next=np.array([0.9, 0.4]),
                                                  noise=n((2, 4, 1, 8, 8))), {"eta": 0.7}),
            Case("3x4x1x4x4, scoring a recorded sample", dict(x=n((3, 4, 1, 4, 4)), v=n((3, 4, 1, 4, 4)), sigma=0.3,
                                                             sigma_next=0.0, prev_sample=n((3, 4, 1, 4, 4))),
                 {"eta": 0.7})]


def _flow_renoise_step(rng):
    n = rng.standard_normal
    return [Case("2x4x1x8x8, per-sample σ, last step", dict(x=n((2, 4, 1, 8, 8)), v=n((2, 4, 1, 8, 8)),
                                                          sigma=np.array([1.0, 0.25]), sigma_next=np.array([0.5, 0.0]),
                                                          noise=n((2, 4, 1, 8, 8))), {}),
            Case("3x4x1x4x4, scalar σ", dict(x=n((3, 4, 1, 4, 4)), v=n((3, 4, 1, 4, 4)), sigma=0.75, sigma_next=0.5,
                                              noise=n((3, 4, 1, 4, 4))), {})]


def _flow_dpm_step(rng):
    n = rng.standard_normal
    return [Case("2x4x1x8x8, second order and the last step", dict(x=n((2, 4, 1, 8, 8)), v=n((2, 4, 1, 8, 8)),
                                                                sigma=np.array([0.6, 0.2]),
                                                                sigma_next=np.array([0.4, 0.0]),
                                                                x0_prev=n((2, 4, 1, 8, 8)), c=np.array([0.75, 0.0])),
                 {}),
            Case("3x4x1x4x4, scalar σ, first order", dict(x=n((3, 4, 1, 4, 4)), v=n((3, 4, 1, 4, 4)), sigma=1.0,
                                                          sigma_next=0.8, x0_prev=np.zeros((3, 4, 1, 4, 4)), c=0.0),
                 {})]


def _cfg_combine(rng):
    n = rng.standard_normal
    return [Case("2x4x1x8x8, per-sample w", dict(v_uncond=n((2, 4, 1, 8, 8)), v_cond=n((2, 4, 1, 8, 8)),
                                                scale=np.array([1.0, 4.5])), {}),
            Case("3x16, w=7.5", dict(v_uncond=n((3, 16)), v_cond=n((3, 16)), scale=7.5), {})]


def _attention(rng):
    n = rng.standard_normal
    padding = np.ones((2, 1, 1, 7), dtype=bool)
    padding[1, ..., 4:] = False
    full = rng.random((1, 2, 5, 9)) > 0.3
    full[0, 1, 2] = False  # a query with nothing to attend to
    return [Case("2x4x16x32", dict(q=n((2, 4, 16, 32)), k=n((2, 4, 16, 32)), v=n((2, 4, 16, 32))), {}),
            Case("2x2x12x16 · 7 keys, padding mask", dict(q=n((2, 2, 12, 16)), k=n((2, 2, 7, 16)),
                                                          v=n((2, 2, 7, 16))), {"mask": padding}),
            Case("1x2x5x8 · 9 keys, full mask with an empty row", dict(q=n((1, 2, 5, 8)), k=n((1, 2, 9, 8)),
                                                                       v=n((1, 2, 9, 8))), {"mask": full}),
            Case("1x2x8x16 · 80 keys", dict(q=n((1, 2, 8, 16)), k=n((1, 2, 80, 16)), v=n((1, 2, 80, 16))), {})]


def _gelu_tanh(rng):
    return [Case("4x64, |x| up to ~10", dict(x=3 * rng.standard_normal((4, 64))), {}),
            Case("2x3x33 around the knee", dict(x=np.linspace(-4, 4, 198).reshape(2, 3, 33)), {})]


def _linear(rng):
    n = rng.standard_normal
    return [Case("2x16x32 → 48, bias", dict(x=n((2, 16, 32)), weight=n((48, 32)) / 32**0.5, bias=n(48)), {}),
            Case("3x32 → 24, no bias", dict(x=n((3, 32)), weight=n((24, 32)) / 32**0.5), {}),
            Case("2x8x32 → 64, bias, gelu_tanh", dict(x=n((2, 8, 32)), weight=n((64, 32)) / 32**0.5, bias=n(64)),
                 {"activation": "gelu_tanh"})]


def _rms_norm(rng):
    n = rng.standard_normal
    return [Case("2x16x32, weight", dict(x=n((2, 16, 32)), weight=1 + 0.1 * n(32)), {}),
            Case("3x7x64", dict(x=3 * n((3, 7, 64))), {})]


def _modulated_layer_norm(rng):
    n = rng.standard_normal
    return [Case("2x16x32", dict(x=n((2, 16, 32)), shift=n((2, 1, 32)), scale=0.5 * n((2, 1, 32))), {})]


def _rope_3d(rng):
    n = rng.standard_normal
    return [Case("2x2x32x24, grid 2x4x4", dict(x=n((2, 2, 32, 24))), {"grid": (2, 4, 4)}),
            Case("1x4x36x64, grid 1x6x6", dict(x=n((1, 4, 36, 64))), {"grid": (1, 6, 6)})]


def _timestep_embedding(rng):
    return [Case("4 steps, dim 256", dict(t=np.array([0.0, 1.5, 500.0, 999.0])), {"dim": 256}),
            Case("3 steps, dim 33", dict(t=np.array([3.0, 250.0, 1000.0])), {"dim": 33})]


def _lora_bgmv(rng):
    # A and B at the scale of trained adapters (fan-in normalised), not raw N(0, 1)
    n = rng.standard_normal
    return [Case("5x6x32 → 48, 3 adapters r=4", dict(x=n((5, 6, 32)), y=n((5, 6, 48)), lora_a=n((3, 4, 32)) / 32**0.5,
                                                     lora_b=n((3, 48, 4)) / 2, scales=np.array([1.0, 0.5, 2.0])),
                 {"index": np.array([0, -1, 2, 1, 0])}),
            Case("4x16 → 8, 2 adapters r=2", dict(x=n((4, 16)), y=n((4, 8)), lora_a=n((2, 2, 16)) / 4,
                                                  lora_b=n((2, 8, 2)) / 2**0.5, scales=np.array([1.0, 0.25])),
                 {"index": np.array([-1, -1, 1, 0])}),
            Case("3x4x16 → 24, gathered per sample r=3", dict(x=n((3, 4, 16)), y=n((3, 4, 24)),
                                                          lora_a=n((3, 3, 16)) / 4, lora_b=n((3, 24, 3)) / 3**0.5,
                                                          scales=np.array([1.0, 0.0, 0.5])), {"index": None})]


_CASES = {"flow_match_step": _flow_match_step, "flow_sde_step": _flow_sde_step,
          "flow_renoise_step": _flow_renoise_step, "flow_dpm_step": _flow_dpm_step, "cfg_combine": _cfg_combine,
          "attention": _attention, "rms_norm": _rms_norm, "modulated_layer_norm": _modulated_layer_norm,
          "rope_3d": _rope_3d, "timestep_embedding": _timestep_embedding, "lora_bgmv": _lora_bgmv,
          "gelu_tanh": _gelu_tanh, "linear": _linear}


def parity_checks(platform: Platform, op: str | None = None) -> list[tuple[Cell, str]]:
    """Each (available non-reference cell, dtype) on `platform` that parity compares, optionally for one op."""
    checks = []
    for cell in KERNELS.cells():
        if cell.reference or (op is not None and cell.key[0] != op) or KERNELS.reasons(cell, platform):
            continue
        # float32 always runs against numpy: the low-precision rows compare with the op in float32
        checks += [(cell, dtype) for dtype in (cell.dtypes if "float32" in cell.dtypes else ("float32",) + cell.dtypes)]
    return checks


def run_parity(platform: Platform, op: str | None = None, on_row=None) -> list[ParityRow]:
    """A row per check of `parity_checks`, calling `on_row()` after each."""
    rows = []
    for cell, dtype in parity_checks(platform, op):
        rows.append(_check(cell, dtype, platform))
        if on_row:
            on_row()
    return rows


def _check(cell: Cell, dtype: str, platform: Platform) -> ParityRow:
    op, device, variant = cell.key[0], cell.key[1], cell.key[3]
    low = dtype in ("float16", "bfloat16") or variant == "bf16"
    atol, rtol = _tolerance(op, "bfloat16" if variant == "bf16" else dtype)
    against = "numpy float64" if not low else f"{op} in float32"
    row = ParityRow(cell.name, dtype, against, [], 0.0, 0.0, atol, rtol, True, source=cell.source)
    try:
        fn = cell.load()
        # a bf16 variant against the device's portable float32 op (itself held to numpy), not this tier's, so
        # a wrong float32 cell fails alone rather than taking the tier's bf16 cell down with it
        oracle = (KERNELS.resolve(op, Platform(device, "generic"), "default")[1] if variant == "bf16"
                  else fn if low else KERNELS.resolve(op, Platform("numpy", "generic"))[1])
        for case in cases(op):
            rounded = {k: rounded_to(v, dtype) for k, v in case.floats.items()}
            actual = as_float64(fn(**as_dtype(rounded, device, dtype), **fixed_on(case.fixed, device)))
            if low:
                expected = as_float64(oracle(**as_dtype(rounded, device, "float32"), **fixed_on(case.fixed, device)))
            else:
                expected = as_float64(oracle(**rounded, **case.fixed))
            for a, e in zip(actual, expected, strict=True):
                abs_err, rel_err, ok = compare_arrays(a, e, atol, rtol)
                row.max_abs_err, row.max_rel_err = max(row.max_abs_err, abs_err), max(row.max_rel_err, rel_err)
                row.passed &= ok
            row.shapes.append(case.shapes)
    except Exception as error:  # noqa: BLE001 - a crashing kernel is a failed cell, reported, not a crash
        row.passed, row.error = False, f"{type(error).__name__}: {error}"
    return row


def _tolerance(op: str, dtype: str) -> tuple[float, float]:
    table = TOLERANCES[dtype]
    given = KERNELS.parity_inputs(op) if op not in table else None  # a plugin op's own, where it gives them
    return given.tolerances.get(dtype, table["*"]) if given is not None else table.get(op, table["*"])


def rounded_to(value, dtype: str):
    """`value` rounded to `dtype` and back to float64, so every implementation sees the same numbers."""
    if dtype in ("float64", "float32", "float16"):
        return np.asarray(value, dtype=dtype).astype(np.float64) if isinstance(value, np.ndarray) else \
            float(np.asarray(value, dtype=dtype))
    import torch

    rounded = torch.as_tensor(np.asarray(value, dtype=np.float64)).to(torch.bfloat16).double().numpy()
    return rounded if isinstance(value, np.ndarray) else float(rounded)


def as_dtype(values: dict, device: str, dtype: str) -> dict:
    """The float arguments as the cell takes them: arrays in `dtype`, tensors on a torch device."""
    if device == "numpy":
        return {k: v.astype(dtype) if isinstance(v, np.ndarray) else v for k, v in values.items()}
    import torch

    torch_dtype = getattr(torch, dtype)
    return {k: torch.as_tensor(v, device=device).to(torch_dtype) if isinstance(v, np.ndarray) else v
            for k, v in values.items()}


def fixed_on(values: dict, device: str) -> dict:
    """The fixed arguments (integer and boolean arrays, options) as they are, arrays as tensors on a torch device."""
    if device == "numpy":
        return values
    import torch

    return {k: torch.as_tensor(v, device=device) if isinstance(v, np.ndarray) else v for k, v in values.items()}


def as_float64(result) -> list[np.ndarray]:
    """A cell's output (one array or tensor, or a tuple of them) as float64 numpy arrays."""
    items = result if isinstance(result, tuple) else (result,)
    out = []
    for item in items:
        if hasattr(item, "detach"):
            item = item.detach().float().cpu().double().numpy() if item.dtype.is_floating_point and \
                item.element_size() < 4 else item.detach().cpu().double().numpy()
        out.append(np.asarray(item, dtype=np.float64))
    return out


def compare_arrays(actual: np.ndarray, expected: np.ndarray, atol: float, rtol: float) -> tuple[float, float, bool]:
    """(max abs error, max relative error where |expected| > atol, whether |a − e| ≤ atol + rtol·|e| everywhere). An
    infinity matches only the same infinity; a NaN on either side matches nothing (no number to compare)."""
    finite = np.isfinite(actual)
    if actual.shape != expected.shape or np.isnan(actual).any() or np.isnan(expected).any() or \
            not np.array_equal(finite, np.isfinite(expected)) or not np.array_equal(actual[~finite], expected[~finite]):
        return float("inf"), float("inf"), False
    actual, expected = np.where(finite, actual, 0.0), np.where(finite, expected, 0.0)
    diff = np.abs(actual - expected)
    meaningful = np.abs(expected) > atol
    rel = float((diff[meaningful] / np.abs(expected[meaningful])).max()) if meaningful.any() else 0.0
    return float(diff.max(initial=0.0)), rel, bool(np.all(diff <= atol + rtol * np.abs(expected)))
