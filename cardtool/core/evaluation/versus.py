"""`cardtool eval A --versus B`: two cards measured on the same requests (the class prompts × the same seeds) and
compared image pair by image pair (paired.py: McNemar's exact test, paired bootstrap intervals)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

from cardtool.core.evaluation.evaluate import EvalReport, EvalRow, evaluate, plan_rows
from cardtool.core.evaluation.paired import Difference, difference
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.errors import BadInput, RunFailed, said_as_cardtool_errors

__all__ = ["Comparison", "compare"]


@dataclass
class Comparison:
    a: EvalReport
    b: EvalReport
    differences: list[Difference]

    def to_json(self) -> dict:
        return {**self.a.to_json(), "versus": {**self.b.to_json(),
                                               "differences": [asdict(d) for d in self.differences]}}


@said_as_cardtool_errors
def compare(card_a: str, card_b: str, *, on_row: Callable[[str, EvalRow], None] | None = None,
            **options) -> Comparison:
    """Evaluate both cards with the same `evaluate` options (each at its own loop defaults for what they leave out)
    and pair their rows in order; `on_row(card, row)` as each row is measured. `out`, `resume` and `keep_samples`
    are not options here: a comparison measures every image of both cards in one run."""
    import inspect

    unknown = sorted(set(options) - (set(inspect.signature(evaluate).parameters) - {"card_ref"}))
    if unknown:  # said of compare(), not of the evaluate() call inside it
        raise TypeError(f"compare() got an unexpected keyword argument {unknown[0]!r}; it takes evaluate()'s options")
    for name in ("out", "resume", "keep_samples", "stop"):
        if options.pop(name, None) not in (None, False):
            raise BadInput(f"a comparison measures both cards in one run: {name} does not apply to it")
    if on_row is not None and not callable(on_row):
        raise BadInput(f"on_row must be a function, got {on_row!r}"[:300])

    planning = inspect.signature(plan_rows).parameters
    plan_rows(card_b, **{k: v for k, v in options.items() if k in planning})  # B's problems before A's hour, not after

    def rows_of(card: str):
        return None if on_row is None else lambda row: on_row(card, row)

    single = os.environ.get("WORLD_SIZE", "1") == "1"  # torchrun's ranks must stop together: no signal handling
    with stop_requests(single) as caught:  # Ctrl-C / SIGTERM: the row in flight finishes first
        a = evaluate(card_a, **options, on_row=rows_of(card_a), keep_samples=True, stop=caught)
        if caught:
            raise Interrupted.after(caught[0], f"{a.card}'s rows; {card_b} was not measured", a.to_json())
        try:
            b = evaluate(card_b, **options, on_row=rows_of(card_b), keep_samples=True, stop=caught)
        except RunFailed as e:  # interrupted, or out of memory: the first card's rows are kept with the second's
            e.partial = {**a.to_json(), "versus": e.partial}
            raise
    differences = []
    if a.rank == 0:  # under torchrun rank 0 holds every row
        for row_a, row_b, kept_a, kept_b in zip(a.rows, b.rows, a.samples, b.samples, strict=True):
            differences.append(difference(row_a, kept_a, row_b, kept_b, a.real))
    return Comparison(a, b, differences)
