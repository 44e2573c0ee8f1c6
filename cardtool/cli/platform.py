"""`cardtool platform detect | matrix` — light: neither imports torch nor creates a CUDA context."""

from __future__ import annotations

from typing import Annotated

import typer

from cardtool.cli.output import console, emit_json, handled

app = typer.Typer(help="The detected platform and every registered component and kernel cell.",
                  no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")]
DeviceOption = Annotated[str | None, typer.Option("--device", help="Override the device: cuda, cpu or numpy.")]


@app.command("detect")
def detect_command(device: DeviceOption = None, json_: JsonOption = False) -> None:
    """The device and arch this process would run on, the fallback chains, and why."""
    from cardtool.backends.platform import Platform
    from cardtool.thread_pools import cpu_threads

    with handled(json_):
        platform = Platform.detect(device)
    threads, why = cpu_threads()
    if json_:
        emit_json({**platform.to_json(), "threads": {"count": threads, "why": why}})
        return
    out = console()
    from rich.markup import escape

    out.print(f"[bold]{platform.device}[/bold] / [bold]{platform.arch}[/bold]  {escape(platform.name)}")
    out.print("kernel chain:    " + " → ".join("/".join(c) for c in platform.kernel_chain()), markup=False)
    out.print("component chain: " + " → ".join(platform.component_chain()), markup=False)
    out.print(f"CPU threads:     {threads} ({why})", markup=False)
    for reason in platform.why:
        out.print(f"  because {reason}", markup=False)


@app.command("matrix")
def matrix_command(
    device: DeviceOption = None,
    op: Annotated[str | None, typer.Option("--op", help="Only cells for this op or component kind.")] = None,
    available: Annotated[bool, typer.Option("--available", help="Only cells that can run here.")] = False,
    json_: JsonOption = False,
) -> None:
    """Every registered cell: its key, whether it can run on this platform and if not why, and its source."""
    from cardtool.backends.platform import Platform
    from cardtool.backends.registry import COMPONENTS, KERNELS, plugin_errors

    with handled(json_):
        platform = Platform.detect(device)
        known = sorted(set(KERNELS.names()) | set(COMPONENTS.names()))
        if op is not None and op not in known:
            from cardtool.errors import BadInput

            raise BadInput(f"unknown op or component '{op}'; known: {', '.join(known)}")
    rows = []
    for registry in (COMPONENTS, KERNELS):
        for cell in registry.cells():
            if op is not None and cell.key[0] != op:
                continue
            reasons = registry.reasons(cell, platform)
            if available and reasons:
                continue
            rows.append({"registry": registry.title, "key": dict(zip(registry.fields, cell.key, strict=True)),
                         "cell": cell.name, "target": cell.target, "available": not reasons, "reasons": reasons,
                         "reference": cell.reference, "dtypes": list(cell.dtypes), "source": cell.source})
    if json_:
        emit_json({"platform": platform.to_json(), "cells": rows, "plugin_errors": plugin_errors()})
        return
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    chain = " → ".join("/".join(c) for c in platform.kernel_chain())
    table = Table(box=box.SIMPLE_HEAD, title=f"cells on {platform.device}/{platform.arch} (kernel chain {chain})",
                  title_justify="left")
    table.add_column("cell", no_wrap=True)
    table.add_column("available", no_wrap=True)
    table.add_column("source", no_wrap=True)
    table.add_column("reasons", overflow="fold")
    for row in rows:
        mark = "[green]yes[/green]" + (" (oracle)" if row["reference"] else "") if row["available"] else "[red]no[/red]"
        table.add_row(escape(row["cell"]), mark, escape(row["source"]), escape("; ".join(row["reasons"])))
    out = console()
    out.print(table)
    for error in plugin_errors():
        console(stderr=True).print(f"[red]plugin failed[/red] {escape(error)}")
