"""A card's adapters at serving time (DESIGN.md invariant 7): per-request stacks `NAME[=SCALE] …`, resolved to
loaded adapter versions when a request starts, and turned into one batch's per-row work (a LoRA plan for the
mixed batch, ControlNet rows).

Hot-swap: an adapter file is re-read when its size, mtime or inode changes, so a new version on disk serves the
next request without reloading the base; a request holds the version it started with until it finishes. A
version is the file's sha256, which PNG metadata and cache keys record with the scale."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from cardtool.errors import BadInput, raise_if_the_machines
from cardtool.files import file_stamp

__all__ = ["AdapterUse", "Loaded", "AdapterStore", "parse_adapter", "stack_record"]


def parse_adapter(text: str) -> tuple[str, float]:
    """`NAME[=SCALE]` as typed after --adapter; the scale defaults to 1."""
    name, sep, raw = text.partition("=")
    if not name:
        raise BadInput(f"--adapter {text!r}: expected NAME or NAME=SCALE")
    if not sep:
        return name, 1.0
    try:
        scale = float(raw)
    except ValueError:
        raise BadInput(f"--adapter {text!r}: the scale '{raw}' is not a number") from None
    if not math.isfinite(scale):
        raise BadInput(f"--adapter {text!r}: the scale must be a finite number")
    return name, scale


@dataclass(frozen=True, eq=False)
class Loaded:
    """One version of one adapter, loaded: LoraWeights for a LoRA, a WanControlNet for a ControlNet."""

    name: str
    kind: str
    version: str
    value: object
    control: str = ""  # a ControlNet's default preprocessor


@dataclass(frozen=True, eq=False)
class AdapterUse:
    adapter: Loaded
    scale: float


def stack_record(stack: tuple[AdapterUse, ...]) -> list[dict]:
    """The stack as PNG metadata and cache keys name it: names, versions, scales."""
    return [{"name": u.adapter.name, "version": u.adapter.version, "scale": u.scale} for u in stack]


class AdapterStore:
    """The adapters of one ModelInstance's card, loaded on first use and re-read when their file changes."""

    def __init__(self, instance):
        self.instance = instance
        self._loaded: dict[str, tuple[tuple, Loaded]] = {}

    def declared(self) -> str:
        return ", ".join(self.instance.card.manifest.adapters) or "none"

    def get(self, name: str) -> Loaded:
        card, spec = self.instance.card, self._spec(name)
        path = card.folder / spec.weights
        stamp = _stamp(name, card, path)
        held = self._loaded.get(name)
        if held is not None and held[0] == stamp:
            return held[1]
        for _ in range(3):
            loaded = self._load(name, spec, card.weights_file(name, "adapters"))  # verifies the declared sha256
            # the file is hashed, checked and read in separate opens: a version written over it meanwhile would
            # serve under the old one's sha256 (in PNG metadata, cache keys) or pass a declared one unchecked
            now = _stamp(name, card, path)
            if now == stamp:
                self._loaded[name] = (stamp, loaded)
                return loaded
            stamp = now
        raise BadInput(f"adapter '{name}' of card '{card.id}': {path} kept changing while it was read; write a new "
                       "version whole (to a new file, then rename it over the old one)")

    def resolve(self, stack) -> tuple[AdapterUse, ...]:
        """A request's stack of (name, scale) as loaded versions; a scale of 0 is no adapter at all."""
        for name, _ in stack:
            self._spec(name)
        uses = tuple(AdapterUse(self.get(name), float(scale)) for name, scale in stack if scale != 0)
        if sum(u.adapter.kind == "controlnet" for u in uses) > 1:
            raise BadInput("a request takes at most one ControlNet (one control image)")
        return uses

    def _spec(self, name: str):
        spec = self.instance.card.manifest.adapters.get(name)
        if spec is None:  # at any scale: a name the card does not declare is a mistake, not an adapter switched off
            from cardtool.core.cards.adapter_names import no_such_adapter

            raise BadInput(no_such_adapter(self.instance.card, name))
        return spec

    def _load(self, name: str, spec, path: Path) -> Loaded:
        from cardtool.core.cards.weight_files import sha256_file

        instance = self.instance
        target = instance.card.manifest.components[spec.target]
        if target.kind != "dit":
            raise BadInput(f"adapter '{name}' targets '{spec.target}', a {target.kind}; adapters apply to a DiT")
        model = instance.component(spec.target)
        if not _takes_adapters(model):  # a plugin's DiT that would ignore them, or fail inside its forward
            raise BadInput(f"adapter '{name}': the '{target.impl}' DiT on {instance.platform.device} takes no "
                           "adapters (its forward has no lora and control arguments)")
        version = sha256_file(path)
        if spec.kind == "lora":
            return Loaded(name, "lora", version, _lora(name, spec, path, version, model, instance.precision))
        from cardtool.backends.builders import wan_controlnet

        net = wan_controlnet(spec.config, path, target.config, instance.platform, instance.precision)
        return Loaded(name, "controlnet", version, net, spec.control)


def _takes_adapters(model) -> bool:
    """Whether the DiT's forward takes a batch's adapters (`lora`, `control`, or any keyword), as cardtool's Wan
    DiTs do."""
    import inspect

    try:
        parameters = inspect.signature(getattr(model, "forward", model)).parameters
    except (TypeError, ValueError):  # a signature Python cannot read: the forward is left to say
        return True
    return {"lora", "control"} <= set(parameters) or \
        any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _stamp(name: str, card, path: Path) -> tuple[int, int, int, int]:
    try:
        return file_stamp(path)
    except OSError as e:
        raise_if_the_machines(e)
        raise BadInput(f"adapter '{name}' of card '{card.id}': cannot read {path}: {e.strerror}") from None


def _lora(name: str, spec, path: Path, version: str, model, precision: str):
    """A LoRA file checked against the model it adapts (names, shapes, rank, targets, header metadata)."""
    from cardtool.backends.lora import lora_weights, read_lora
    from cardtool.core.cards.adapters import lora_reasons
    from cardtool.core.cards.weight_files import read_header

    tensors, metadata = read_lora(path)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    reasons = lora_reasons(read_header(path)[0], metadata, spec, shapes)
    if reasons:
        raise BadInput(f"adapter '{name}' ({path}) does not fit: {'; '.join(reasons[:3])}")
    return lora_weights(tensors, version, spec.rank, float(spec.alpha), model, precision)
