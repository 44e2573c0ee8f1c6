"""`model.lora` of an rl or distill recipe (`--lora RANK`): train a LoRA on the frozen transformer instead of the
whole transformer; the output card extends the parent and adds the LoRA, applied by its loop's defaults."""

from __future__ import annotations

from pydantic import ConfigDict, Field, ValidationError

from cardtool.backends.lora_targets import DEFAULT_TARGETS
from cardtool.core.training.recipes import Section, field_problems, one_value
from cardtool.errors import BadInput

__all__ = ["LoraSettings", "lora_overrides", "lora_settings", "LORA_UNSHARDABLE"]

# why a LoRA run takes DDP, not FSDP2 (Task.unshardable)
LORA_UNSHARDABLE = "an adapter's weights are used inside the frozen base's forward (and are small)"
MAX_RANK = 1024


class LoraSettings(Section):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rank: int = Field(ge=1, le=MAX_RANK)
    alpha: float | None = Field(None, gt=0)  # None: alpha = rank (α/r = 1)
    targets: tuple[str, ...] = Field(DEFAULT_TARGETS, min_length=1)  # an empty list is a mistake, not the default

    def model_post_init(self, _) -> None:
        if self.alpha is None:
            object.__setattr__(self, "alpha", float(self.rank))


def lora_settings(recipe, method: str, parent: str) -> LoraSettings | None:
    """The recipe's `model.lora`, validated; None when the whole transformer trains. Any other `model:` key is an
    error (the tuned card keeps the parent's architecture)."""
    model = dict(recipe.model)
    section = model.pop("lora", None)
    if model:
        raise BadInput(f"the {method} card keeps the architecture of '{parent}'; the recipe's model: may only hold "
                       f"lora: (got model.{', model.'.join(sorted(model))})")
    if section is None:
        return None
    try:
        return LoraSettings.model_validate(section)
    except ValidationError as e:
        raise BadInput(f"{method} recipe: {field_problems(e, 'model.lora')}") from None


def lora_overrides(rank, overrides: list[str] = ()) -> list[str]:
    """`--lora RANK` as the recipe override it stands for, `model.lora.rank=RANK`; a rank out of range is said of
    --lora, not of a --set the user never wrote, and one `overrides` sets to another rank is refused."""
    if rank is None:
        return []
    if not (isinstance(rank, int) and not isinstance(rank, bool) and 1 <= rank <= MAX_RANK):
        raise BadInput(f"--lora must be a whole number from 1 to {MAX_RANK}, got {rank!r}"[:300])
    one_value(list(overrides), "model.lora.rank", "--lora", rank)
    return [f"model.lora.rank={rank}"]
