"""What every component implementation declares, light enough for `cards validate` (no torch): its config
schema (typed, ranged, cross-field rules, unknown keys refused), what it needs on disk (weights or a source
folder), and the exact tensors (names and shapes) its weights file must hold for a given config."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cardtool.errors import BadInput

__all__ = ["ComponentConfig", "Count", "Size", "FiniteFloat", "config_problems", "short_repr"]

Count = Annotated[int, Field(strict=True, ge=1, le=1024)]  # layers, heads, channels of a small image
Size = Annotated[int, Field(strict=True, ge=1, le=65536)]  # widths
FiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int is a float too


class ComponentConfig(BaseModel):
    """A component's `config:` mapping. Subclasses add fields and `tensors`; `needs` says what the card
    must give besides the config."""

    # strictness per field (ints and floats strict; a list from YAML may fill a tuple)
    model_config = ConfigDict(extra="forbid", frozen=True)
    needs: ClassVar[Literal["weights", "source"]] = "weights"

    @classmethod
    def from_card(cls, config: dict, impl: str = ""):
        """The config of a card's component; any problem is a BadInput naming the field."""
        problems = config_problems(cls, config)
        if problems:
            where, message, fix = problems[0]
            raise BadInput(f"{impl or cls.__name__} config: {'.'.join(where) or 'config'}: {message} (fix: {fix})")
        return cls.model_validate(config)

    def to_card(self) -> dict:
        """As a card's YAML-friendly mapping (tuples as lists)."""
        return self.model_dump(mode="json")

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """The weights file's tensors, name → shape, exactly (no more, no fewer)."""
        return {}

    def source_problems(self, source: Path) -> list[str]:
        """Why the `source` folder cannot serve this implementation (needs = "source"); empty when it can."""
        return []

    def setting_problems(self, source: Path) -> list[tuple[tuple[str, ...], str, str]]:
        """(config field, message, fix) for a setting the `source` folder cannot serve (once it can serve the
        implementation at all)."""
        return []

    def facts(self, source: Path | None = None) -> dict:
        """Sizes other components must agree with (e.g. `text_dim`, `latent_channels`), for loop checks."""
        return {}


def config_problems(cls: type[BaseModel], config) -> list[tuple[tuple[str, ...], str, str]]:
    """(field path inside the config, message, fix) for each thing wrong with `config` as a `cls` (a config
    schema, or any strict pydantic model such as a loop's defaults); empty when valid."""
    if not isinstance(config, dict):
        return [((), f"a config is a mapping, got {short_repr(config)}", "write key: value pairs")]
    try:
        cls.model_validate(config)
    except ValidationError as e:
        known = list(cls.model_fields)
        out = []
        for error in e.errors():
            where = tuple(str(part) for part in error["loc"])
            if error["type"] == "extra_forbidden":
                close = difflib.get_close_matches(where[-1], known, n=1) or \
                    [k for k in known if k.startswith(where[-1]) or where[-1].startswith(k)]
                fix = f"did you mean '{close[0]}'?" if close else f"remove it; known: {', '.join(known)}"
                out.append((where, "unknown key", fix))
            else:
                message = error["msg"].removeprefix("Value error, ")
                got = "" if error["type"] == "value_error" else f", got {short_repr(error.get('input'))}"
                out.append((where, message + got, "correct the value"))
        return out
    return []


def short_repr(value) -> str:
    """A value for an error message: bounded, and never int-to-str on an integer of thousands of digits."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() < 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, (float, str)):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"
