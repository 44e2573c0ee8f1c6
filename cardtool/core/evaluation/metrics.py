"""Image-quality metrics on the fashion classifier's penultimate features: the Fréchet distance (FID's formula,
Heusel et al. 2017; FID-FMNIST) and the kernel distance (KID, Bińkowski et al. 2018). FID is strongly biased at
small N — a sample smaller than about twice the feature dimension gives a rank-deficient covariance, and a
collapsed sample can even look better — while KID's estimator is unbiased, so it is reported beside FID."""

from __future__ import annotations

import numpy as np

__all__ = ["frechet_distance", "kernel_distance", "fid_warning"]


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


def kernel_distance(a: np.ndarray, b: np.ndarray, *, subsets: int = 100, subset_size: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """KID: the unbiased MMD² estimate with the cubic polynomial kernel k(x, y) = (x·y/d + 1)³, averaged over
    `subsets` random subsets of min(N, M, subset_size) rows of each side; returns (mean, standard deviation)."""
    n = min(len(a), len(b), subset_size)
    if n < 2:
        raise ValueError("KID needs at least two feature rows on each side")
    d, rng = a.shape[1], np.random.default_rng(seed)
    estimates = []
    for _ in range(subsets):
        x = a[rng.choice(len(a), n, replace=False)].astype(np.float64)
        y = b[rng.choice(len(b), n, replace=False)].astype(np.float64)
        kxx, kyy, kxy = ((x @ x.T / d + 1) ** 3, (y @ y.T / d + 1) ** 3, (x @ y.T / d + 1) ** 3)
        within = (kxx.sum() - np.trace(kxx) + kyy.sum() - np.trace(kyy)) / (n * (n - 1))
        estimates.append(within - 2 * kxy.mean())
    return float(np.mean(estimates)), float(np.std(estimates))


def fid_warning(n: int, dim: int) -> str | None:
    """A sentence for reports when N generated images are too few for FID to mean much, else None."""
    if n >= 2 * dim:
        return None
    return (f"{n} images is below 2 × the {dim} feature dimensions: FID is strongly biased at this size (a "
            "collapsed sample can score better); compare KID, or evaluate more images")
