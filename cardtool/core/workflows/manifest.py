"""Workflow manifests (`cardtool/v1`, kind `workflow`, YAML or TOML): named steps that generate with a card, refine an
earlier step's images with another card (`chain`), fan one input out to several cards (`parallel`), or keep the best
of N samples under a reward card (`best_of_n`). Validated as strictly as cards: unknown keys and wrong types, a step
reading an output no step makes, a cycle, a card that cannot be found, a reward that is not a reward card — each a
located problem (file:line:column, field, fix)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cardtool.backends.precision import PRECISIONS
from cardtool.core.cards.loops import MAX_GUIDANCE, MAX_PROMPT_CHARS, MAX_STEPS, SHIFTS, SOLVERS, Finite, Scale
from cardtool.core.cards.schema import Name
from cardtool.core.cards.schema_errors import schema_problems
from cardtool.core.cards.source import Source, read_source
from cardtool.core.training.recipes import apply_overrides
from cardtool.errors import CardtoolError, CardValidationError, Problem
from cardtool.paths import home_expanded

__all__ = ["KINDS", "Workflow", "WorkflowManifest", "load_workflow"]

KINDS = ("generate", "chain", "parallel", "best_of_n")
MAX_IMAGES = 10_000  # per step
Prompt = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]  # as generate takes one


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class _Sampling(_Strict):
    """Loop settings a step may set, as `generate` takes them; the card's loop defaults fill the rest."""

    steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    guidance: float | None = Field(None, ge=-MAX_GUIDANCE, le=MAX_GUIDANCE)
    guidance_interval: list[Finite] | None = Field(None, min_length=2, max_length=2)  # [LO, HI]: σ range CFG acts on
    shift: float | None = Field(None, ge=SHIFTS[0], le=SHIFTS[1])
    solver: Literal[SOLVERS] | None = None  # type: ignore[valid-type]
    precision: Literal[PRECISIONS] | None = None  # type: ignore[valid-type]
    seed: int = Field(0, ge=0)
    adapters: dict[Name, Scale] | None = None  # the stack (adapter → scale) instead of the card's default one
    negative_prompt: Prompt = ""  # what CFG steers away from, instead of the empty prompt
    # the card's ControlNet's control image: IMAGE[:PREPROCESSOR] (a path relative to the workflow), or, for a step
    # with an input, input[:PREPROCESSOR] — each input image the control of its own output
    control: str | None = Field(None, min_length=1)
    control_scale: Scale | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.control_scale is not None and self.control is None:
            raise ValueError("control_scale sets the scale of the ControlNet a control image adds; give control too")
        if self.guidance_interval is not None:
            low, high = self.guidance_interval
            if not 0 <= low <= high <= 1:
                raise ValueError(f"guidance_interval [{low:g}, {high:g}] must be [LO, HI] with 0 ≤ LO ≤ HI ≤ 1")
        return self


class _Prompted(_Sampling):
    prompts: list[Prompt] = Field(min_length=1)
    num: int = Field(1, ge=1, le=MAX_IMAGES)  # images per prompt, seeds seed, seed + 1, …


class GenerateStep(_Prompted):
    card: str
    # image-to-image from a file beside the workflow (as `generate --image`), re-noised to σ = strength (default 0.8;
    # with a mask — inpainting, its white part generated — 1)
    image: str | None = Field(None, min_length=1)
    mask: str | None = Field(None, min_length=1)
    strength: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _bounded(self):
        if self.image is None and (self.mask is not None or self.strength is not None):
            raise ValueError(f"{'mask' if self.mask is not None else 'strength'} applies to an image to start from; "
                             "give image too")
        if self.strength == 1 and self.mask is None:
            raise ValueError("strength 1 re-noises the image away entirely; give a strength below 1, or a mask")
        return _at_most(self, len(self.prompts) * self.num, "prompts × num")


class ChainStep(_Sampling):
    """Refine another step's images with `card`: each is encoded, re-noised to σ = strength and denoised (SDEdit)."""

    input: Name
    card: str
    strength: float = Field(0.5, gt=0, le=1)


class ParallelStep(_Sampling):
    """One input fanned out to every card in order: the same prompts (generate), or another step's images (chain,
    with `strength`); outputs merged card by card in the listed order."""

    cards: list[str] = Field(min_length=1)
    prompts: list[Prompt] | None = Field(None, min_length=1)
    num: int = Field(1, ge=1, le=MAX_IMAGES)
    input: Name | None = None
    strength: float = Field(0.5, gt=0, le=1)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompts is None) == (self.input is None):
            raise ValueError("a parallel step takes either prompts or an input step, not both or neither")
        return _at_most(self, len(self.cards) * len(self.prompts or [""]) * self.num, "cards × prompts × num")


class BestOfNStep(_Prompted):
    card: str
    reward: str
    n: int = Field(ge=1, le=1024)

    @model_validator(mode="after")
    def _bounded(self):
        return _at_most(self, len(self.prompts) * self.num * self.n, "prompts × num × n")


def _at_most(step, count: int, what: str):
    """A step samples at most MAX_IMAGES images: beyond that a planning mistake, not a job."""
    if count > MAX_IMAGES:
        raise ValueError(f"{what} = {count:,} images; a step samples at most {MAX_IMAGES:,}")
    return step


class Step(_Strict):
    """One step: exactly one of the kinds."""

    generate: GenerateStep | None = None
    chain: ChainStep | None = None
    parallel: ParallelStep | None = None
    best_of_n: BestOfNStep | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a step has exactly one kind ({', '.join(KINDS)}); this one has "
                             f"{', '.join(given) or 'none'}")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def body(self):
        return getattr(self, self.kind)


class WorkflowManifest(_Strict):
    schema_: Literal["cardtool/v1"] = Field(alias="schema")
    kind: Literal["workflow"]
    id: Name
    description: str = ""
    steps: dict[Name, Step] = Field(min_length=1)


@dataclass
class Workflow:
    manifest: WorkflowManifest
    source: Source
    order: list[str]  # the steps in an order where every input comes first

    @property
    def folder(self) -> Path:
        return self.source.file.parent

    def card_ref(self, ref: str) -> str:
        """A card named in the workflow: an id (searched from the workflow's folder too), or a path relative to it
        (a leading ~: the home folder)."""
        ref = home_expanded(ref)
        return str(self.folder / ref) if "/" in ref or ref.startswith(".") else ref

    def file(self, path: str | Path) -> Path:
        """An image file the workflow names: relative to its folder, a leading ~ the home folder."""
        return self.folder / home_expanded(str(path))


def load_workflow(file: str | Path, overrides: list[str] = (), *, check_cards: bool = True) -> Workflow:
    """Parse, apply `--set` overrides (`steps.ID.KIND.FIELD=VALUE`), validate; every problem found is reported
    together, located in the file."""
    source = read_source(Path(file))
    data = apply_overrides(source.data, list(overrides)) if overrides else source.data
    try:
        manifest = WorkflowManifest.model_validate(data)
    except ValidationError as e:
        raise CardValidationError(schema_problems(e, data, (source,), WorkflowManifest)) from None
    problems, order = _graph(manifest, source)
    problems += [] if problems else _count_problems(manifest, source, order)
    workflow = Workflow(manifest, source, order)
    if check_cards and not problems:
        problems += _card_problems(workflow)
    if problems:
        raise CardValidationError(problems)
    return workflow


def _inputs(step: Step) -> list[str]:
    name = getattr(step.body, "input", None)
    return [name] if name is not None else []


def _graph(manifest: WorkflowManifest, source: Source) -> tuple[list[Problem], list[str]]:
    """Each input names a step; no cycles. Returns problems and a dependency order (depth-first). Walked with a
    stack of its own, not Python's: a chain of thousands of steps is a long workflow, not a RecursionError."""
    problems, order, state = [], [], {}
    for root in manifest.steps:
        if root in state:
            continue
        state[root] = "active"
        stack = [(root, iter(_inputs(manifest.steps[root])))]
        while stack:
            name, pending = stack[-1]
            needed = next(pending, None)
            if needed is None:  # every input placed: this step comes next
                stack.pop()
                state[name] = "done"
                order.append(name)
                continue
            step = manifest.steps[name]
            if needed not in manifest.steps:
                problems.append(source.problem(("steps", name, step.kind, "input"),
                                               f"step '{name}' reads the output of '{needed}', which no step makes",
                                               f"name one of: {', '.join(manifest.steps)}"))
            elif state.get(needed) == "active":
                trail = [n for n, _ in stack]
                cycle = trail[trail.index(needed):] + [needed]
                problems.append(source.problem(("steps", name, step.kind, "input"),
                                               f"steps {' → '.join(cycle)} form a cycle",
                                               "a step may only read the images of steps that do not read its own"))
            elif needed not in state:
                state[needed] = "active"
                stack.append((needed, iter(_inputs(manifest.steps[needed]))))
    return problems, order


def _count_problems(manifest: WorkflowManifest, source: Source, order: list[str]) -> list[Problem]:
    """The images each step makes, counted through the dependency order (a step that refines makes one per input image
    and card): at most MAX_IMAGES a step, which a step's own fields cannot show for an input; and their seeds —
    seed … seed + num − 1 per prompt, seed + k per input image — below 2⁶³, as generate refuses otherwise."""
    problems, made = [], {}
    for name in order:
        step = manifest.steps[name]
        body, cards = step.body, len(getattr(step.body, "cards", [None]))
        refines = getattr(body, "input", None) is not None
        numbered = made[body.input] if refines else body.num  # the seeds one card's images take
        made[name] = cards * (numbered if refines else len(body.prompts) * body.num)
        if refines and made[name] > MAX_IMAGES:
            problems.append(source.problem(
                ("steps", name, step.kind, "input"), f"{cards} card(s) × the {numbered:,} images of step "
                f"'{body.input}' = {made[name]:,} images; a step samples at most {MAX_IMAGES:,}",
                "refine fewer images, or with fewer cards"))
        if body.seed + numbered - 1 >= 2**63:
            problems.append(source.problem(
                ("steps", name, step.kind, "seed"), f"seed {body.seed} numbers the step's images up to seed "
                f"{body.seed + numbered - 1:,}, past 2⁶³ − 1", f"give a seed of at most {2**63 - numbered:,}"))
    return problems


def _made_size(card) -> int | None:
    """The size of the images a loaded card makes (None: unknown, or the card could not be loaded)."""
    from cardtool.core.evaluation.reward import image_size

    return None if isinstance(card, CardtoolError) else image_size(card)


def _card_problems(workflow: Workflow) -> list[Problem]:
    """Every card can be found and loaded; a `reward` is a reward card; a step that samples has a denoise loop."""
    from cardtool.core.cards.adapter_names import likely_meant
    from cardtool.core.cards.discovery import locate
    from cardtool.core.cards.loader import load_card
    from cardtool.core.data import CLASS_NAMES
    from cardtool.core.evaluation.reward import cannot_score, named_class, not_a_reward

    problems, loaded = [], {}  # each card loaded once, however many steps name it

    def load(ref: str):
        if ref not in loaded:
            try:
                loaded[ref] = load_card(locate(workflow.card_ref(ref), near=workflow.folder))
            except CardtoolError as e:
                loaded[ref] = e
        return loaded[ref]

    for name, step in workflow.manifest.steps.items():
        body = step.body
        refs = [("card", body.card)] if hasattr(body, "card") else [(f"cards.{i}", c) for i, c in enumerate(body.cards)]
        refs += [("reward", body.reward)] if step.kind == "best_of_n" else []
        for field, ref in refs:
            at = ("steps", name, step.kind, *field.split("."))
            card = load(ref)
            if isinstance(card, CardtoolError):
                problems.append(workflow.source.problem(at, f"card '{ref}' cannot be used: {str(card).splitlines()[0]}",
                                                        "name a card id or a card folder"))
                continue
            if field == "reward" and (reason := not_a_reward(card)):
                problems.append(workflow.source.problem(at, reason, "name a reward card such as fashion-classifier"))
            elif field == "reward" and not isinstance(scored := load(body.card), CardtoolError) and \
                    (reason := cannot_score(card, scored)):
                problems.append(workflow.source.problem(at, reason, "name a card and a reward card made for the "
                                                        "same images"))
            elif field == "reward" and "text_encoder" not in card.manifest.components:  # it reads class names only
                for i, prompt in enumerate(body.prompts):
                    if named_class(prompt) is None:
                        problems.append(workflow.source.problem(
                            ("steps", name, step.kind, "prompts", str(i)),
                            f"prompt {prompt[:60]!r} names no class, and reward card '{card.id}' has no text encoder "
                            "to find the nearest", f"name the garment ({', '.join(CLASS_NAMES)})"))
            elif field != "reward" and "denoise" not in card.manifest.loops:
                problems.append(workflow.source.problem(at, f"card '{card.id}' has no denoise loop to sample with",
                                                        "name a text-to-image card"))
            elif field != "reward":
                declared = card.manifest.adapters
                for adapter in body.adapters or {}:
                    if adapter not in declared or declared[adapter].kind != "lora":
                        loras = ", ".join(n for n, a in declared.items() if a.kind == "lora") or "none"
                        hint = likely_meant(card, adapter) if adapter not in declared else None
                        problems.append(workflow.source.problem(
                            ("steps", name, step.kind, "adapters", adapter), f"card '{card.id}' declares no LoRA "
                            f"'{adapter}'", hint or f"name one of its LoRAs: {loras}"))
                if body.control is not None and not any(a.kind == "controlnet" for a in declared.values()):
                    problems.append(workflow.source.problem(
                        ("steps", name, step.kind, "control"), f"card '{card.id}' has no ControlNet to take a "
                        "control image", "name a card that declares one (fashion-silhouette), or drop control"))
        if body.control is not None:
            problems += _control_problems(workflow, name, step)
        for field in ("image", "mask"):
            path = getattr(body, field, None)
            if path is not None and (reason := _unreadable(workflow, path, field)):
                problems.append(workflow.source.problem(("steps", name, step.kind, field), reason,
                                                        "give an image file"))
    return problems + _size_problems(workflow, load)


def _unreadable(workflow: Workflow, path, what: str) -> str | None:
    """Why the image file `path` (relative to the workflow) cannot be read — decoded, as its step would read it — or
    None: found before any step runs, not when its step does."""
    from cardtool.core.sampling.control import read_grey
    from cardtool.files import is_regular_file

    if not is_regular_file(workflow.file(path)):
        return f"{what} {path} is not a file (paths are relative to the workflow)"
    try:
        read_grey(workflow.file(path), 1, what)
    except CardtoolError as e:
        return str(e).replace(str(workflow.file(path)), str(path))
    return None


def _size_problems(workflow: Workflow, load) -> list[Problem]:
    """A step that takes another step's images (to refine, or as its control) takes them at its cards' image size:
    each card of the input step must make that size (its VAE re-encodes them; a mismatch failed midway)."""
    steps, problems = workflow.manifest.steps, []

    def sizes(step: Step) -> dict[int, str]:
        body = step.body
        refs = [body.card] if hasattr(body, "card") else body.cards
        return {size: ref for ref in refs if (size := _made_size(load(ref))) is not None}

    for name, step in steps.items():
        source = next((steps[i] for i in _inputs(step) if i in steps), None)
        if source is None:
            continue
        made, taken = sizes(source), sizes(step)
        for size, ref in taken.items():
            for other, maker in made.items():
                if other != size:
                    problems.append(workflow.source.problem(
                        ("steps", name, step.kind, "input"), f"card '{ref}' takes {size}×{size} images; step "
                        f"'{step.body.input}' makes {other}×{other} ones (card '{maker}')",
                        "chain cards whose VAEs take the same image size"))
    return problems


def _control_problems(workflow: Workflow, name: str, step: Step) -> list[Problem]:
    """A step's control: an image file beside the workflow, or `input` where the step has one; a known
    preprocessor."""
    from cardtool.core.sampling.control import parse_control

    at = ("steps", name, step.kind, "control")
    try:
        path, _ = parse_control(step.body.control)
    except CardtoolError as e:
        return [workflow.source.problem(at, str(e).replace("--control ", "control ", 1),
                                        "write IMAGE[:PREPROCESSOR] or input[:PREPROCESSOR]")]
    if str(path) == "input":
        if not _inputs(step):
            return [workflow.source.problem(at, f"step '{name}' has no input image to take as its control",
                                            "give a control image file, or an input step")]
        return []
    if reason := _unreadable(workflow, path, "control image"):
        return [workflow.source.problem(at, reason, "give an image file, or input[:PREPROCESSOR] for a step with an "
                                        "input")]
    return []
