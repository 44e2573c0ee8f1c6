"""Training recipes: a YAML file plus dotted command-line overrides (`--set optim.lr=3e-4`), in the manner
of litgpt / torchtune, validated strictly so a typo is an error, not a silently ignored key."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from cardtool.backends.precision import FLOAT32_MAX
from cardtool.core.cards.schema import Name
from cardtool.core.cards.source import plain_value_problems, read_source
from cardtool.errors import BadInput, CardValidationError

__all__ = ["Recipe", "LossSettings", "Section", "load_recipe", "apply_overrides", "field_problems", "loss_number",
           "only_keys"]

TRAIN_METHODS = ("vae", "classifier", "pretrain", "finetune", "lora", "controlnet")  # `cardtool train`
DISTILL_METHODS = ("dmd2",)  # `cardtool distill`
RL_METHODS = ("diffusion_nft", "flow_grpo")  # `cardtool rl`
RUN_BY = {**{m: "cardtool distill TEACHER --recipe FILE" for m in DISTILL_METHODS},
          **{m: "cardtool rl CARD --reward REWARD_CARD --recipe FILE" for m in RL_METHODS}}


class Section(BaseModel):
    """A recipe section's model. Numbers stay lax — PyYAML reads 3e-4 as a string, meant as a number — but booleans
    do not: pydantic's lax mode reads true as 1 (`student_steps: true` distilled a one-step student) and 1 or "yes"
    as true. A boolean goes only where a field takes one, and such a field takes only booleans."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # inf weight decay trains to NaN

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_only_as_booleans(cls, value, info: ValidationInfo):
        kinds = _scalar_types(cls.model_fields[info.field_name].annotation)
        numeric = bool(kinds & {int, float})
        if bool in kinds and not numeric and value is not None and not isinstance(value, bool):
            raise ValueError(f"must be true or false, got {value!r}"[:200])
        listed = isinstance(value, (list, tuple))
        if numeric and bool not in kinds and (isinstance(value, bool) or listed and any(isinstance(v, bool)
                                                                                          for v in value)):
            raise ValueError(f"takes {'numbers' if listed else 'a number'}, not true or false (got {value!r})"[:200])
        return value


def _scalar_types(annotation) -> set:
    """The types an annotation is made of, through unions, tuples, lists and Annotated."""
    args = get_args(annotation)
    if not args:
        return {annotation}
    if get_origin(annotation) is Annotated:
        return _scalar_types(args[0])
    return set().union(*(_scalar_types(a) for a in args))


class LossSettings(Section):
    """A method's `loss:` section; errors name the field as `loss.FIELD` and the method."""

    method: ClassVar[str] = ""

    @classmethod
    def from_recipe(cls, section: dict):
        try:
            return cls.model_validate(section)
        except ValidationError as e:
            raise BadInput(f"{cls.method} recipe: {field_problems(e, 'loss')}") from None


def field_problems(error: ValidationError, section: str = "") -> str:
    """A validation error's problems on one line, each named by its dotted field under `section`."""
    return "; ".join(".".join(map(str, (*filter(None, [section]), *err["loc"])))
                     + f": {err['msg'].removeprefix('Value error, ')}" for err in error.errors())


def only_keys(recipe: Recipe, section: str, allowed: tuple[str, ...]) -> None:
    """Refuse keys of a free-form section (`loss:`, `data:`) the method does not read: a misspelt setting would
    otherwise train with the default."""
    unknown = sorted(set(getattr(recipe, section)) - set(allowed))
    if unknown:
        raise BadInput(f"{recipe.method} recipe: unknown {section}.{f', {section}.'.join(unknown)}; its settings: "
                       f"{', '.join(allowed) or 'none'}")


def check_unit_intervals(settings, *names: str) -> None:
    """Each named [LO, HI] setting (None: unset) is a σ or t range, 0 ≤ LO ≤ HI ≤ 1 — a ValueError naming it if not,
    for a `loss:` section's model validator."""
    for name in names:
        value = getattr(settings, name)
        if value is not None and not 0 <= value[0] <= value[1] <= 1:
            raise ValueError(f"{name} must be [LO, HI] with 0 ≤ LO ≤ HI ≤ 1, got {list(value)}")


def loss_number(recipe: Recipe, key: str, default: float, low: float, high: float) -> float:
    """A finite number in [low, high] from the recipe's `loss:` section."""
    value = recipe.loss.get(key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not low <= value <= high):
        raise BadInput(f"{recipe.method} recipe: loss.{key} must be a finite number in [{low:g}, {high:g}], "
                       f"got {value!r}")
    return float(value)


class CardSpec(Section):
    id: Name  # as the card it makes will be validated: refused before training, not after
    description: str = ""
    storage: Literal["float32", "float16", "bfloat16"] = "float32"  # dtype of the weights written


_Beta = Annotated[float, Field(ge=0, lt=1)]


class Optim(Section):
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.999)  # AdamW's moment decays: a 1 would never forget, AdamW refuses it
    warmup: int = Field(0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    batch_size: int = Field(128, ge=1)
    steps: int = Field(1000, ge=1)

    @model_validator(mode="after")
    def _decay_below_one(self):
        # AdamW's decoupled decay multiplies every weight by 1 − lr·wd a step: at lr·wd ≥ 1 it zeroes or flips them
        if self.lr * self.weight_decay >= 1:
            raise ValueError(f"weight_decay {self.weight_decay:g} at lr {self.lr:g} decays the weights by lr × "
                             f"weight_decay = {self.lr * self.weight_decay:g} ≥ 1 a step (AdamW multiplies them by "
                             "1 − lr·weight_decay); keep lr × weight_decay well below 1")
        return self


class Schedule(Section):
    seed: int = Field(0, ge=0)
    precision: Literal["float32", "bfloat16"] = "float32"  # autocast compute; master weights stay float32
    ema: float = Field(0.0, ge=0, lt=1)  # 0 = no EMA
    checkpoint_every: int = Field(200, ge=1)
    log_every: int = Field(50, ge=1)
    # under torchrun: gradients averaged by DistributedDataParallel, or modules sharded by FSDP2 (parallel.py)
    parallel: Literal["ddp", "fsdp"] = "ddp"


class Recipe(Section):
    method: Literal[TRAIN_METHODS + DISTILL_METHODS + RL_METHODS]  # type: ignore[valid-type]
    card: CardSpec
    # cards this one starts from or uses (a VAE, a base to fine-tune, a reward): each method takes one or two
    parents: list[str] = Field([], max_length=2)
    data: dict[str, Any] = {}
    model: dict[str, Any] = {}
    loss: dict[str, Any] = {}
    optim: Optim = Optim()
    train: Schedule = Schedule()

    def shaping(self, exclude: tuple[str, ...] = ()) -> dict:
        """Every setting that shapes the run, less the sections `exclude` names: not how the ranks share the work
        (`train.parallel`), which changes the result only by the order of floating-point sums."""
        return self.model_dump(mode="json", exclude={**dict.fromkeys(exclude, True), "train": {"parallel"}})

    def hyperparameters(self) -> dict:
        """What a card's recipe records besides its id, method and parents."""
        return self.shaping(("card", "method", "parents"))

    def fingerprint(self) -> str:
        """A hash of everything that shapes the run; a resumed run must match it (under either train.parallel)."""
        return hashlib.sha256(json.dumps(self.shaping(), sort_keys=True).encode()).hexdigest()[:16]


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b=value` sets data["a"]["b"] = YAML(value): numbers (3e-4 too), booleans, lists parse as in YAML."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise BadInput(f"--set {item!r}: expected KEY.PATH=VALUE")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise BadInput(f"--set {item!r}: '{part}' is not a section")
        try:
            if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(raw)):
                raise BadInput(f"--set {item!r}: YAML aliases are not allowed; write the value out")
            value = yaml.safe_load(raw)
        except (yaml.YAMLError, ValueError, RecursionError) as e:
            raise BadInput(f"--set {item!r}: value is not YAML: {str(e)[:200]}")
        if isinstance(value, str):
            try:  # PyYAML (YAML 1.1) reads 3e-4 as a string; a number is meant
                value = float(raw)
            except ValueError:
                pass
        problems = plain_value_problems(value, key)
        if problems:
            raise BadInput(f"--set {item[:200]!r}: {'; '.join(problems)}")
        node[parts[-1]] = value
    return out


def one_value(overrides: list[str], key: str, option: str, value) -> None:
    """A command's own option for recipe `key` (distill's --steps, --lora) given beside a --set of `key`: refused
    where the two differ, not one of them dropped without a word."""
    for item in overrides:
        if item.partition("=")[0] != key:
            continue
        node = apply_overrides({}, [item])
        for part in key.split("."):
            node = node[part]
        if node != value or isinstance(node, bool) != isinstance(value, bool):
            raise BadInput(f"{option} {value} and a --set of {key} ({node!r}) give it two values; give one"[:300])


def load_recipe(path: str | Path | None, overrides: list[str] = (), method: str | None = None,
                defaults: dict | None = None, complete=None, section: dict | None = None,
                label: str | None = None, set_prefix: str = "") -> Recipe:
    """Read a recipe (or start from `defaults` alone), apply overrides (and --method), validate; errors name the
    field. The file's values win over `defaults`, overrides over both; `section` (a flywheel recipe's stage) stands
    in for a file, and `label` names it in errors; `complete(data)` may fill in what depends on the merged values
    (distill's student id) before validation. An error in a value an override gave names that --set, as typed:
    `set_prefix` and the override (the flywheel's `rl.`)."""
    data = section or {}
    if path is not None:
        try:  # the manifest reader: bounded size and depth, no aliases, plain types, located errors
            data = read_source(Path(path)).data
        except CardValidationError as e:
            raise BadInput(f"cannot read recipe: {e}")
    data = apply_overrides(_under(defaults or {}, data), list(overrides))
    if method is not None:
        if data.get("method") not in (None, method):
            raise BadInput(f"recipe {path or 'defaults'} is for method '{data['method']}', not '{method}'")
        data["method"] = method
    # `cardtool train`, given another command's recipe (a method that is not a string the schema refuses below)
    if method is None and isinstance(data.get("method"), str) and data["method"] in RUN_BY:
        raise BadInput(f"recipe {path} is for {data['method']}, which `cardtool train` does not run: "
                       f"`{RUN_BY[data['method']]}` does")
    if complete is not None:
        complete(data)
    source = f"recipe {path or label or '(defaults and --set)'}"
    too_large = _beyond_float32(data)
    if too_large:
        where = _set_by(overrides, [too_large.partition(" = ")[0]], set_prefix) or source
        raise BadInput(f"{where}: {too_large}: beyond float32's range (±3.4e38), which training computes in (torch "
                       "refuses such a learning rate or clip as a scalar); use a smaller number")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        where = _set_by(overrides, [".".join(map(str, err["loc"])) for err in e.errors()], set_prefix) or source
        raise BadInput(f"{where}: {field_problems(e)}")


def _set_by(overrides, keys: list[str], prefix: str = "") -> str | None:
    """The --set that gave every one of `keys` (dotted settings a check refused) its value, as the error's subject,
    or None where one came from the recipe file: a user who typed `--set optim.steps=1.5` looks there, not in a file
    whose steps are fine."""
    found = []
    for key in keys:
        givers = [item for item in overrides if key == (k := item.partition("=")[0]) or key.startswith(k + ".")]
        if not givers:
            return None
        found.append(givers[-1])
    return "--set " + ", --set ".join(dict.fromkeys(repr((prefix + item)[:200]) for item in found))


def _beyond_float32(value, path: str = "") -> str | None:
    """The first setting, as KEY.PATH = VALUE, whose finite number a float32 cannot hold, or None (inf and NaN are
    the schema's to refuse)."""
    if isinstance(value, dict):
        return next((found for key, item in value.items()
                     if (found := _beyond_float32(item, f"{path}.{key}" if path else str(key)))), None)
    if isinstance(value, list):
        return next((found for i, item in enumerate(value) if (found := _beyond_float32(item, f"{path}.{i}"))), None)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and FLOAT32_MAX < abs(value) < math.inf:
        return f"{path} = {value:g}"
    return None


def _under(defaults: dict, data: dict) -> dict:
    """`data` over `defaults`, section by section."""
    out = copy.deepcopy(defaults)
    for key, value in data.items():
        out[key] = _under(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
