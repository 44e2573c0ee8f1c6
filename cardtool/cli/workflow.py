"""`cardtool workflow validate FILE` and `cardtool workflow run FILE [--set …]` — workflow manifests: generate, chain,
parallel and best-of-N steps over cards."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import counted, emit_json, handled, quoted_prompt, say, warn
from cardtool.core.distributed import reporting

app = typer.Typer(help="Workflow manifests: generate, chain, parallel and best-of-N steps over cards.",
                  no_args_is_help=True)
SHOWN = 12  # steps `workflow validate` names for people


@app.command("validate")
def validate_command(
    file: Annotated[Path, typer.Argument(help="A workflow manifest (YAML or TOML).")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a value: "
                                                        "steps.draft.generate.num=4.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Check a workflow: its schema, its steps' inputs (no missing output, no cycle) and every card it names."""
    from cardtool.core.workflows.manifest import load_workflow

    with handled(json_):
        workflow = load_workflow(file, list(overrides or []))
    steps = {name: step.kind for name, step in workflow.manifest.steps.items()}
    if json_:
        emit_json({"workflow": workflow.manifest.id, "ok": True, "order": workflow.order, "steps": steps})
        return
    named = [f"{n} ({k})" for n, k in steps.items()]
    more = f", … {len(named) - SHOWN} more" if len(named) > SHOWN else ""  # a generated workflow may have thousands
    say(f"ok      {workflow.manifest.id}  ({counted(len(steps), 'step')}: {', '.join(named[:SHOWN])}{more})")


@app.command("run")
def run_command(
    file: Annotated[Path, typer.Argument(help="A workflow manifest (YAML or TOML).")],
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a value: "
                                                        "steps.draft.generate.num=4.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Images go to OUT/WORKFLOW_ID/STEP/.")] = Path("outputs"),
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Model rows per forward (a guided request takes "
                                           "two), and images per written wave.")] = 128,
    skip_existing: Annotated[bool, typer.Option(
        "--skip-existing", help="Keep each image already in --out with the settings this run would make it with (a "
        "stopped run's) and make only the others.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
) -> None:
    """Run a workflow: its steps in dependency order in one process, each card loaded once."""
    from cardtool.core.workflows.manifest import load_workflow
    from cardtool.core.workflows.run import run_workflow

    def progress(entry: dict) -> None:
        if reporting():  # on stderr, also under --json
            kept = f" ({entry['kept']} already there)" if entry["kept"] else ""
            say(f"step {entry['step']} ({entry['kind']}): {counted(len(entry['images']), 'image')}{kept} in "
                f"{entry['seconds']:.2f}s", stderr=True)

    def wave(step: str, done: int, total: int) -> None:
        if reporting():
            say(f"step {step}: {done:,} of {counted(total, 'image')}", stderr=True)

    with handled(json_):
        workflow = load_workflow(file, list(overrides or []))
        report = run_workflow(workflow, out=out, device=device, max_batch=max_batch, on_step=progress, on_wave=wave,
                              skip_existing=skip_existing)
    if not reporting():  # under torchrun rank 0 reports for every rank
        return
    for warning in report.warnings:
        warn(warning)
    if json_:
        emit_json(report.to_json())
        return
    for step in report.steps:
        for image in step["images"]:
            scored = f", best of {image['best_of']}: {image['scores']}" if "scores" in image else ""
            say(f"{image['path']}  ({step['step']}: {quoted_prompt(image['prompt'])}, seed {image['seed']}{scored})")
