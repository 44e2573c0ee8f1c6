"""`cardtool parity` as a call (invariant 4): every kernel cell that can run on the platform against the numpy
reference (low precisions against the op in float32), or one op's, and with a card its components, generation and
promised consistency (card_parity.py) — the report the command prints; `.to_json()` is its `--json` document."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from cardtool.backends.parity import ParityRow
from cardtool.backends.platform import Platform
from cardtool.core.arguments import card_ref, check
from cardtool.errors import BadInput

__all__ = ["ParityReport", "parity"]


@dataclass
class ParityReport:
    platform: Platform
    rows: list[ParityRow]
    unchecked: list[dict] = field(default_factory=list)  # with a card: what no row compared, {"name", "impl", "why"}

    @property
    def ok(self) -> bool:
        return all(row.passed for row in self.rows)

    @property
    def failed(self) -> list[ParityRow]:
        return [row for row in self.rows if not row.passed]

    def to_json(self) -> dict:
        return {"platform": self.platform.to_json(), "ok": self.ok, "rows": [row.to_json() for row in self.rows],
                "unchecked": self.unchecked}


def parity(card: str | os.PathLike | None = None, *, device: str | None = None, op: str | None = None,
           on_progress: Callable[[int, int], None] | None = None) -> ParityReport:
    """`cardtool parity [--card CARD] [--device D] [--op OP]`: a row per cell and dtype compared, `ok` when all
    passed, and with a card what of it no row compared (`unchecked`). A failed row is a finding, not an error:
    BadInput is for an unknown device, op or card. `on_progress(done, total)` follows the checks in two counts: each
    kernel cell and dtype, then each part of the card's (a component, the generation, the adapters, the contract) —
    one count over both made the time left of a part that takes seconds from checks that take milliseconds."""
    from cardtool.backends.builtin import OPS
    from cardtool.backends.parity import parity_checks, run_parity
    from cardtool.backends.registry import KERNELS

    check(texts={"device": device, "op": op}, paths={}, flags={}, whole={}, callbacks={"on_progress": on_progress})
    card = None if card is None else card_ref("card", card)
    platform = Platform.detect(device)
    known = {cell.key[0] for cell in KERNELS.cells()} | set(OPS)
    if op is not None and op not in known:
        raise BadInput(f"unknown op '{op}'; ops: {', '.join(sorted(known))}")
    loaded = None
    if card is not None:
        from cardtool.core.cards.loader import load_card
        from cardtool.core.evaluation.card_parity import card_parity, card_parts, unchecked

        loaded = load_card(card)

    def counted(total: int) -> Callable[[], None]:
        done = 0

        def one_more() -> None:
            nonlocal done
            done += 1
            if on_progress:
                on_progress(done, total)
        return one_more

    report = ParityReport(platform, run_parity(platform, op, counted(len(parity_checks(platform, op)))))
    if loaded is not None:
        found = card_parity(loaded, platform, counted(len(card_parts(loaded, platform))))
        report.rows += found
        report.unchecked = unchecked(loaded, platform, found)
    return report
