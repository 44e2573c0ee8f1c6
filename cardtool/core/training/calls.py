"""Training and post-training from Python — `cardtool.train`, `cardtool.distill`, `cardtool.rl` and
`cardtool.flywheel` — each the command of that name as one call: the same recipe (its file, `overrides` as `--set`,
the options that shape it), the same checks before any work, the same run with checkpoints and `resume`, the card
(the flywheel's report) returned where the command prints it. Progress comes to `on_log`, not to a terminal.

A card records the command it was made by; a call records the command line it equals (`recipe.command`), which
the command line's own run records as typed. An argument of a type the command line could not have given is
BadInput naming it, not a TypeError deep in a run."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cardtool.core.arguments import (
    as_int,
    card_ref,
    check,
    command_line,
    maybe_path,
    maybe_text,
    optional_card_ref,
    override_items,
    path,
    sequence,
)
from cardtool.errors import BadInput, said_as_cardtool_errors

__all__ = ["distill", "flywheel", "rl", "train"]


@said_as_cardtool_errors
def train(recipe: str | os.PathLike, *, method: str | None = None, overrides: list[str] | str = (),
          out: str | os.PathLike | None = None, run_dir: str | os.PathLike | None = None, resume: bool = False,
          data: str | os.PathLike | None = None, device: str | None = None, overwrite: bool = False,
          micro_batches: int = 1, on_log: Callable[[dict], None] | None = None,
          on_warning: Callable[[str], None] | None = None, command: str | None = None):
    """`cardtool train --recipe RECIPE`: a card made from data by the recipe's method (vae, classifier, pretrain,
    finetune, lora, controlnet). Returns the Card written to `out` (default cards/ID)."""
    from cardtool.core.training.recipes import load_recipe
    from cardtool.core.training.train import train as run

    recipe, sets = path("recipe", recipe), override_items(overrides)
    check(texts={"method": method, "device": device}, paths={"out": out, "run_dir": run_dir, "data": data},
          flags={"resume": resume, "overwrite": overwrite}, whole={"micro_batches": micro_batches},
          callbacks={"on_log": on_log, "on_warning": on_warning}, command=command)
    micro_batches = int(micro_batches)  # numpy's integers too, as Python's
    loaded = load_recipe(recipe, sets, method)
    command = command or command_line("train", [], [("--recipe", recipe), *_sets(sets), ("--method", method),
                                                    ("--data", data)])
    return run(loaded, command=command, out=maybe_path(out), run_dir=maybe_path(run_dir), resume=resume,
               data=maybe_text(data), device=device, overwrite=overwrite, on_log=on_log,
               micro_batches=micro_batches, on_warning=on_warning)


@said_as_cardtool_errors
def distill(teacher: str | os.PathLike, *, steps: int | None = None, recipe: str | os.PathLike | None = None,
            overrides: list[str] | str = (), lora: int | None = None, out: str | os.PathLike | None = None,
            run_dir: str | os.PathLike | None = None, resume: bool = False, device: str | None = None,
            data: str | os.PathLike | None = None, force: bool = False, evaluate: bool = True,
            judge: str | os.PathLike = "fashion-classifier",
            held_out_judge: str | os.PathLike | None = "fashion-referee", per_class: int = 100,
            watch_every: int = 0, micro_batches: int = 1, on_log: Callable[[dict], None] | None = None,
            on_eval: Callable[[dict], None] | None = None, on_warning: Callable[[str], None] | None = None,
            command: str | None = None):
    """`cardtool distill TEACHER`: DMD2 into a `steps`-step student card that extends the teacher, evaluated and
    judged by `held_out_judge` too unless `evaluate` is False. Returns the student's Card."""
    from cardtool.core.training.distill import distill as run
    from cardtool.core.training.distill import distill_recipe
    from cardtool.core.training.lora_settings import lora_overrides

    teacher, sets = card_ref("teacher", teacher), override_items(overrides)
    judge, held_out_judge = card_ref("judge", judge), optional_card_ref("held_out_judge", held_out_judge)
    check(texts={"device": device}, paths={"recipe": recipe, "out": out, "run_dir": run_dir, "data": data},
          flags={"resume": resume, "force": force, "evaluate": evaluate},
          whole={"per_class": per_class, "watch_every": watch_every, "micro_batches": micro_batches},
          optional_whole={"steps": steps, "lora": lora},
          callbacks={"on_log": on_log, "on_eval": on_eval, "on_warning": on_warning}, command=command)
    steps, lora, per_class, watch_every, micro_batches = map(as_int, (steps, lora, per_class, watch_every,
                                                                      micro_batches))
    loaded = distill_recipe(teacher, maybe_path(recipe), [*sets, *lora_overrides(lora, sets)], steps)
    command = command or command_line("distill", [teacher], [("--steps", steps), ("--recipe", recipe), *_sets(sets),
                                                             ("--lora", lora), ("--data", data)])
    return run(loaded, command=command, out=maybe_path(out), run_dir=maybe_path(run_dir), resume=resume,
               device=device, data=maybe_text(data), force=force, evaluate=evaluate, judge=judge,
               held_out_judge=held_out_judge, on_log=on_log, on_eval=on_eval, micro_batches=micro_batches,
               watch_every=watch_every, watch_judges=[judge, *([held_out_judge] if held_out_judge else [])],
               per_class=per_class, on_warning=on_warning)


@said_as_cardtool_errors
def rl(card: str | os.PathLike, *, reward: str | os.PathLike, method: str | None = None,
       prompts: list[str] | str | None = None, prompts_file: str | os.PathLike | None = None,
       recipe: str | os.PathLike | None = None, overrides: list[str] | str = (), lora: int | None = None,
       out: str | os.PathLike | None = None, run_dir: str | os.PathLike | None = None, resume: bool = False,
       device: str | None = None, data: str | os.PathLike | None = None, force: bool = False, evaluate: bool = True,
       judge: str | os.PathLike = "fashion-classifier",
       held_out_judge: str | os.PathLike | None = "fashion-referee", per_class: int = 100,
       watch_every: int = 0, micro_batches: int = 1, on_log: Callable[[dict], None] | None = None,
       on_eval: Callable[[dict], None] | None = None, on_warning: Callable[[str], None] | None = None,
       command: str | None = None):
    """`cardtool rl CARD --reward REWARD`: DiffusionNFT (or `method='flow_grpo'`) on the reward card's score, the
    tuned card sampling without CFG. `prompts` (a list, or one string for one prompt) or `prompts_file` (one a line,
    as `--prompts`) replace the class prompts. Returns the tuned Card."""
    from cardtool.core.training.lora_settings import lora_overrides
    from cardtool.core.training.rl import read_prompts, rl_recipe
    from cardtool.core.training.rl import rl as run

    card, reward, sets = card_ref("card", card), card_ref("reward", reward), override_items(overrides)
    judge, held_out_judge = card_ref("judge", judge), optional_card_ref("held_out_judge", held_out_judge)
    check(texts={"method": method, "device": device},
          paths={"prompts_file": prompts_file, "recipe": recipe, "out": out, "run_dir": run_dir, "data": data},
          flags={"resume": resume, "force": force, "evaluate": evaluate},
          whole={"per_class": per_class, "watch_every": watch_every, "micro_batches": micro_batches},
          optional_whole={"lora": lora},
          callbacks={"on_log": on_log, "on_eval": on_eval, "on_warning": on_warning}, command=command)
    lora, per_class, watch_every, micro_batches = map(as_int, (lora, per_class, watch_every, micro_batches))
    if prompts is not None and prompts_file is not None:
        raise BadInput("give prompts or prompts_file, not both")
    chosen = _prompts(prompts) if prompts is not None else \
        read_prompts(Path(prompts_file)) if prompts_file is not None else None
    loaded = rl_recipe(card, reward, method, maybe_path(recipe), [*sets, *lora_overrides(lora, sets)])
    # prompts given as a list have no file to name: `--prompts -` (standard input) is how the command takes them
    source = "-" if prompts is not None else prompts_file
    command = command or command_line("rl", [card], [("--reward", reward), ("--method", method), ("--prompts", source),
                                                     ("--recipe", recipe), *_sets(sets), ("--lora", lora),
                                                     ("--data", data)])
    return run(loaded, command=command, prompts=chosen, out=maybe_path(out), run_dir=maybe_path(run_dir),
               resume=resume, device=device, data=maybe_text(data), force=force, evaluate=evaluate, judge=judge,
               held_out_judge=held_out_judge, watch_every=watch_every, on_log=on_log, on_eval=on_eval,
               micro_batches=micro_batches, on_warning=on_warning, per_class=per_class)


@said_as_cardtool_errors
def flywheel(card: str | os.PathLike, *, reward: str | os.PathLike, steps: int | None = None,
             recipe: str | os.PathLike | None = None, overrides: list[str] | str = (), out_prefix: str | None = None,
             out_dir: str | os.PathLike = Path("cards"), run_dir: str | os.PathLike | None = None, resume: bool = False,
             force: bool = False, stop_after: str | None = None, compare: list[str] | str = (),
             per_class: int = 100, judge: str | os.PathLike = "fashion-classifier",
             held_out_judge: str | os.PathLike | None = "fashion-referee", device: str | None = None,
             data: str | os.PathLike | None = None, micro_batches: int = 1, watch_every: int = 0,
             on_log: Callable[[str, dict], None] | None = None, on_stage: Callable[[dict], None] | None = None,
             command: str | None = None):
    """`cardtool flywheel CARD --reward REWARD`: rl on the reward, DMD2 from the RL'd card into a `steps`-step
    student, the three evaluated side by side (up to `stop_after`: rl, distill or eval). `overrides` name their stage
    (`rl.optim.steps=100`). Returns the FlywheelReport (`.to_json()` is `--json`'s document)."""
    from cardtool.core.workflows.flywheel import flywheel as run
    from cardtool.core.workflows.flywheel import flywheel_recipe

    card, reward, sets = card_ref("card", card), card_ref("reward", reward), override_items(overrides)
    compared = [card_ref("compare", c) for c in ([compare] if isinstance(compare, (str, os.PathLike)) else
                                                 sequence("compare", compare))]
    judge, held_out_judge = card_ref("judge", judge), optional_card_ref("held_out_judge", held_out_judge)
    check(texts={"out_prefix": out_prefix, "stop_after": stop_after, "device": device},
          paths={"recipe": recipe, "run_dir": run_dir, "data": data}, flags={"resume": resume, "force": force},
          whole={"per_class": per_class, "micro_batches": micro_batches, "watch_every": watch_every},
          optional_whole={"steps": steps}, callbacks={"on_log": on_log, "on_stage": on_stage}, command=command)
    steps, per_class, micro_batches, watch_every = map(as_int, (steps, per_class, micro_batches, watch_every))
    out_dir = path("out_dir", out_dir)
    loaded = flywheel_recipe(card, reward, steps=steps, path=maybe_path(recipe), overrides=sets, prefix=out_prefix,
                             out_dir=out_dir)
    command = command or command_line("flywheel", [card], [("--reward", reward), ("--steps", steps),
                                                           ("--recipe", recipe), *_sets(sets),
                                                           ("--out-prefix", out_prefix), ("--data", data)])
    return run(loaded, command=command, out_dir=out_dir, run_dir=maybe_path(run_dir), resume=resume, force=force,
               device=device, data=maybe_text(data), judge=judge, held_out_judge=held_out_judge,
               per_class=per_class, compare=compared, stop_after=stop_after, on_log=on_log, on_stage=on_stage,
               micro_batches=micro_batches, watch_every=watch_every)


def _sets(sets: list[str]) -> list[tuple[str, str]]:
    return [("--set", item) for item in sets]


def _prompts(value) -> list[str]:
    """Prompts given as a list: what a prompts file could hold — at least one, each a line of text, within the file's
    size bound."""
    from cardtool.core.training.rl import MAX_PROMPTS_BYTES

    items = [value] if isinstance(value, str) else sequence("prompts", value)
    if not items:
        raise BadInput("prompts is empty; give at least one prompt (or None for the class prompts)")
    for item in items:
        if not isinstance(item, str):
            raise BadInput(f"prompts must be strings, got {item!r}"[:300])
        if len(item.splitlines()) != 1 or not item.strip():
            raise BadInput(f"each prompt is one line of text, as a prompts file holds it; got {item!r}"[:300])
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"the prompt {item!r} holds a lone surrogate, which is not a character"[:300]) from None
    if sum(len(p.encode("utf-8")) + 1 for p in items) > MAX_PROMPTS_BYTES:
        raise BadInput(f"the prompts are more than {MAX_PROMPTS_BYTES >> 20} MiB, a prompts file's bound")
    return items
