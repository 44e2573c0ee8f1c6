"""Compute precision: what `--precision` means on each platform.

float64 and float32 run the components at that dtype (on CUDA with TF32 off: `full_float32`). bfloat16 and float16
are mixed precision, as in training (Micikevicius et al. 2018, "Mixed Precision Training"): the latents, the solver,
norms and modulation stay float32 while the matrix products run in the low dtype under torch autocast, and the
platform's kernel cells of the matching variant are picked (cpu_bf16.py on the avx512_bf16 CPU tier, its float32
emulation cpu_bf16_emulated.py on avx2; the dtype-generic torch ops on CUDA). The DiT's linear and convolution
weights are rounded to the low dtype once at load — the rounding autocast applies to them on every call — so a
low-precision run differs from float32 only by its products.
"""

from __future__ import annotations

import contextlib
import threading

from cardtool.backends.platform import Platform
from cardtool.errors import BadInput

__all__ = ["FLOAT32_MAX", "PRECISIONS", "LOW_PRECISIONS", "autocast", "check_precision", "full_float32",
           "kernel_variant", "weights_dtype"]

PRECISIONS = ("float64", "float32", "bfloat16", "float16")
# the largest float32: training computes in it (torch refuses a larger Python scalar for it), and products run in it
# at most, so a recipe number or an adapter scale beyond it is refused before the work
FLOAT32_MAX = 3.4028234663852886e38
LOW_PRECISIONS = ("bfloat16", "float16")
_VARIANTS = {"bfloat16": "bf16", "float16": "fp16"}  # the registry falls back to `default` where none is registered


def check_precision(platform: Platform, precision: str) -> list[str]:
    """Refuse a precision the platform cannot run; warnings for one it runs slowly."""
    if precision not in PRECISIONS:
        raise BadInput(f"unknown precision '{precision}'; choose one of: {', '.join(PRECISIONS)}")
    if platform.device == "numpy" and precision in LOW_PRECISIONS:
        raise BadInput(f"the numpy platform has no {precision}; use --device cpu, or float32/float64")
    warnings = []
    if precision == "bfloat16" and not platform.supports_bf16:
        warnings.append(f"{platform.device}/{platform.arch} has no fast bfloat16 (avx512_bf16 or CUDA sm80+): "
                        "bfloat16 runs emulated, at best as fast as float32")
    if precision == "float16" and platform.device != "cuda":
        warnings.append("float16 on a CPU is emulated and likely slower than float32; bfloat16 is the CPU's low "
                        "precision")
    return warnings


def weights_dtype(precision: str) -> str:
    """The dtype components hold their weights and activations in: float32 under mixed precision."""
    return "float64" if precision == "float64" else "float32"


def kernel_variant(precision: str) -> str:
    return _VARIANTS.get(precision, "default")


def autocast(platform: Platform, precision: str):
    """The context the components run under: torch autocast to the low dtype; at float32 and float64 on CUDA,
    `full_float32`; else nothing."""
    if platform.device == "numpy":
        return contextlib.nullcontext()
    if precision not in LOW_PRECISIONS:
        return full_float32(platform)
    import torch

    return torch.autocast(device_type=platform.torch_device, dtype=getattr(torch, precision))


@contextlib.contextmanager
def full_float32(platform: Platform):
    """On CUDA, float32 products in IEEE float32 while the context lasts, the caller's settings restored after.
    PyTorch runs cuDNN's float32 convolutions in TF32 on sm80+ by default (10 mantissa bits; it keeps cuBLAS's
    matmuls in float32 unless asked): fashion-base's VAE decoded 4.9e-4 off its numpy float64 forward on an H200,
    and `parity --card` failed its float32 row (atol 1e-4). float32 means float32 here, as it does on the CPU.
    The settings are the process's: the first context in (of any thread, or nested) turns TF32 off, the last out
    restores what the caller had."""
    if platform.device != "cuda":
        yield
        return
    with _tf32_lock:
        if not _tf32_depth[0]:
            _tf32_saved[:] = _tf32_values()
            _set_tf32_values(None)
        _tf32_depth[0] += 1
    try:
        yield
    finally:
        with _tf32_lock:
            _tf32_depth[0] -= 1
            if not _tf32_depth[0]:
                _set_tf32_values(_tf32_saved)


_tf32_lock, _tf32_saved, _tf32_depth = threading.Lock(), [], [0]


def _tf32_places():
    """Where cuDNN's convolutions and cuBLAS's matmuls take their float32 setting, and this torch's value for IEEE.
    torch ≥ 2.9 has per-operator settings and refuses to read the legacy flags once they differ (conv against RNN):
    one API only, whichever this torch has."""
    import torch

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    if hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        return [(cudnn.conv, "fp32_precision"), (matmul, "fp32_precision")], "ieee"
    return [(cudnn, "allow_tf32"), (matmul, "allow_tf32")], False


def _tf32_values() -> list:
    return [getattr(owner, name) for owner, name in _tf32_places()[0]]


def _set_tf32_values(values: list | None) -> None:
    """Set both settings (None: IEEE float32 for both)."""
    places, ieee = _tf32_places()
    for (owner, name), value in zip(places, values or [ieee] * len(places), strict=True):
        setattr(owner, name, value)
