"""`eval --expect METRIC>=VALUE`: the thresholds a CI job holds a card to, checked on every row of its eval — a
card that regressed (a new torch, another platform, a retrained weight) fails the job with the rows and numbers."""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

from cardtool.errors import BadInput
from cardtool.words import counted

__all__ = ["METRICS", "Expectation", "parse_expectation"]

METRICS = ("class_accuracy", "fid_fmnist", "kid", "manifold_precision", "manifold_recall", "mean_reward",
           "images_per_second")  # EvalRow's measurements
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_FORM = re.compile(r"\s*([A-Za-z_]+)\s*(>=|<=|>|<)\s*([^\s<>=]+)\s*")  # `a>=` or `a>==1` is no form


@dataclass(frozen=True)
class Expectation:
    metric: str
    op: str
    value: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:.10g}"

    def failures(self, rows) -> list[str]:
        """Each row that misses it, said with its number and settings; a row with no measurement (NaN, or None in a
        row kept from a report measured before the metric existed) misses."""
        missed = []
        for row in rows:
            got = getattr(row, self.metric)
            got = math.nan if got is None else got
            if not (math.isfinite(got) and _OPS[self.op](got, self.value)):
                missed.append(f"{self.metric} {got:.6g} at {counted(row.steps, 'step')}, guidance {row.guidance:g}, "
                              f"{row.precision} (expected {self})")
        return missed


def parse_expectation(text: str) -> Expectation:
    match = _FORM.fullmatch(text) if isinstance(text, str) else None
    if match is None and isinstance(text, str) and "," in text and all(map(_FORM.fullmatch, text.split(","))):
        raise BadInput(f"--expect {text.strip()}"[:200] + ": one threshold per --expect; repeat the option")
    if match is None:
        raise BadInput(f"--expect {text!r}"[:200] + ": write METRIC>=VALUE (or <=, >, <), e.g. class_accuracy>=0.95 "
                       "or fid_fmnist<=16")
    metric, op, value = match.groups()
    if metric not in METRICS:
        raise BadInput(f"--expect: unknown metric '{metric}'; choose one of: {', '.join(METRICS)}")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        comma = " (write a decimal point, not a comma)" if "," in value else ""
        raise BadInput(f"--expect {text.strip()}: '{value}' is not a finite number{comma}")
    return Expectation(metric, op, number)
