"""Image-quality metrics on the fashion classifier's penultimate features: the Fréchet distance (FID's formula,
Heusel et al. 2017; FID-FMNIST) and the kernel distance (KID, Bińkowski et al. 2018). FID is strongly biased at
small N — a sample smaller than about twice the feature dimension gives a rank-deficient covariance, and a
collapsed sample can even look better — while KID's estimator is unbiased, so it is reported beside FID. Each comes with
its spread, so that two cards' numbers can be told apart from the eval's own noise: the Wilson interval of an accuracy,
a bootstrap standard deviation of FID, KID's deviation over subsets. FID and KID each fold fidelity and diversity
into one number; improved precision and recall (Kynkäänniemi et al. 2019) tell them apart."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["FrechetTo", "frechet_distance", "frechet_std", "kernel_distance", "fid_warning", "precision_recall",
           "wilson_interval"]


def _covariance(rows: np.ndarray) -> np.ndarray:
    """The (d, d) covariance of feature rows (N, d): numpy's is a 0-d array for one feature (a judge with
    `features: 1`), which the eigendecompositions refuse."""
    return np.atleast_2d(np.cov(rows, rowvar=False))


def _sqrtm_psd(matrix: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * np.sqrt(np.clip(values, 0, None))) @ vectors.T


def _trace_sqrtm_psd(matrix: np.ndarray) -> float:
    """Tr(M^½) = Σ √λ: the eigenvalues alone, which LAPACK finds in half the time of the eigenvectors too."""
    return float(np.sqrt(np.clip(np.linalg.eigvalsh((matrix + matrix.T) / 2), 0, None)).sum())


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """‖μa − μb‖² + Tr(Σa + Σb − 2(Σa^½ Σb Σa^½)^½) for feature rows a (N, d) and b (M, d)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    cov_a, cov_b = _covariance(a), _covariance(b)
    root_a = _sqrtm_psd(cov_a)
    cross = _trace_sqrtm_psd(root_a @ cov_b @ root_a)
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(cov_a) + np.trace(cov_b) - 2 * cross)


class FrechetTo:
    """The Fréchet distance of many samples to one fixed real side b, whose mean, covariance and square root are taken
    once: Tr((Σa^½ Σb Σa^½)^½) = Tr((Σb^½ Σa Σb^½)^½)."""

    def __init__(self, b: np.ndarray):
        self.mu, self.cov = b.mean(0), _covariance(b)
        self.root = _sqrtm_psd(self.cov)

    def __call__(self, a: np.ndarray) -> float:
        cov_a = _covariance(a)
        cross = _trace_sqrtm_psd(self.root @ cov_a @ self.root)
        return float(((a.mean(0) - self.mu) ** 2).sum() + np.trace(cov_a) + np.trace(self.cov) - 2 * cross)


def frechet_std(a: np.ndarray, b: np.ndarray, *, resamples: int = 50, seed: int = 0) -> float:
    """Bootstrap standard deviation of the Fréchet distance over a's rows (the generated images, drawn again with
    replacement; b, the real side, fixed): how far the score moves with the particular images a sample holds."""
    to_b, rng = FrechetTo(b), np.random.default_rng(seed)
    return float(np.std([to_b(a[rng.integers(0, len(a), len(a))]) for _ in range(resamples)]))


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion (Wilson 1927; 95% at the default z): where a class accuracy measured
    on n images lies — sound at 0 and 1, where p ± z·√(p(1 − p)/n) collapses to a point."""
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exactly 0 below p = 0 and 1 above p = 1, where rounding gives 3e-18 or 1 ± 2e-16
    return 0.0 if successes == 0 else max(0.0, centre - half), 1.0 if successes == n else min(1.0, centre + half)


def kernel_distance(a: np.ndarray, b: np.ndarray, *, subsets: int = 100, subset_size: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """KID: the unbiased MMD² estimate with the cubic polynomial kernel k(x, y) = (x·y/d + 1)³, averaged over
    `subsets` random subsets of min(N, M, subset_size) rows of each side; returns (mean, standard deviation)."""
    n = min(len(a), len(b), subset_size)
    if n < 2:
        raise ValueError("KID needs at least two feature rows on each side")
    d, rng = a.shape[1], np.random.default_rng(seed)
    draws = [(rng.choice(len(a), n, replace=False), rng.choice(len(b), n, replace=False)) for _ in range(subsets)]
    x_all, y_all = a.astype(np.float64), b.astype(np.float64)
    within_y = _within_real(b, y_all, [y for _, y in draws], (len(a), n, subsets, seed))
    if len(a) == n:  # each subset holds all of a, reordered: its within-sum and its sums against each b row are fixed
        within_x = _off_diagonal_sum(_cubic(x_all, x_all, d))
        against = np.concatenate([_cubic(x_all, y_all[i:i + 1024], d).sum(0) for i in range(0, len(b), 1024)])
        estimates = [(within_x + within) / (n * (n - 1)) - 2 * against[y].sum() / (n * n)
                     for (_, y), within in zip(draws, within_y, strict=True)]
    else:
        estimates = []
        for (x, y), within in zip(draws, within_y, strict=True):
            x = x_all[x]
            within_x = _off_diagonal_sum(_cubic(x, x, d))
            estimates.append((within_x + within) / (n * (n - 1)) - 2 * _cubic(x, y_all[y], d).mean())
    return float(np.mean(estimates)), float(np.std(estimates))


def _cubic(x: np.ndarray, y: np.ndarray, d: int) -> np.ndarray:
    """KID's kernel matrix (x·y/d + 1)³, cubed by two products: numpy's float power takes four times as long."""
    k = x @ y.T
    k /= d
    k += 1
    cube = k * k
    cube *= k
    return cube


def _off_diagonal_sum(k: np.ndarray) -> float:
    return float(k.sum() - np.trace(k))


# the real side's within-subset sums of KID, by the real rows' digest and the draws that pick its subsets: an eval's
# rows and its floors measure against the same 10,000 test images, and these sums are a third of KID's work
_WITHIN_REAL: dict[tuple, list[float]] = {}


def _within_real(b: np.ndarray, y_all: np.ndarray, picks: list[np.ndarray], draws: tuple) -> list[float]:
    import hashlib

    key = (hashlib.sha256(np.ascontiguousarray(b).data).hexdigest(), b.shape, b.dtype.str, draws)
    if key not in _WITHIN_REAL:
        d = y_all.shape[1]
        if len(_WITHIN_REAL) >= 8:
            _WITHIN_REAL.pop(next(iter(_WITHIN_REAL)))
        _WITHIN_REAL[key] = [_off_diagonal_sum(_cubic(y_all[y], y_all[y], d)) for y in picks]
    return _WITHIN_REAL[key]


def _kth_neighbour_distances(x: np.ndarray, y: np.ndarray, k: int, *, same: bool, chunk: int = 1024) -> np.ndarray:
    """For each row of x, the k-th smallest squared distance to y's rows (x's own row left out where `same`),
    a chunk of x at a time so that 10,000 rows never hold a 10,000² matrix."""
    y_sq, out = (y * y).sum(1), []
    for start in range(0, len(x), chunk):
        part = x[start:start + chunk]
        d = np.maximum((part * part).sum(1)[:, None] + y_sq[None] - 2 * part @ y.T, 0)
        if same:  # a row is its own nearest neighbour at distance 0: the k-th other one is the (k+1)-th
            d[np.arange(len(part)), np.arange(start, start + len(part))] = np.inf
        out.append(np.partition(d, k - 1, axis=1)[:, k - 1])
    return np.concatenate(out)


def _inside(x: np.ndarray, centres: np.ndarray, radii: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """Whether each row of x lies in at least one ball (centre, squared radius)."""
    c_sq, found = (centres * centres).sum(1), []
    for start in range(0, len(x), chunk):
        part = x[start:start + chunk]
        d = np.maximum((part * part).sum(1)[:, None] + c_sq[None] - 2 * part @ centres.T, 0)
        found.append((d <= radii[None]).any(1))
    return np.concatenate(found)


def precision_recall(a: np.ndarray, b: np.ndarray, *, k: int = 3, seed: int = 0) -> tuple[float, float] | None:
    """Improved precision and recall (Kynkäänniemi et al. 2019, arXiv 1904.06991) of generated feature rows a against
    real rows b: each side's manifold is the union of balls around its rows, each reaching its k-th nearest neighbour
    on the same side; precision is the share of a inside b's manifold (are the images realistic?), recall the share of
    b inside a's (is the data's variety covered?). The radii shrink as a side grows, so the real side is drawn down to
    a's size (seeded) and the two are compared at equal N. None where either side has k rows or fewer."""
    n = min(len(a), len(b))
    if n <= k:
        return None
    x = a[np.random.default_rng(seed).choice(len(a), n, replace=False)] if len(a) > n else a
    y = b[np.random.default_rng(seed).choice(len(b), n, replace=False)] if len(b) > n else b
    x, y = x.astype(np.float64), y.astype(np.float64)
    radii_x = _kth_neighbour_distances(x, x, k, same=True)
    radii_y = _kth_neighbour_distances(y, y, k, same=True)
    return float(_inside(x, y, radii_y).mean()), float(_inside(y, x, radii_x).mean())


def fid_warning(n: int, dim: int) -> str | None:
    """A sentence for reports when N generated images are too few for FID to mean much, else None."""
    if n >= 2 * dim:
        return None
    return (f"{n} images is below 2 × the {dim} feature dimensions: FID is strongly biased at this size (a "
            "collapsed sample can score better); compare KID, or evaluate more images")
