"""`cardtool flywheel CARD --reward REWARD_CARD [--steps N] …` — RL the base, distil from the RL'd card, compare."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import console, counted, emit_json, handled, paired_cells, progress_line, say, typed_command
from cardtool.core.distributed import reporting


def flywheel_command(
    card: Annotated[str, typer.Argument(help="The base: a card id, folder or manifest with a denoise loop.")],
    reward: Annotated[str, typer.Option("--reward", help="The reward card of the rl stage.")],
    steps: Annotated[int | None, typer.Option("--steps", help="The student's step count, "
                                              "distill.loss.student_steps (default 2).")] = None,
    recipe: Annotated[Path | None, typer.Option("--recipe", help="A flywheel recipe: an rl: and a distill: section "
                                                "(examples/recipes/fashion-flywheel.yaml).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a stage's value: rl.optim.steps=100, "
                                                        "distill.optim.steps=500.")] = None,
    out_prefix: Annotated[str | None, typer.Option("--out-prefix", help="Card ids PREFIX-nft and PREFIX-nft-Nstep "
                                                   "(default: the base's name).")] = None,
    out_dir: Annotated[Path, typer.Option("--out-dir", help="Where the two new cards are written.")] = Path("cards"),
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Checkpoints, one folder per stage, and the "
                                                 "report (default runs/ID-flywheel).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the stage a stop interrupted.")] = False,
    force: Annotated[bool, typer.Option("--force", "--overwrite",
                                        help="Replace a stage's card that another recipe made (its run starts "
                                        "afresh).")] = False,
    stop_after: Annotated[str | None, typer.Option("--stop-after", help="Stop after this stage: rl, distill or "
                                                   "eval.")] = None,
    compare: Annotated[list[str] | None, typer.Option("--compare", help="Another card for the table (e.g. a student "
                                                      "distilled from the base directly); repeat.")] = None,
    per_class: Annotated[int, typer.Option("--per-class", help="Eval images per class (10 classes).")] = 100,
    judge: Annotated[str, typer.Option("--judge", help="The judge for accuracy and FID.")] = "fashion-classifier",
    held_out_judge: Annotated[str, typer.Option("--held-out-judge", help="A judge that is never the reward ('' for "
                                                "none).")] = "fashion-referee",
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    data: Annotated[str | None, typer.Option("--data", help="An IDX folder (default: Fashion-MNIST).")] = None,
    micro_batches: Annotated[int, typer.Option(
        "--micro-batches", help="Split each stage's batches into M micro-batches; under torchrun each process takes "
        "M of the P·M.")] = 1,
    watch_every: Annotated[int, typer.Option("--watch-every", help="Every N steps of each training stage, sample "
                                             "the class prompts with the live model as its card will serve and log "
                                             "accuracy under both judges and FID (0: off).")] = 0,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """RL CARD on a reward, distil the RL'd card into an N-step student, evaluate the three side by side."""
    from cardtool.core.training.calls import flywheel

    main = reporting()  # under torchrun rank 0 logs and reports for every rank

    def log(stage: str, entry: dict) -> None:  # on stderr, also under --json: the stages take minutes
        if main:
            say(progress_line(stage, entry), stderr=True)

    def stage_line(entry: dict) -> None:
        if main:
            done = "skipped: its card exists with this recipe's fingerprint" if entry["skipped"] else \
                f"done in {entry['seconds']:.0f}s"
            say(f"stage {entry['stage']}{' → ' + entry['card'] if entry['card'] else ''}: {done}", stderr=True)

    with handled(json_):
        report = flywheel(card, reward=reward, steps=steps, recipe=recipe, overrides=list(overrides or []),
                          out_prefix=out_prefix, out_dir=out_dir, run_dir=run_dir, resume=resume, force=force,
                          stop_after=stop_after, compare=list(compare or []), per_class=per_class, judge=judge,
                          held_out_judge=held_out_judge or None, device=device, data=data,
                          micro_batches=micro_batches, watch_every=watch_every, on_log=log, on_stage=stage_line,
                          command=typed_command("flywheel"))
    if not main:
        return
    if json_:
        emit_json(report.to_json())
        return
    if not report.cards:
        say(f"stopped after {report.stages[-1]['stage']}; the same command without --stop-after goes on from there")
        return
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, title=f"flywheel, judged by {report.judge} on {report.platform}, "
                                             f"{counted(report.per_class, 'image')} per class", title_justify="left")
    columns = ["card", "method", "steps", "model evals/image", "accuracy",
               *([f"accuracy ({report.held_out_judge})"] if report.held_out_judge else []), "FID-FMNIST", "images/s"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("card", "method") else "right")
    for row in report.cards:
        held = [f"{row['held_out_accuracy']:.4f}"] if report.held_out_judge else []
        table.add_row(row["card"], row["method"], str(row["steps"]), str(row["model_evaluations"]),
                      f"{row['class_accuracy']:.4f}", *held, f"{row['fid_fmnist']:.3f}",
                      f"{row['images_per_second']:.0f}")
    out = console()
    out.print(table)
    if report.paired:
        pairs = Table(box=box.SIMPLE_HEAD, title="the student against each card, the same prompts and seeds (B − A)",
                      title_justify="left")
        for column in ("A", "B", "Δ accuracy (95%)", "only A / only B right", "McNemar p", "Δ FID-FMNIST (95%)"):
            pairs.add_column(column, justify="left" if column in ("A", "B") else "right")
        for d in report.paired:
            pairs.add_row(d["a"], d["b"], *paired_cells(d))
        out.print(pairs)
    for entry in report.stages:
        out.print(f"stage {entry['stage']}: " + ("skipped" if entry["skipped"] else f"{entry['seconds']:.0f}s"),
                  markup=False)
