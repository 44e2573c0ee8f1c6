"""Array namespaces: the few framework operations the denoise loop needs (make, join, read back, inference),
so the one loop runs torch components on cpu/cuda and the numpy reference forwards on the numpy rung."""

from __future__ import annotations

import contextlib

import numpy as np

from cardtool.backends.platform import Platform

__all__ = ["NumpyArrays", "TorchArrays", "arrays_numpy", "arrays_torch"]


class NumpyArrays:
    def __init__(self, dtype: str):
        self.dtype = np.dtype(dtype)

    def asarray(self, value):
        value = np.asarray(value)
        return value if value.dtype == bool or value.dtype.kind in "iu" else value.astype(self.dtype)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def cat(self, xs):
        return np.concatenate(xs)

    def inference(self):
        return contextlib.nullcontext()


class TorchArrays:
    def __init__(self, device: str, dtype: str):
        import torch

        self.torch, self.device, self.dtype = torch, device, getattr(torch, dtype)

    def asarray(self, value):
        tensor = self.torch.as_tensor(np.asarray(value), device=self.device)
        return tensor if tensor.dtype in (self.torch.bool, self.torch.int64) else tensor.to(self.dtype)

    def to_numpy(self, x) -> np.ndarray:
        x = x.detach()
        return (x.float() if x.dtype in (self.torch.bfloat16, self.torch.float16) else x).cpu().numpy()

    def cat(self, xs):
        return self.torch.cat(xs)

    def inference(self):
        # inference_mode, not no_grad: no version counters or view tracking (issue 11 measured ~1.1× at batch 1);
        # what it makes cannot enter autograd later, so rollouts that train (grad=True) never run under it
        return self.torch.inference_mode()


def arrays_numpy(config, weights, source, platform: Platform, dtype: str) -> NumpyArrays:
    return NumpyArrays(dtype)


def arrays_torch(config, weights, source, platform: Platform, dtype: str) -> TorchArrays:
    return TorchArrays(platform.torch_device, dtype)
