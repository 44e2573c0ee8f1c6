"""`cardtool rl CARD --reward REWARD_CARD [--method diffusion_nft|flow_grpo] [--prompts FILE] …` — reward
fine-tuning into a card that samples without CFG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import counted, emit_json, handled, progress_line, say, typed_command, warn
from cardtool.core.distributed import reporting


def rl_command(
    card: Annotated[str, typer.Argument(help="The base: a card id, folder or manifest with a denoise loop.")],
    reward: Annotated[str, typer.Option("--reward", help="The reward card (fashion-classifier: the probability "
                                        "of the prompt's class).")],
    method: Annotated[str | None, typer.Option("--method", help="diffusion_nft (default) or flow_grpo; default: "
                                               "the recipe's.")] = None,
    prompts: Annotated[Path | None, typer.Option("--prompts", "--prompts-file", help="A text file, one prompt per "
                                                 "line, as generate's --prompts-file (default: the class prompts "
                                                 "with their synonyms and templates).")] = None,
    recipe: Annotated[Path | None, typer.Option("--recipe", help="An rl recipe (examples/recipes/fashion-nft.yaml "
                                                "and fashion-grpo.yaml hold the defaults).")] = None,
    micro_batches: Annotated[int, typer.Option(
        "--micro-batches", help="Split each update's batch into M micro-batches; under torchrun each process takes "
        "M of the P·M, and P processes equal one with --micro-batches P·M.")] = 1,
    lora: Annotated[int | None, typer.Option("--lora", metavar="RANK", help="Train a rank-RANK LoRA on the frozen "
                                             "transformer instead of the whole transformer (model.lora.rank).")] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a value: optim.steps=100.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="The tuned card folder (default cards/ID).")] = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="Checkpoints (default runs/ID).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --run-dir.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    data: Annotated[str | None, typer.Option("--data", help="An IDX folder for the eval (default: "
                                             "Fashion-MNIST).")] = None,
    force: Annotated[bool, typer.Option("--force", "--overwrite", help="Replace an existing card folder.")] = False,
    evaluate: Annotated[bool, typer.Option("--eval/--no-eval", help="Evaluate the tuned card at its defaults and "
                                           "record it.")] = True,
    judge: Annotated[str, typer.Option("--judge", help="The judge for the eval and FID.")] = "fashion-classifier",
    per_class: Annotated[int, typer.Option("--per-class", help="The eval's images per class (10 classes).")] = 100,
    held_out_judge: Annotated[str, typer.Option("--held-out-judge", help="A judge that is never the reward; its "
                                                "accuracy is recorded beside the reward's ('' for none).")]
    = "fashion-referee",
    watch_every: Annotated[int, typer.Option("--watch-every", help="Every N updates (at the next progress line), "
                                             "sample the class prompts with the policy and log accuracy under both "
                                             "judges and FID (0: off).")] = 0,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Fine-tune CARD on a reward with DiffusionNFT (or Flow-GRPO); the tuned card extends CARD."""
    from cardtool.core.cards.source import display_path
    from cardtool.core.training.calls import rl

    def log(entry: dict) -> None:
        if reporting():  # under torchrun rank 0 logs the global batch (on stderr, as always)
            say(progress_line("update", entry), stderr=True)

    def eval_line(report: dict) -> None:
        for row in report["rows"]:
            say(f"eval ({report['judge']}) at {counted(row['steps'], 'step')}, guidance {row['guidance']:g}: "
                f"accuracy {row['class_accuracy']:.4f}  FID {row['fid_fmnist']:.3f}  "
                f"{row['images_per_second']:.0f} img/s", stderr=True)

    with handled(json_):
        tuned = rl(card, reward=reward, method=method, prompts_file=prompts, recipe=recipe,
                   overrides=list(overrides or []), lora=lora, out=out, run_dir=run_dir, resume=resume, device=device,
                   data=data, force=force, evaluate=evaluate, judge=judge, held_out_judge=held_out_judge or None,
                   per_class=per_class, watch_every=watch_every, micro_batches=micro_batches, on_log=log,
                   on_eval=eval_line, on_warning=lambda message: warn(message) if reporting() else None,
                   command=typed_command("rl"))
    if not reporting():  # under torchrun rank 0 reports for every rank
        return
    recipe_block = tuned.manifest.recipe
    if json_:
        emit_json({"card": tuned.id, "path": display_path(tuned.folder), "extends": tuned.manifest.extends,
                   "method": recipe_block.method, "parents": recipe_block.parents, "metrics": recipe_block.metrics})
        return
    say(f"wrote {recipe_block.method} card {tuned.id} to {display_path(tuned.folder)}")
