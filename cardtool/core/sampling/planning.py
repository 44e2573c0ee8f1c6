"""A `generate` call's requests: prompts (from the command line, a file or standard input) × seeds, the card's loop
defaults filling what is not given, its adapter stack and control image checked against the card, and the Python
API's arguments checked as strictly as the command line's parser checks them."""

from __future__ import annotations

import collections
import math
import numbers
import os
from pathlib import Path

from cardtool.backends.precision import FLOAT32_MAX
from cardtool.core.cards.loader import Card
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.sampling.control import ControlImage
from cardtool.core.sampling.denoise import Request, shifted_sigmas
from cardtool.errors import BadInput
from cardtool.files import read_small_file, read_stream
from cardtool.words import counted

__all__ = ["LOOP", "MAX_IMAGES", "MissingControl", "adapter_stack", "checked_arguments", "parse_interval",
           "plan_requests", "read_prompts_file", "started_warnings", "unguided_warning"]

LOOP = "denoise"
MAX_IMAGES = 100_000  # one command; beyond this a planning mistake, not a job (script several runs)


def read_prompts_file(path: str | Path, limit: int = 16 << 20) -> list[str]:
    """One prompt a line; blank lines, lines starting with # and a leading byte-order mark are skipped. UTF-8 of at
    most `limit` bytes: a regular file, a pipe (`--prompts-file <(…)`; a named one waits for its writer, as `cat`
    would), or `-`: standard input. Never a device or a folder (/dev/zero never ends)."""
    if str(path) == "-":
        import sys

        if sys.stdin is None:  # closed by the caller (`<&-`)
            raise BadInput("cannot read prompts file: standard input is closed; pipe the prompts in, or give a file")
        text, reason = read_stream(sys.stdin.buffer, "standard input", limit)
    else:
        text, reason = read_small_file(Path(path), limit=limit, pipe=True)
    if reason:
        raise BadInput(f"cannot read prompts file: {reason}")
    lines = text.removeprefix("\ufeff").splitlines()  # a byte-order mark, as some editors write, is not a prompt
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def plan_requests(card: Card, prompts: list[str], *, num: int = 1, seed: int = 0, steps: int | None = None,
                  guidance: float | None = None, shift: float | None = None, solver: str | None = None,
                  guidance_interval: tuple[float, float] | None = None, strict: bool = False,
                  adapters: list[tuple[str, float]] | None = None, control: ControlImage | None = None,
                  control_scale: float | None = None, negative_prompt: str = "") -> tuple[list[Request], list[str]]:
    """Requests for prompts × seeds (seed, seed + 1, … for each prompt's images), the card's loop defaults
    filling what is not given; and warnings (a card assuming a fixed step count sampled with another).

    `adapters` (name, scale) replaces the loop's default stack; a `control` image joins the card's ControlNet to
    the stack when none is named, at `control_scale` (default 1); `negative_prompt` is what CFG's unconditional
    branch is conditioned on instead of the empty prompt (the null condition): what the images should not be."""
    prompts = checked_arguments(prompts, num=num, seed=seed, steps=steps, guidance=guidance, shift=shift,
                       guidance_interval=guidance_interval, adapters=adapters, control_scale=control_scale,
                       texts={"solver": solver, "negative_prompt": negative_prompt})
    if not prompts:
        raise BadInput("no prompts: give -p PROMPT or --prompts-file FILE")
    if not 1 <= num <= MAX_IMAGES or len(prompts) * num > MAX_IMAGES:
        raise BadInput(f"--num must be at least 1 and prompts × num at most {MAX_IMAGES:,}, got {len(prompts)} × {num}")
    if 0 <= seed < 2**63 <= seed + num - 1:  # each Request would say only that its own seed is out of range
        raise BadInput(f"seed {seed} numbers the {num:,} images of a prompt up to seed {seed + num - 1:,}, past "
                       f"2⁶³ − 1; give a seed of at most {2**63 - num:,}")
    loop = card.manifest.loops.get(LOOP)
    if loop is None:
        raise BadInput(f"card '{card.id}' has no '{LOOP}' loop to generate with")
    defaults = FlowDenoiseDefaults.model_validate(loop.defaults)  # validated when the card loaded
    steps = steps if steps is not None else defaults.steps
    warnings = []
    assumed = card.manifest.recipe.assumes.steps
    if assumed is not None and steps != assumed:
        message = f"card '{card.id}' assumes {counted(assumed, 'step')}; sampling with {steps} may give poor images"
        if strict:
            raise BadInput(message + " (--strict)")
        warnings.append(message)
    stack = adapter_stack(card, list(defaults.adapters.items()) if adapters is None else adapters, control,
                          control_scale)
    requests = [Request(prompt=p, seed=seed + j, steps=steps,
                        guidance=float(guidance if guidance is not None else defaults.guidance),
                        shift=float(shift if shift is not None else defaults.shift),
                        solver=defaults.solver if solver is None else solver,
                        guidance_interval=tuple(map(float, guidance_interval or defaults.guidance_interval)),
                        adapters=stack, control=control, negative_prompt=negative_prompt or "")
                for p in prompts for j in range(num)]
    for request in requests:
        request.check()
    if not any(r.guidance != 1 for r in requests):  # settings of CFG's, asked for without CFG: said, not dropped
        if negative_prompt:
            warnings.append("a negative prompt conditions CFG's unconditional branch; with guidance 1 (no CFG) it "
                            "changes nothing")
        if guidance_interval is not None and tuple(map(float, guidance_interval)) != tuple(defaults.guidance_interval):
            warnings.append("a guidance interval limits CFG to a σ range; with guidance 1 (no CFG) it changes nothing")
    empty = next((r for r in requests if r.guidance != 1 and not r.prompt.strip() and not r.negative_prompt), None)
    if empty is not None:  # CFG between the null condition and itself: two rows a step for nothing
        warnings.append(f"an empty prompt samples unconditionally: CFG's two branches are then the same, so guidance "
                        f"{empty.guidance:g} changes nothing for it (guidance 1 makes it at half the cost; or is a "
                        "shell variable unset?)")
    repeated = repeated_prompts(prompts, num, seed)
    unguided = unguided_warning(requests[0])  # every request shares the loop settings
    return requests, warnings + ([repeated] if repeated else []) + ([unguided] if unguided else [])


def repeated_prompts(prompts: list[str], num: int, seed: int) -> str | None:
    """A prompt given twice takes the same seeds twice: its images again, bit for bit — said, since more images of
    one prompt is what --num makes."""
    repeated = [(p, n) for p, n in collections.Counter(prompts).items() if n > 1]
    if not repeated:
        return None
    (prompt, times), others = repeated[0], len(repeated) - 1
    shown = repr(prompt if len(prompt) <= 60 else prompt[:59] + "…")
    seeds = f"seed {seed}" if num == 1 else f"seeds {seed}…{seed + num - 1}"
    also = f" (and {others} other prompt{'s' if others > 1 else ''})" if others else ""
    return (f"prompt {shown} is given {times} times{also}: each time with {seeds}, so its images repeat bit for bit; "
            "-n/--num N makes N images of a prompt from N seeds")


def unguided_warning(request: Request) -> str | None:
    """Where `request` asks for CFG but none of the steps it runs starts at a σ inside its guidance interval ([0, 0],
    say: the grid's last σ is 0, and no step starts there; or an image-to-image start below the interval), the images
    are those of guidance 1: said, not silent."""
    sigmas = shifted_sigmas(request.steps, request.shift)
    run = sigmas[request.first_step(sigmas):-1]
    if request.guidance == 1 or any(map(request.guides_at, run)):
        return None
    low, high = request.guidance_interval
    start = f", from σ {run[0]:g} at strength {request.strength:g}" if request.strength < 1 else ""
    return (f"no step's σ lies in the guidance interval {low:g},{high:g} ({counted(request.steps, 'step')} on shift "
            f"{request.shift:g}{start}): guidance {request.guidance:g} applies to none, and the images are those of "
            "guidance 1; widen the interval")


def started_warnings(warnings: list[str], planned: Request, started: Request) -> list[str]:
    """Planning's `warnings` for requests since started from an image (a strength below 1 skips the grid's first
    steps): the unguided-interval warning said of the steps the start runs."""
    before, after = unguided_warning(planned), unguided_warning(started)
    return [w for w in warnings if w != before] + ([after] if after else [])


def checked_arguments(prompts, *, guidance_interval, adapters, out="", texts=None, on_step=None, on_encode=None,
                      switches=None, **values) -> list[str] | tuple[str, ...]:
    """The prompts — one string is one prompt, as diffusers' pipelines take it, not one image per character — once
    the Python API's arguments have the types the command line's parser guarantees: a wrong one is BadInput naming
    it, not a TypeError deep in the loop or a value silently coerced."""
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, (list, tuple)):
        raise BadInput(f"prompts must be a list of strings (or one string), got {type(prompts).__name__}")
    for name, value in values.items():
        whole = name in ("num", "seed", "steps", "best_of", "max_batch")
        kind = numbers.Integral if whole else numbers.Real
        required = name in ("num", "seed", "best_of", "max_batch")  # the rest take None as the card's default
        if (value is not None or required) and (not isinstance(value, kind) or isinstance(value, bool)):
            raise BadInput(f"{name} must be {'a whole number' if whole else 'a number'}, got {value!r}")
    if out is not None and not isinstance(out, (str, os.PathLike)):
        raise BadInput(f"out must be a path (or None: write nothing), got {out!r}")
    for name, value in (texts or {}).items():
        if value is not None and not isinstance(value, str):
            raise BadInput(f"{name} must be a name (text), got {value!r}")
    for name, value in (switches or {}).items():
        if not isinstance(value, bool):
            raise BadInput(f"{name} must be True or False, got {value!r}"[:300])
    for name, value, of in (("on_step", on_step, "(step, steps)"), ("on_encode", on_encode, "(encoded, prompts)")):
        if value is not None and not callable(value):
            raise BadInput(f"{name} must be a function of {of}, got {value!r}"[:300])
    if guidance_interval is not None and not (
            isinstance(guidance_interval, (list, tuple)) and len(guidance_interval) == 2
            and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in guidance_interval)):
        raise BadInput(f"guidance_interval must be two numbers (LO, HI), got {guidance_interval!r}")
    if adapters is not None and not (
            isinstance(adapters, (list, tuple))
            and all(isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(a[0], str)
                    and isinstance(a[1], numbers.Real) and not isinstance(a[1], bool) for a in adapters)):
        raise BadInput(f"adapters must be (name, scale) pairs, e.g. [('mirror', 0.5)], got {adapters!r}"[:300])
    return prompts


class MissingControl(BadInput):
    """A request whose stack holds a ControlNet and gives it no control image."""


def adapter_stack(card: Card, stack: list[tuple[str, float]], control: ControlImage | None,
                  control_scale: float | None) -> tuple[tuple[str, float], ...]:
    """The request's stack, every name declared by the card; with a control image, its ControlNet in it."""
    declared = card.manifest.adapters
    for i, (name, _) in enumerate(stack):
        if name not in declared:
            from cardtool.core.cards.adapter_names import no_such_adapter

            raise BadInput(no_such_adapter(card, name))
        if any(name == other for other, _ in stack[:i]):  # each copy would add its rank to the stack's product
            raise BadInput(f"adapter '{name}' is named twice; name it once, at the scale wanted (NAME=SCALE)")
    nets = [name for name, _ in stack if declared[name].kind == "controlnet"]
    if control_scale is not None and (control is None or nets):
        raise BadInput("--control-scale sets the scale of the ControlNet --control adds; give it with --control, "
                       "or write NAME=SCALE in --adapter" if control is None else
                       f"give ControlNet '{nets[0]}' one scale: NAME=SCALE in --adapter, or --control-scale")
    if control is not None and not nets:
        available = [name for name, a in declared.items() if a.kind == "controlnet"]
        if len(available) != 1:
            raise BadInput(f"--control needs a ControlNet; card '{card.id}' declares "
                           f"{'none' if not available else ', '.join(available) + ' (name one with --adapter)'}")
        stack = stack + [(available[0], 1.0 if control_scale is None else control_scale)]
    if nets and control is None:  # found when the request is planned, before any model loads
        raise MissingControl(f"ControlNet '{nets[0]}' needs a control image (--control IMAGE)")
    for name, scale in stack:  # the adapters' products run in float32 at most: a scale it cannot hold is no request
        if not math.isfinite(scale) or abs(scale) > FLOAT32_MAX:
            raise BadInput(f"adapter '{name}': a scale of {scale:g} is beyond float32's range (±3.4e38), which its "
                           "products run in")
    return tuple((name, float(scale)) for name, scale in stack)


def parse_interval(text: str) -> tuple[float, float]:
    """`LO,HI` as typed on the command line (a σ range for --guidance-interval)."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise BadInput(f"--guidance-interval takes LO,HI (a σ range such as 0,0.4), got '{text}'")
    return low, high
