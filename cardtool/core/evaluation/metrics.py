"""Image-quality metrics: the Fréchet distance between feature distributions (FID's formula, Heusel et al.
2017), computed here on the fashion classifier's penultimate features (FID-FMNIST)."""

from __future__ import annotations

import numpy as np

__all__ = ["frechet_distance"]


def _sqrtm_psd(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """‖μa − μb‖² + Tr(Σa + Σb − 2(Σa^½ Σb Σa^½)^½) for feature rows a (N, d) and b (M, d)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    root_a = _sqrtm_psd(cov_a)
    cross = _sqrtm_psd(root_a @ cov_b @ root_a)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * np.trace(cross))
