"""`cardtool parity` — every available kernel cell against the numpy reference (or float32 for low precision)."""

from __future__ import annotations

from typing import Annotated

import typer

from cardtool.cli.output import LateProgress, console, emit_json, handled


def parity_command(
    device: Annotated[str | None, typer.Option("--device", help="Override the device: cuda, cpu or numpy.")] = None,
    op: Annotated[str | None, typer.Option("--op", help="Only this op.")] = None,
    card: Annotated[str | None, typer.Option("--card", help="Also compare the card's components with numpy.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Run every available kernel cell on seeded inputs and compare; exit 1 if any cell fails."""
    import sys

    from cardtool.core.evaluation.parity_report import parity

    with handled(json_):
        progress = LateProgress(enabled=not json_ or not sys.stderr.isatty(), terminal=sys.stderr.isatty(),
                                what="comparing", unit="checks")
        try:
            report = parity(card, device=device, op=op, on_progress=progress)
        finally:
            progress.stop()
    platform, rows, ok = report.platform, report.rows, report.ok
    if json_:
        emit_json(report.to_json())
    else:
        from rich import box
        from rich.markup import escape
        from rich.table import Table

        table = Table(box=box.SIMPLE_HEAD, title=f"parity on {platform.device}/{platform.arch}", title_justify="left")
        for column in ("op", "cell", "dtype", "against", "cases", "max abs err", "max rel err", "atol/rtol", "verdict"):
            table.add_column(column, no_wrap=column != "verdict", overflow="fold")
        for r in rows:
            op_name, rest = r.cell.split("/", 1)
            verdict = "[green]pass[/green]" if r.passed else f"[red]FAIL[/red] {escape(r.error)}".rstrip()
            against = "numpy" if r.against.startswith("numpy") else r.against if op_name.startswith("contract:") \
                else "f32"
            table.add_row(op_name, escape(rest), r.dtype, against, str(len(r.shapes)), f"{r.max_abs_err:.1e}",
                          f"{r.max_rel_err:.1e}", f"{r.atol:.0e}/{r.rtol:.0e}", verdict)
        out = console()
        out.print(table)
        shapes = {r.cell.split("/", 1)[0]: r.shapes for r in rows if r.shapes}
        for name, cases in shapes.items():
            out.print(f"  {name}: {'; '.join(cases)}", markup=False)
        if report.unchecked:
            out.print("  not compared with numpy:", markup=False)
            for item in report.unchecked:
                out.print(f"    {item['name']}: {item['why']}", markup=False)
        failed = report.failed
        out.print(f"{len(rows) - len(failed)} passed, {len(failed)} failed" if rows else
                  f"no accelerated kernel cells can run on {platform.device}/{platform.arch}; nothing to compare")
    if not ok:
        raise typer.Exit(1)
