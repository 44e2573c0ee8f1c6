"""Array namespaces: the few framework operations the denoise loop needs (make, join, read back, inference),
so the one loop runs torch components on cpu/cuda and the numpy reference forwards on the numpy rung."""

from __future__ import annotations

import contextlib
import gc
import sys

import numpy as np

from cardtool.backends.platform import Platform
from cardtool.backends.precision import autocast, weights_dtype

__all__ = ["NumpyArrays", "TorchArrays", "arrays_numpy", "arrays_torch"]


class NumpyArrays:
    def __init__(self, dtype: str):
        self.dtype = np.dtype(dtype)

    def asarray(self, value):
        value = np.asarray(value)
        return value if value.dtype == bool or value.dtype.kind in "iu" else value.astype(self.dtype)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def to_state(self, x):
        return x

    def cat(self, xs):
        return np.concatenate(xs)

    def inference(self):
        return contextlib.nullcontext()

    def compute(self):
        return contextlib.nullcontext()

    def grad_enabled(self) -> bool:
        return False


class TorchArrays:
    """Tensors at the weights' dtype; `inference()` adds the precision's autocast (mixed precision)."""

    def __init__(self, platform: Platform, precision: str):
        torch = _import_torch()
        self.torch, self.device = torch, platform.torch_device
        self.dtype = getattr(torch, weights_dtype(precision))
        self._platform, self._precision = platform, precision

    def asarray(self, value):
        tensor = self.torch.as_tensor(np.asarray(value), device=self.device)
        return tensor if tensor.dtype in (self.torch.bool, self.torch.int64) else tensor.to(self.dtype)

    def to_state(self, x):
        """A component's output (low precision under autocast) in the dtype of the loop's state."""
        return x.to(self.dtype)

    def to_numpy(self, x) -> np.ndarray:
        x = x.detach()
        return (x.float() if x.dtype in (self.torch.bfloat16, self.torch.float16) else x).cpu().numpy()

    def cat(self, xs):
        return self.torch.cat(xs)

    def inference(self):
        # inference_mode, not no_grad: no version counters or view tracking (issue 11 measured ~1.1× at batch 1);
        # what it makes cannot enter autograd later, so rollouts that train (grad=True) never run under it
        stack = contextlib.ExitStack()
        stack.enter_context(self.torch.inference_mode())
        stack.enter_context(self.compute())
        return stack

    def compute(self):
        """The precision's autocast alone, for forwards that keep autograd (rollouts that train)."""
        return autocast(self._platform, self._precision)

    def grad_enabled(self) -> bool:
        return self.torch.is_grad_enabled()


def _import_torch():
    """torch, imported on first use. Its first import allocates about a million long-lived objects and almost no
    garbage (~7,000 unreachable objects): the collector's passes during it, and every later full collection
    traversing its objects, are wasted work — 0.1–0.3 s of a one-image `cardtool generate` on this machine. So the
    first import runs with the collector paused and then moves what it made to the permanent generation
    (gc.freeze)."""
    if "torch" in sys.modules:
        import torch

        return torch
    paused = gc.isenabled()
    gc.disable()
    try:
        import torch
    finally:
        gc.freeze()
        if paused:
            gc.enable()
    return torch


def arrays_numpy(config, weights, source, platform: Platform, precision: str) -> NumpyArrays:
    return NumpyArrays(precision)


def arrays_torch(config, weights, source, platform: Platform, precision: str) -> TorchArrays:
    return TorchArrays(platform, precision)
