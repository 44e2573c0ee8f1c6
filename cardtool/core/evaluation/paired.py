"""Two sets of images made from the same requests (prompt and seed), compared image pair by image pair — two cards
(`eval A --versus B`), one card at two precisions, a flywheel's student and its rivals. Two evals' own intervals
overlap long after their difference is real, because much of each eval's noise — which prompt and seed is easy — is
the same for both; paired statistics cancel it: McNemar's exact test (McNemar 1947) on the pairs only one side got
right, and a paired bootstrap (Efron & Tibshirani 1993) of the differences in accuracy and FID, each resample drawing
the same image pairs for both sides."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from cardtool.core.evaluation.metrics import FrechetTo
from cardtool.core.evaluation.resume import ROW_SETTINGS

__all__ = ["Difference", "difference", "mcnemar_p", "paired_differences", "precision_differences"]

RESAMPLES = 200


@dataclass
class Difference:
    """One row pair, B − A: accuracy and FID differences with their paired 95% bootstrap intervals, the pairs only
    A or only B judged correct, and McNemar's two-sided p-value (small: the accuracies differ beyond the eval's
    noise). Null where either row has no measurement."""

    a: dict  # the rows' settings: steps, guidance, guidance_interval, precision, shift, solver
    b: dict
    accuracy: float | None = None
    accuracy_ci95: list[float] | None = None
    only_a: int | None = None
    only_b: int | None = None
    mcnemar_p: float | None = None
    fid_fmnist: float | None = None
    fid_fmnist_ci95: list[float] | None = None
    fid_fmnist_std: float | None = None


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: under equal accuracies each discordant pair is B's with probability ½, so
    min(only_a, only_b) ~ the lower tail of Binomial(only_a + only_b, ½), doubled (summed in log space: n may be
    thousands)."""
    n, low = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2) for i in range(low + 1)]
    top = max(logs)
    return min(1.0, 2 * math.exp(top) * sum(math.exp(v - top) for v in logs))


def paired_differences(hits_a: np.ndarray | None, features_a: np.ndarray, hits_b: np.ndarray | None,
                       features_b: np.ndarray, real: np.ndarray, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """B − A in accuracy and FID for images paired by index (the same prompt and seed), each with the 2.5–97.5%
    interval of a paired bootstrap; FID's bootstrap deviation too. Without hits (captions: no classes), FID only."""
    n, judged = len(features_a), hits_a is not None and hits_b is not None
    to_real, rng = FrechetTo(real.astype(np.float64)), np.random.default_rng(seed)
    a, b = features_a.astype(np.float64), features_b.astype(np.float64)
    accuracy, fid = [], []
    for _ in range(resamples):
        i = rng.integers(0, n, n)
        accuracy += [hits_b[i].mean() - hits_a[i].mean()] if judged else []
        fid.append(to_real(b[i]) - to_real(a[i]))

    def interval(values) -> list[float]:
        return [round(float(v), 4) for v in np.percentile(values, [2.5, 97.5])]

    out = {"fid_fmnist": round(to_real(b) - to_real(a), 4), "fid_fmnist_ci95": interval(fid),
           "fid_fmnist_std": round(float(np.std(fid)), 4)}
    if judged:
        only_a, only_b = int((hits_a & ~hits_b).sum()), int((hits_b & ~hits_a).sum())
        out.update({"accuracy": round(float(hits_b.mean() - hits_a.mean()), 4), "accuracy_ci95": interval(accuracy),
                    "only_a": only_a, "only_b": only_b, "mcnemar_p": float(f"{mcnemar_p(only_a, only_b):.4g}")})
    return out


def difference(row_a, kept_a, row_b, kept_b, real: np.ndarray) -> Difference:
    """Eval rows a and b (EvalRow) with their kept samples (judged correct, features): B − A, null where either row
    has no measurement."""
    settings = [{k: getattr(row, k) for k in ROW_SETTINGS} for row in (row_a, row_b)]
    return Difference(*settings, **(paired_differences(*kept_a, *kept_b, real) if kept_a and kept_b else {}))


def precision_differences(report) -> list[Difference]:
    """Within one eval (EvalReport) of several precisions, its samples kept: each row of a later precision against
    the first precision's row of the same settings, pair by pair — is bfloat16's quality float32's, beyond the
    eval's noise?"""
    if report.rank != 0 or not report.samples:
        return []
    rows = list(zip(report.rows, report.samples, strict=True))
    first = rows[0][0].precision

    def key(row) -> tuple:
        return tuple(json.dumps(getattr(row, k)) for k in ROW_SETTINGS if k != "precision")

    base = {key(row): (row, kept) for row, kept in rows if row.precision == first}
    return [difference(*base[key(row)], row, kept, report.real) for row, kept in rows
            if row.precision != first and key(row) in base]
