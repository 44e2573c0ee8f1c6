"""`cardtool distill TEACHER`: DMD2 through the shared trainer, then the student card — it `extends` the teacher
(text encoder and VAE by reference), replaces the transformer, and its loop defaults are exactly the sampling rule
it was trained with (`steps: N`, `solver: renoise`, `guidance: 1`) — and, unless asked not to, its eval at them and
its accuracy under a held-out judge."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cardtool.backends.platform import Platform
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.training.derived import (
    check_eval_data,
    default_id,
    evaluate_output,
    extends_reference,
    held_out_output,
    parents_digest,
    recipe_fingerprint,
    trained_parts,
    write_output,
)
from cardtool.core.training.recipes import Recipe, only_keys
from cardtool.core.training.trainer import check_start, train_loop, writable_outputs
from cardtool.core.training.watch import Watch, check_every, watched
from cardtool.errors import BadInput

__all__ = ["check_recipe", "distill", "distill_recipe", "gan_real_images", "student_id"]


def check_recipe(recipe: Recipe) -> None:
    """What `distill` refuses in a recipe, found without loading a card or data — so a run scheduled after another
    (the flywheel's distill stage) fails before the first one, not after it."""
    from cardtool.core.training.lora_settings import lora_settings
    from cardtool.core.training.methods.dmd2 import DMD2Settings

    if recipe.method != "dmd2" or len(recipe.parents) != 1:
        raise BadInput("distill runs a dmd2 recipe with exactly one parent, the teacher")
    only_keys(recipe, "data", ("folder",))
    DMD2Settings.from_recipe(recipe.loss)
    lora_settings(recipe, "student", recipe.parents[0])


def gan_real_images(recipe: Recipe, data: str | None):
    """The class-labelled training images the GAN term takes as real (`loss.gan_real: data`; --data, else the
    recipe's folder), else None — teacher samples need none."""
    from cardtool.core.training.methods.dmd2 import DMD2Settings

    settings = DMD2Settings.from_recipe(recipe.loss)
    if not (settings.gan and settings.gan_real == "data"):
        return None
    from cardtool.core.data import load_split

    folder = recipe.data.get("folder") if data is None else data
    return load_split("train", folder).classes("loss.gan's real images by class")


def student_id(teacher: str, steps) -> str:
    return default_id(teacher, f"{steps}step")


def distill_recipe(teacher: str, path: Path | None = None, overrides: list[str] = (),
                   steps: int | None = None, section: dict | None = None, label: str | None = None,
                   set_prefix: str = "") -> Recipe:
    """The recipe `cardtool distill` runs: the file (or DMD2's defaults) with `--set` and `--steps` applied, the
    teacher as its one parent, and the student id `TEACHER-Nstep` unless the recipe names one."""
    from cardtool.core.cards.loops import MAX_STEPS
    from cardtool.core.training.methods.dmd2 import DEFAULTS
    from cardtool.core.training.recipes import load_recipe, one_value

    def counts(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if steps is not None and not (counts(steps) and steps <= MAX_STEPS):  # said of --steps, not of the --set it becomes
        raise BadInput(f"--steps must be a whole number from 1 to {MAX_STEPS}, got {steps!r}"[:300])

    def complete(data: dict) -> None:
        data["parents"] = [teacher]
        card = data.setdefault("card", {})
        if isinstance(card, dict) and "id" not in card:
            loss = data.get("loss") if isinstance(data.get("loss"), dict) else {}
            asked = loss.get("student_steps")  # one the loss check refuses names no card: its own error comes
            card["id"] = student_id(teacher, asked if counts(asked) else DEFAULTS["loss"]["student_steps"])

    if steps is not None:
        one_value(overrides, "loss.student_steps", "--steps", steps)
    sets = [*overrides, *([f"loss.student_steps={steps}"] if steps is not None else [])]
    return load_recipe(path, sets, "dmd2", defaults=DEFAULTS, complete=complete, section=section, label=label,
                       set_prefix=set_prefix)


def distill(recipe: Recipe, *, command: str, out: Path | None = None, run_dir: Path | None = None,
            resume: bool = False, device: str | None = None, data: str | None = None, force: bool = False,
            evaluate: bool = True,
            judge: str = "fashion-classifier", held_out_judge: str | None = "fashion-referee",
            on_log: Callable[[dict], None] | None = None, on_eval: Callable[[dict], None] | None = None,
            micro_batches: int = 1, watch_every: int = 0, watch_judges: list[str] | None = None,
            per_class: int = 100, on_warning: Callable[[str], None] | None = None) -> Card:
    """`held_out_judge`: after the eval under `judge`, the student's class accuracy under this second judge (None:
    none) is recorded beside it, as `rl` records it — a student of an RL'd teacher inherits what the reward taught it,
    hacks included. `watch_every`: every N iterations the student, sampled at its own steps, judged by `watch_judges`
    (default: `judge`) — see watch.py. `per_class`: the eval's images a class."""
    from cardtool.core.data import provenance
    from cardtool.core.evaluation.evaluate import checked_per_class
    from cardtool.core.training.methods.dmd2 import DMD2Settings, DMD2Task

    check_recipe(recipe)
    check_every(watch_every)
    per_class = checked_per_class(per_class)
    watch_judges = watch_judges or [judge]
    platform = Platform.detect(device)
    teacher = load_card(locate(recipe.parents[0]))
    out = Path(out or Path("cards") / recipe.card.id)
    run_dir = Path(run_dir or Path("runs") / recipe.card.id)
    writable_outputs(out, run_dir, replace=force, flag="--force", card_id=recipe.card.id, parents=[teacher],
                     extends=teacher)
    if evaluate or watch_every:
        from cardtool.core.evaluation.reward import check_held_out, reward_card

        judges = [judge, *([held_out_judge] if held_out_judge else [])]
        for name in judges * evaluate + watch_judges * bool(watch_every):
            reward_card(name, scores=teacher)  # before hours of training, not after
        if evaluate:
            check_held_out(held_out_judge, None, judge)
    if evaluate:
        check_eval_data(data, "the eval after distilling (--no-eval skips it)", per_class)
    settings = DMD2Settings.from_recipe(recipe.loss)
    train = gan_real_images(recipe, data)
    digest = train.digest() if train is not None else None  # a resume must see the same real images
    parents = parents_digest(recipe)
    check_start(recipe, platform, run_dir, resume=resume, micro_batches=micro_batches, data=digest, parents=parents)
    task = DMD2Task(recipe, platform, teacher, train)
    task.data, task.parents = digest, parents
    if task.cache.problem and on_warning is not None:  # the cache cannot be written: the run goes on, in memory
        on_warning(task.cache.problem)
    student = {"steps": settings.student_steps, "guidance": 1.0, "shift": settings.shift, "solver": "renoise"}
    watch = Watch(teacher, task.name, task.generator, task.cache, student, watch_judges, platform,
                  recipe.train.precision, data=data) if watch_every else None
    result = train_loop(task, recipe, platform, run_dir, resume=resume, on_log=watched(on_log, watch, watch_every),
                        micro_batches=micro_batches)
    settings = task.settings
    metrics = {"iterations": result.steps, "generator_updates": -(-result.steps // settings.generator_every),
               "train_seconds": round(result.seconds, 1), "final_loss": round(result.final_loss, 6),
               "platform": f"{platform.device}/{platform.arch}"}
    steps = settings.student_steps
    parts, weights, metadata, defaults = trained_parts(result.modules["transformer"], task.name, task.lora, "dmd2",
                                                       teacher)
    manifest = {
        "schema": "cardtool/v1", "id": recipe.card.id,
        "description": recipe.card.description or f"{steps}-step DMD2 student of {teacher.id}",
        "extends": extends_reference(teacher, out),
        **parts,
        "loops": {"denoise": {"defaults": {**student, **defaults}}},
        "recipe": {"method": "dmd2", "parents": [teacher.id], "assumes": {"loop": "denoise", "steps": steps},
                   "command": command, "fingerprint": recipe_fingerprint(recipe, task.data),
                   **({"data": provenance(train, "train")} if train is not None else {}),  # the GAN term's images
                   "hyperparameters": recipe.hyperparameters(),
                   "metrics": metrics},
        "parity": {"consistency": "C1"},
    }
    card = write_output(out, manifest, weights, run_dir, storage=recipe.card.storage, overwrite=force,
                        metadata=metadata)
    if evaluate:
        card = evaluate_output(card, judge, device, data, on_eval, per_class)
        if held_out_judge:
            card = held_out_output(card, held_out_judge, device, data, on_eval, per_class)
    return card
