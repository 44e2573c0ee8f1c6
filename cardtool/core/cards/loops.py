"""The loop kinds a card may declare, each with a typed schema for its `defaults:` and the component kinds it
runs. `flow_denoise` is the denoise loop of `cardtool.core.sampling.denoise` (flow matching, SD3 / Wan2.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from cardtool.backends.precision import FLOAT32_MAX

__all__ = ["SOLVERS", "LOOP_KINDS", "LoopKind", "FlowDenoiseDefaults", "MAX_STEPS", "MAX_GUIDANCE", "SHIFTS",
           "MAX_ETA", "MAX_PROMPT_CHARS", "Scale"]

SOLVERS = ("euler", "dpmpp_2m", "sde", "renoise")
MAX_STEPS = 1000
MAX_GUIDANCE = 100  # |w|: far past any useful CFG scale, short of overflowing float32 velocities
SHIFTS = (0.01, 100)  # the σ-grid shift's range: beyond it the grid collapses onto σ = 0 or 1
MAX_ETA = 10  # the SDE solver's noise level a (Flow-GRPO: 0.7); far beyond it the step's noise overflows
MAX_PROMPT_CHARS = 1 << 16  # the text encoder reads a few dozen tokens; more is a mistake, not a prompt
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int is a float too


def _in_float32(scale: float) -> float:
    """An adapter's products run in float32 at most: generation refuses a larger scale (planning.adapter_stack), so a
    manifest that sets one is refused when it is validated, not each time it runs."""
    if abs(scale) > FLOAT32_MAX:
        raise ValueError(f"a scale of {scale:g} is beyond float32's range (±3.4e38), which adapters' products run in")
    return scale


Scale = Annotated[Finite, AfterValidator(_in_float32)]


class FlowDenoiseDefaults(BaseModel):
    """What `generate` uses for a setting the request does not give."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: Annotated[int, Field(strict=True, ge=1, le=MAX_STEPS)] = 30
    guidance: Annotated[Finite, Field(ge=-MAX_GUIDANCE, le=MAX_GUIDANCE)] = 4.0
    shift: Annotated[Finite, Field(ge=SHIFTS[0], le=SHIFTS[1])] = 1.0
    solver: Literal[SOLVERS] = "euler"  # type: ignore[valid-type]
    # the σ range of the steps CFG applies to (Kynkäänniemi et al. 2024)
    guidance_interval: tuple[Annotated[Finite, Field(ge=0, le=1)], Annotated[Finite, Field(ge=0, le=1)]] = (0.0, 1.0)
    # the adapter stack of a request that names none (a LoRA card applies its LoRA), adapter name → scale
    adapters: dict[Annotated[str, Field(max_length=128)], Scale] = {}

    @model_validator(mode="after")
    def _ordered(self):
        low, high = self.guidance_interval
        if low > high:
            raise ValueError(f"guidance_interval [{low:g}, {high:g}] must be [LO, HI] with LO ≤ HI")
        return self


@dataclass(frozen=True)
class LoopKind:
    defaults: type[BaseModel]
    needs: tuple[str, ...]  # component kinds it runs, one component of each


LOOP_KINDS = {"flow_denoise": LoopKind(FlowDenoiseDefaults, ("text_encoder", "vae", "dit"))}
