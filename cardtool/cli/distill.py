"""`cardtool distill TEACHER [--steps N] [--recipe FILE] [--set key=value …]` — DMD2 into a few-step student card."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import counted, emit_json, handled, progress_line, say, typed_command, warn
from cardtool.core.distributed import reporting


def distill_command(
    teacher: Annotated[str, typer.Argument(help="The teacher: a card id, folder or manifest with a denoise loop.")],
    steps: Annotated[int | None, typer.Option("--steps", help="The student's step count, loss.student_steps "
                                              "(default: the recipe's, 4).")] = None,
    recipe: Annotated[Path | None, typer.Option("--recipe", help="A dmd2 recipe (examples/recipes/fashion-dmd2."
                                                "yaml holds the defaults).")] = None,
    micro_batches: Annotated[int, typer.Option(
        "--micro-batches", help="Split each iteration's batch into M micro-batches; under torchrun each process takes "
        "M of the P·M, and P processes equal one with --micro-batches P·M.")] = 1,
    lora: Annotated[int | None, typer.Option("--lora", metavar="RANK", help="Train a rank-RANK LoRA on the frozen "
                                             "transformer instead of the whole transformer (model.lora.rank).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a value: optim.steps=500.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="The student card folder (default cards/ID).")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Checkpoints (default runs/ID).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --run-dir.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    data: Annotated[str | None, typer.Option("--data", help="An IDX folder for the GAN term and the eval "
                                             "(default: Fashion-MNIST).")] = None,
    force: Annotated[bool, typer.Option("--force", "--overwrite",
                                        help="Replace an existing student card folder.")] = False,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="Evaluate the student at its own defaults "
                                           "and record it in the card.")] = True,
    judge: Annotated[str, typer.Option("--judge", help="The judge card for the eval.")] = "fashion-classifier",
    per_class: Annotated[int, typer.Option("--per-class", help="The eval's images per class (10 classes).")] = 100,
    held_out_judge: Annotated[str, typer.Option("--held-out-judge", help="A second judge: the student's accuracy under "
                                                "it is recorded beside the eval's, and --watch-every logs it ('' for "
                                                "none).")] = "fashion-referee",
    watch_every: Annotated[int, typer.Option("--watch-every", help="Every N iterations (at the next progress line), "
                                             "sample the class prompts with the student at its own steps and log "
                                             "accuracy under both judges and FID (0: off).")] = 0,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Distil TEACHER into an N-step student with DMD2; the student card extends the teacher."""
    from cardtool.core.cards.source import display_path
    from cardtool.core.training.calls import distill

    def log(entry: dict) -> None:
        if reporting():  # under torchrun rank 0 logs the global batch (on stderr, as always)
            say(progress_line("iteration", entry), stderr=True)

    def eval_line(report: dict) -> None:
        for row in report["rows"]:
            say(f"eval ({report['judge']}) at {counted(row['steps'], 'step')}: accuracy {row['class_accuracy']:.4f}  "
                f"FID {row['fid_fmnist']:.3f}  {row['images_per_second']:.0f} img/s", stderr=True)

    with handled(json_):
        card = distill(teacher, steps=steps, recipe=recipe, overrides=list(overrides or []), lora=lora, out=out,
                       run_dir=run_dir, resume=resume, device=device, data=data, force=force, evaluate=evaluate,
                       judge=judge, held_out_judge=held_out_judge or None, per_class=per_class,
                       watch_every=watch_every, micro_batches=micro_batches, on_log=log, on_eval=eval_line,
                       on_warning=lambda message: warn(message) if reporting() else None,
                       command=typed_command("distill"))
    if not reporting():  # under torchrun rank 0 reports for every rank
        return
    recipe_block = card.manifest.recipe
    if json_:
        emit_json({"card": card.id, "path": display_path(card.folder), "extends": card.manifest.extends,
                   "method": recipe_block.method, "parents": recipe_block.parents,
                   "steps": recipe_block.assumes.steps, "metrics": recipe_block.metrics})
        return
    say(f"wrote student card {card.id} ({counted(recipe_block.assumes.steps, 'step')}) to {display_path(card.folder)}")

