"""`cardtool flywheel CARD --reward R`: reward fine-tuning, then DMD2 distillation *from the RL'd card*, then the
three cards evaluated side by side — the few-step student inherits the RL gains. The card family records base → rl →
distilled in `recipe.parents`.

Each stage is `rl()` / `distill()` itself — the same code as its own command — checkpointing in its own run folder,
so a kill -9 loses at most the work since the stage's last checkpoint, and `--resume` continues the stage that was
running. A stage whose card already exists with the fingerprint of the stage's resolved recipe (recipe and parents'
weights, see `recipe_fingerprint`) is skipped; one that exists with another fingerprint is an error, never
overwritten without `--force`."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.atomic import refuse_stream, write_atomic
from cardtool.core import distributed
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.source import read_source
from cardtool.core.training.derived import check_eval_data, parents_digest, recipe_fingerprint
from cardtool.core.training.recipes import Recipe
from cardtool.errors import BadInput, CardtoolError, CardValidationError, RunFailed, disk_said

__all__ = ["STAGES", "FlywheelRecipe", "FlywheelReport", "flywheel", "flywheel_recipe"]

STAGES = ("rl", "distill", "eval")
SECTIONS = ("method", "rl", "distill")  # a flywheel recipe's keys: each stage's section is that command's recipe
REPORT = "flywheel.json"
_PREFIX_MAX = 100  # PREFIX-grpo-NNNstep stays within a card id's 128 characters


@dataclass
class FlywheelRecipe:
    base: str
    reward: str
    rl: Recipe
    distill: Recipe


def _check_prefix(prefix: str, given: bool) -> None:
    """The new cards' ids begin with the prefix: refused here by the option's name, not later as a recipe's card.id."""
    from cardtool.core.cards.schema import checked_name

    try:
        checked_name(prefix)
        fits = len(prefix) <= _PREFIX_MAX
    except ValueError:
        fits = False
    if not fits:
        where = f"--out-prefix {prefix!r}"[:160] if given else f"the base's name {prefix!r}"[:160]
        raise BadInput(f"{where} cannot begin the new cards' ids (PREFIX-nft-Nstep): an id starts with a letter or "
                       f"digit and uses only letters, digits, '.', '_' and '-'; give --out-prefix of at most "
                       f"{_PREFIX_MAX} such characters")


def flywheel_recipe(base: str, reward: str, *, steps: int | None = None, path: Path | None = None,
                    overrides: list[str] = (), prefix: str | None = None,
                    out_dir: Path = Path("cards")) -> FlywheelRecipe:
    """The two stage recipes: the file's `rl:` and `distill:` sections (each a recipe of that command, over its
    defaults), `--set rl.KEY=V` / `distill.KEY=V` applied to its stage, `--steps` the student's step count. Cards:
    `PREFIX-nft` (or -grpo) and `PREFIX-nft-Nstep`, PREFIX the id the base declares unless given; the student's
    teacher is the RL'd card in `out_dir`."""
    from cardtool.core.training import distill, rl
    from cardtool.core.training.derived import card_name
    from cardtool.core.training.distill import distill_recipe
    from cardtool.core.training.methods.dmd2 import DMD2Settings
    from cardtool.core.training.rl import METHODS, rl_recipe

    sections = _read(path) if path is not None else {}
    split: dict[str, list[str]] = {"rl": [], "distill": []}
    for item in overrides:
        stage, dot, rest = item.partition(".")
        if stage not in split or not dot:
            raise BadInput(f"--set {item!r}: a flywheel override names its stage: rl.KEY=VALUE or distill.KEY=VALUE")
        split[stage].append(rest)
    given = prefix is not None
    if not given:
        prefix = card_name(base)
    _check_prefix(prefix, given)
    method = sections.get("rl", {}).get("method", "diffusion_nft")
    if not isinstance(method, str) or method not in METHODS:
        raise BadInput(f"flywheel rl.method: unknown rl method {method!r}; choose one of: {', '.join(METHODS)}"[:300])

    def label(stage: str) -> str:  # what a stage recipe's error names: the file's section and --set, or defaults
        sets = f" with --set {stage}.…" if split[stage] else ""
        return f"{path}'s {stage} section{sets}" if path is not None else f"{stage} (defaults{sets})"

    stage1 = rl_recipe(base, reward, None, None, split["rl"],
                       section=_with_id(sections.get("rl"), f"{prefix}-{METHODS[method]}"), label=label("rl"),
                       set_prefix="rl.")
    teacher = str(Path(out_dir) / stage1.card.id)
    section = dict(sections.get("distill") or {})
    loss = section.get("loss", {})
    if steps is None and isinstance(loss, dict) and "student_steps" not in loss:
        section["loss"] = {**loss, "student_steps": 2}  # the flywheel's student: two steps unless the recipe says
    provisional = f"{stage1.card.id}-step"  # until the student's steps are known: the file's, then --set's
    stage2 = distill_recipe(teacher, None, split["distill"], steps, section=_with_id(section, provisional),
                            label=label("distill"), set_prefix="distill.")
    rl.check_recipe(stage1)  # both stages now: a mistake in the distill section found after the rl stage's hours
    distill.check_recipe(stage2)
    if stage2.card.id == provisional:  # not named by the recipe or --set: PREFIX-nft-Nstep
        stage2.card.id = f"{stage1.card.id}-{DMD2Settings.from_recipe(stage2.loss).student_steps}step"
    return FlywheelRecipe(base, reward, stage1, stage2)


def _read(path: Path) -> dict:
    """A flywheel recipe file: `method: flywheel` (optional) and the sections `rl:` and `distill:`; a stray key or a
    section that is not a mapping is a located error."""
    try:
        source = read_source(Path(path))
    except CardValidationError as e:
        raise BadInput(f"cannot read recipe: {e}") from None
    problems = []
    for key, value in source.data.items():
        if key not in SECTIONS:
            problems.append(source.problem((key,), "unknown key", f"a flywheel recipe holds {', '.join(SECTIONS)}",
                                           key=True))
        elif key == "method" and value != "flywheel":
            problems.append(source.problem((key,), f"a flywheel recipe has method 'flywheel', got {value!r}",
                                           "run it with the command of its method, or set method: flywheel"))
        elif key != "method" and not isinstance(value, dict):
            problems.append(source.problem((key,), f"the {key} section must be a mapping (a {key} recipe)"))
    if problems:
        raise CardValidationError(problems)
    return source.data


def _with_id(section: dict | None, card_id: str) -> dict:
    """The stage's section with the flywheel's card id, unless the section names its own; a `card:` that is no
    mapping is left for the stage's recipe to refuse."""
    out = dict(section or {})
    card = out.get("card", {})
    if isinstance(card, dict):
        out["card"] = {"id": card_id, **card}
    return out


@dataclass
class FlywheelReport:
    cards: list[dict] = field(default_factory=list)  # one row per card: base, rl'd, student, then --compare
    # the student against the base and each --compare card on the same requests, B − A (paired.paired_differences)
    paired: list[dict] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)  # name, card, skipped, seconds
    judge: str = ""
    held_out_judge: str | None = None
    per_class: int = 0
    platform: str = ""

    def to_json(self) -> dict:
        return {"judge": self.judge, "held_out_judge": self.held_out_judge, "per_class": self.per_class,
                "platform": self.platform, "stages": self.stages, "cards": self.cards, "paired": self.paired}


def flywheel(recipe: FlywheelRecipe, *, command: str, out_dir: Path = Path("cards"), run_dir: Path | None = None,
             resume: bool = False, force: bool = False, device: str | None = None, data: str | None = None,
             judge: str = "fashion-classifier", held_out_judge: str | None = "fashion-referee", per_class: int = 100,
             compare: list[str] = (), stop_after: str | None = None,
             on_log: Callable[[str, dict], None] | None = None,
             on_stage: Callable[[dict], None] | None = None, micro_batches: int = 1,
             watch_every: int = 0) -> FlywheelReport:
    """Run the stages in order (up to `stop_after`); the report has each stage and, after the eval stage, each
    card's accuracy under both judges, FID-FMNIST, model evaluations per image and images/s. Under torchrun every
    stage splits its work by rank (`micro_batches` as in `train_loop`) and rank 0 writes the cards and the report.
    `watch_every`: both training stages watched as their own commands' `--watch-every` (training/watch.py)."""
    from cardtool.backends.platform import Platform
    from cardtool.core.cards.lineage import check_new_folder, check_new_id
    from cardtool.core.evaluation.evaluate import checked_per_class
    from cardtool.core.evaluation.reward import check_held_out, reward_card
    from cardtool.core.training.distill import distill, gan_real_images
    from cardtool.core.training.rl import rl
    from cardtool.core.training.trainer import CHECKPOINT, check_run, made_by, writable_outputs
    from cardtool.core.training.watch import check_every

    if stop_after is not None and stop_after not in STAGES:
        raise BadInput(f"--stop-after must be one of {', '.join(STAGES)}, got '{stop_after}'")
    refuse_stream(out_dir, "the stages' cards are written into a folder", option="--out-dir")
    per_class = checked_per_class(per_class)
    check_every(watch_every)
    if stop_after not in ("rl", "distill"):  # its eval stage judges classes: found now, not after two stages
        check_eval_data(data, "the flywheel's eval", per_class)
    _check_compare(recipe, compare, out_dir)  # before hours of training, not after
    if stop_after not in ("rl", "distill"):  # each card the eval stage compares: a loop each judge can score
        from cardtool.core.evaluation.evaluate import plan_rows

        for ref, judging in itertools.product(compare, [judge, *([held_out_judge] if held_out_judge else [])]):
            plan_rows(ref, judge=judging)
    base = load_card(locate(recipe.base))
    for ref in [recipe.reward, judge, *([held_out_judge] if held_out_judge else [])]:
        reward_card(ref, scores=base)
    check_held_out(held_out_judge, recipe.reward, judge)
    if recipe.distill.card.id == recipe.rl.card.id:
        raise BadInput(f"the rl and distill stages would both write card '{recipe.rl.card.id}'; give them two ids")
    parents = [base, reward_card(recipe.reward)[0]]  # the rl card's; the student's above
    for stage in (recipe.rl, recipe.distill):  # both, before either stage's folders are made
        check_new_id(stage.card.id, parents, "give the new card another id (--out-prefix NAME)")
        check_new_folder(Path(out_dir) / stage.card.id, parents)
    run_dir = Path(run_dir or Path("runs") / f"{recipe.rl.card.id}-flywheel")
    # before the first stage, not after it; an existing stage card is the stage's to skip or (--force) replace
    elsewhere = {"rename": "--out-prefix NAME", "relocate": "--out-dir"}
    writable_outputs(Path(out_dir) / recipe.rl.card.id, run_dir, replace=True, flag="--force",
                     card_id=recipe.rl.card.id, extends=base, **elsewhere)
    writable_outputs(Path(out_dir) / recipe.distill.card.id, run_dir, replace=True, flag="--force",
                     card_id=recipe.distill.card.id, **elsewhere)
    platform = Platform.detect(device)
    for name, stage_recipe in (("rl", recipe.rl), ("distill", recipe.distill))[:1 if stop_after == "rl" else 2]:
        check_run(stage_recipe, platform, micro_batches, f"{name}.")  # the distill stage's now, not after the rl's
    real = gan_real_images(recipe.distill, data) if stop_after != "rl" else None  # found before the rl stage
    shaped_by = {"rl": None, "distill": real.digest() if real is not None else None}  # a new --data: a new student
    # named as the eval stage names them, also in the report of a run stopped before it
    report = FlywheelReport(judge=reward_card(judge)[0].id,
                            held_out_judge=reward_card(held_out_judge)[0].id if held_out_judge else None,
                            per_class=per_class, platform=f"{platform.device}/{platform.arch}")
    common = {"device": device, "data": data, "micro_batches": micro_batches}

    judges = [judge, *([held_out_judge] if held_out_judge else [])]
    watching = {"rl": {"judge": judge, "held_out_judge": held_out_judge},
                "distill": {"judge": judge, "watch_judges": judges}}

    def stage(name: str, stage_recipe: Recipe, run) -> Card:
        out, stage_dir, ranks = Path(out_dir) / stage_recipe.card.id, run_dir / name, distributed.ranks()
        # what a stage finds decides whether it runs, skips or resumes: every rank must decide alike
        ranks.sees(out, "--out-dir")
        ranks.sees(stage_dir / CHECKPOINT, "--run-dir")
        fingerprint = recipe_fingerprint(stage_recipe, shaped_by[name])
        existing, unreadable = _existing(out)
        if existing is not None and existing.manifest.recipe.fingerprint == fingerprint:
            entry = {"stage": name, "card": existing.id, "path": str(out), "skipped": True, "seconds": 0.0}
        else:
            if out.exists() and not force:
                why = f"is not a card that loads ({unreadable})" if unreadable else \
                    f"was not made by this stage's recipe{' and training images' if shaped_by[name] else ''} " \
                    f"(fingerprint {fingerprint[:12]}…)"
                raise BadInput(f"{out} exists but {why}; pass --force to replace it, or choose another --out-prefix")
            # the run of what --force replaces: no run of this recipe resumes it. Every rank looks before rank 0
            # removes it, and none starts the stage before it is gone
            stale = force and _has_checkpoint(stage_dir) and not made_by(stage_dir / CHECKPOINT, stage_recipe,
                                                                          shaped_by[name], parents_digest(stage_recipe))
            ranks.barrier()
            if stale and ranks.main:
                (stage_dir / CHECKPOINT).unlink(missing_ok=True)
            ranks.barrier()
            started = time.perf_counter()
            run(stage_recipe, command=f"{command}  # stage {name}", out=out, run_dir=stage_dir,
                resume=resume and _has_checkpoint(stage_dir), force=force, evaluate=False,
                on_log=(lambda entry: on_log(name, entry)) if on_log else None, watch_every=watch_every,
                **watching[name], **common)
            entry = {"stage": name, "card": stage_recipe.card.id, "path": str(out), "skipped": False,
                     "seconds": round(time.perf_counter() - started, 1)}
        report.stages.append(entry)
        if on_stage:
            on_stage(entry)
        return load_card(out)

    tuned = stage("rl", recipe.rl, rl)
    if stop_after != "rl":
        student = stage("distill", recipe.distill, distill)
        if stop_after != "distill":
            started = time.perf_counter()
            made = {Path(s["path"]).resolve() for s in report.stages if not s["skipped"]}  # skipped: keeps its eval
            _evaluate([str(locate(recipe.base)), str(tuned.folder), str(student.folder),
                       *(str(locate(c)) for c in compare)], report, device, data,
                      record={str(c.folder) for c in (tuned, student) if c.folder.resolve() in made},
                      student=str(student.folder), judge=judge, held_out_judge=held_out_judge)
            entry = {"stage": "eval", "card": None, "skipped": False,
                     "seconds": round(time.perf_counter() - started, 1)}
            report.stages.append(entry)
            if on_stage:
                on_stage(entry)
    if distributed.ranks().main:
        try:
            write_atomic(run_dir / REPORT, (json.dumps(report.to_json(), indent=1) + "\n").encode())
        except OSError as e:  # a full disk: the cards are written, and the table is not lost with the file
            raise RunFailed(f"the flywheel ran, but its report could not be written to {run_dir / REPORT}: "
                            f"{disk_said(e)}; the report is under 'partial' (--json)", report.to_json()) from None
    return report


def _evaluate(folders: list[str], report: FlywheelReport, device: str | None, data: str | None,
              record: set[str], student: str, judge: str, held_out_judge: str | None) -> None:
    """Each card at its own loop defaults under the judge (accuracy, FID, speed) and the held-out judge; the cards
    this run made (`record`) keep theirs (eval.json and the summary, as `cardtool eval --record`). The `student`
    is then compared image pair by image pair with every card but the RL'd one (its teacher) under the judge, as
    `eval STUDENT --versus` would: is it measurably better than the base, than a directly distilled student?"""
    from cardtool.core.cards.record import record_eval, record_metrics
    from cardtool.core.evaluation.evaluate import evaluate
    from cardtool.core.evaluation.paired import paired_differences

    samples = {}
    for folder in folders:
        card = load_card(folder)
        measured = evaluate(folder, judge=judge, per_class=report.per_class, device=device, data=data,
                            keep_samples=True)
        other = evaluate(folder, judge=held_out_judge, per_class=report.per_class, device=device, data=data) \
            if held_out_judge else None
        if measured.rank != 0:  # under torchrun every rank samples its share of each eval, rank 0 measures
            continue
        report.platform, report.judge, first = measured.platform, measured.judge, measured.rows[0]
        samples[folder] = (card.id, measured.samples[0], measured.real)
        held_out = None
        if other is not None:
            report.held_out_judge, held_out = other.judge, other.rows[0].class_accuracy
        if folder in record:
            record_eval(folder, measured.to_json())
            if held_out is not None:
                record_metrics(folder, {"held_out_judge": {"card": report.held_out_judge, "images": first.images,
                                                           "class_accuracy": held_out}})
        report.cards.append({"card": card.id, "method": card.manifest.recipe.method,
                             "parents": card.manifest.recipe.parents, "steps": first.steps,
                             "guidance": first.guidance, "model_evaluations": first.model_evaluations,
                             "class_accuracy": first.class_accuracy, "held_out_accuracy": held_out,
                             "fid_fmnist": first.fid_fmnist, "kid": first.kid,
                             "images_per_second": first.images_per_second})
    if student not in samples:  # under torchrun, a rank other than 0
        return
    name, mine, real = samples[student]
    for folder in [folders[0], *folders[3:]]:
        other, theirs, _ = samples[folder]
        if mine and theirs and mine[0] is not None:  # both measured (no NaN images), with classes to judge
            report.paired.append({"a": other, "b": name, **paired_differences(*theirs, *mine, real)})


def _check_compare(recipe: FlywheelRecipe, compare: list[str], out_dir: Path) -> None:
    """Each --compare card is found, and is not a card the table holds already — the base, the two cards the stages
    write, an earlier --compare — by folder or by id (the table names its rows by id): it would be evaluated again
    and shown twice, and paired against the student, the base's row once more."""
    base = locate(recipe.base)
    seen = {key: f"the base ({recipe.base})" for key in (base.parent.resolve(), load_card(base).id)}
    for stage in (recipe.rl, recipe.distill):
        for key in ((Path(out_dir) / stage.card.id).resolve(), stage.card.id):
            seen[key] = f"the card the flywheel writes ({stage.card.id})"
    for ref in compare:
        file = locate(ref)
        keys = (file.parent.resolve(), load_card(file).id)
        for key in keys:
            if key in seen:
                raise BadInput(f"--compare {ref} is {seen[key]}: the table has its row already; compare another card")
        seen.update(dict.fromkeys(keys, f"given twice (--compare {ref})"))


def _existing(out: Path) -> tuple[Card | None, str]:
    """The card a stage made before at `out`, or None and why a manifest there does not load ('' where none is)."""
    if not ((out / "card.yaml").is_file() or (out / "card.toml").is_file()):
        return None, ""
    try:
        return load_card(out), ""
    except CardtoolError as e:
        return None, str(e).splitlines()[0][:300]


def _has_checkpoint(stage_dir: Path) -> bool:
    from cardtool.core.training.trainer import CHECKPOINT

    return (stage_dir / CHECKPOINT).is_file()
