"""Logit soft-capping, `cap · tanh(x / cap)` (Gemma 2, Team et al. 2024, §2): near x for |x| ≪ cap, bounded by cap."""

import numpy as np


def numpy_soft_cap(x, cap):
    return cap * np.tanh(x / cap)


def soft_cap(x, cap):
    import torch

    return cap * torch.tanh(x / cap)


def parity_inputs(rng):
    """(label, floats, fixed): `x` is rounded to each precision parity runs at; `cap` passed as it is."""
    return [("4x8, cap 2: most values saturate", {"x": 3 * rng.standard_normal((4, 8))}, {"cap": 2.0}),
            ("2x3x5, cap 50: nearly the identity", {"x": rng.standard_normal((2, 3, 5))}, {"cap": 50.0})]
