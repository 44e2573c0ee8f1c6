"""`cardtool train --recipe FILE [--method M] [--set key=value …]` — make a card from data."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import console, emit_json, handled, progress_line, typed_command, warn
from cardtool.core.distributed import reporting


def train_command(
    recipe: Annotated[Path, typer.Option("--recipe", help="A YAML recipe (see examples/recipes/).")],
    method: Annotated[str | None, typer.Option(
        "--method", help="vae, classifier, pretrain, finetune, lora or controlnet.")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a value: optim.lr=3e-4.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="The card folder to write (default cards/ID).")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Checkpoints (default runs/ID).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --run-dir.")] = False,
    data: Annotated[str | None, typer.Option("--data", help="An IDX folder, or images with captions in "
                                             "metadata.jsonl (default: Fashion-MNIST).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", "--force", help="Replace an existing card folder.")] = False,
    micro_batches: Annotated[int, typer.Option(
        "--micro-batches", help="Split each step's batch into M micro-batches (gradient accumulation); under "
        "torchrun each process takes M of the P·M, and P processes equal one with --micro-batches P·M.")] = 1,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Train a card: the recipe's method, its data and hyperparameters; checkpoints, resume, a card at the end."""
    from cardtool.core.cards.source import display_path
    from cardtool.core.training.calls import train

    err = console(stderr=True)

    def log(entry: dict) -> None:  # on stderr, also under --json: a long run shows its progress to whoever watches
        if not reporting():  # under torchrun rank 0 logs the global batch
            return
        err.print(progress_line("step", entry), markup=False, highlight=False)

    with handled(json_):
        card = train(recipe, method=method, overrides=list(overrides or []), out=out, run_dir=run_dir, resume=resume,
                     data=data, device=device, overwrite=overwrite, micro_batches=micro_batches, on_log=log,
                     on_warning=lambda message: warn(message) if reporting() else None,
                     command=typed_command("train"))
    if not reporting():  # rank 0 reports for every rank
        return
    metrics = card.manifest.recipe.metrics
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "method": card.manifest.recipe.method, "parents": card.manifest.recipe.parents, "metrics": metrics})
        return
    console().print(f"wrote card {card.id} to {display_path(card.folder)}", markup=False)
    console().print("metrics: " + ", ".join(f"{k}={v}" for k, v in metrics.items()), markup=False)
