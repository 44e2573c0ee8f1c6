"""ModelInstance: a loaded card. Components are materialised lazily through the platform's COMPONENTS
registry, shared by reference between the loops that use them, and versioned by the content hash of
their tensors (the key caches use, DESIGN.md invariant 6)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cardtool.backends.platform import Platform
from cardtool.backends.precision import check_precision
from cardtool.backends.registry import COMPONENTS
from cardtool.core.cards.loader import Card
from cardtool.core.cards.weight_files import sha256_file, tensor_digest
from cardtool.errors import BadInput
from cardtool.files import file_stamp, is_regular_file

__all__ = ["ModelInstance"]


class ModelInstance:
    """Components of `card` on `platform` at compute `precision` (precision.py; the card's assumed precision by
    default). `warnings` says when the platform runs that precision slowly."""

    def __init__(self, card: Card, platform: Platform | None = None, precision: str | None = None):
        self.card = card
        self.platform = platform or Platform.detect()
        self.precision = card.manifest.recipe.assumes.precision if precision is None else precision
        try:
            self.warnings = check_precision(self.platform, self.precision)
        except BadInput as e:
            raise BadInput(f"card '{card.id}': {e}") from None
        self._awake: dict[str, Any] = {}
        self._versions: dict[str, str] = {}
        self._arrays = None
        self._adapters = None
        self.build_seconds = 0.0  # spent building components: loading the card, not making images with it

    def __repr__(self) -> str:
        return f"ModelInstance({self.card.id} on {self.platform.device}/{self.platform.arch}, {self.precision})"

    def component(self, name: str) -> Any:
        """Component `name`, built on first use (its weights' sha256 verified) and kept until `sleep`."""
        if name not in self._awake:
            started = time.perf_counter()
            spec = self._spec(name)
            cell, build = COMPONENTS.resolve(spec.impl, self.platform)
            before = spec.weights and _stamp(self.card.folder / spec.weights)
            weights = self.card.weights_file(name) if spec.weights else None
            module = build(spec.config, weights, self.card.source_path(name), _on(self.platform, cell.key[1]),
                           self.precision)
            # checked and read in separate opens: a file replaced in between (a run overwriting the card) would
            # serve weights the manifest's sha256 does not describe
            if weights and _stamp(weights) != before:
                raise BadInput(f"card '{self.card.id}': the weights of '{name}' ({weights}) changed while they were "
                               "loaded — another run is replacing the card? Load it again once that run is done")
            self._awake[name] = module
            self.build_seconds += time.perf_counter() - started
        return self._awake[name]

    def use(self, name: str, module: Any) -> None:
        """Serve component `name` from `module` (a training method's live weights) instead of the card's file,
        so the project's one loop samples exactly what is being trained. Its version is then `live`."""
        self._spec(name)
        self._awake[name], self._versions[name] = module, "live"

    @property
    def adapters(self):
        """The card's adapters, loaded on first use and re-read when their files change (adapters.py)."""
        if self._adapters is None:
            from cardtool.core.sampling.adapters import AdapterStore

            self._adapters = AdapterStore(self)
        return self._adapters

    @property
    def arrays(self):
        """The array namespace (torch on cpu/cuda, numpy on the numpy rung) the loops work in."""
        if self._arrays is None:
            cell, build = COMPONENTS.resolve("arrays", self.platform)
            self._arrays = build({}, None, None, _on(self.platform, cell.key[1]), self.precision)
        return self._arrays

    def loop_components(self, loop: str) -> dict[str, Any]:
        """The components a loop uses, by name: the same objects every other loop gets."""
        loops = self.card.manifest.loops
        if loop not in loops:
            raise BadInput(f"card '{self.card.id}' has no loop '{loop}'; loops: {', '.join(loops) or 'none'}")
        return {name: self.component(name) for name in loops[loop].uses}

    def weights_version(self, name: str) -> str:
        """Content hash of component `name`'s tensors, computed from its files without building it; for a source
        folder (a pretrained encoder) also of the files beside them that decide its output — config and
        tokenizer — so that editing one is a new version, not a stale cache entry."""
        if name not in self._versions:
            files = self._weight_files(name)
            if not files:
                raise BadInput(f"component '{name}' of card '{self.card.id}' has no safetensors weights to version")
            self._versions[name] = files[0][1] if len(files) == 1 else \
                _combine([digest for _, digest in files])
        return self._versions[name]

    def is_awake(self, name: str) -> bool:
        return name in self._awake

    def sleep(self, name: str | None = None) -> None:
        """Free one component (or all); the next use builds it again from disk."""
        for key in [name] if name else list(self._awake):
            self._awake.pop(key, None)

    def wake(self, name: str) -> Any:
        return self.component(name)

    def _spec(self, name: str):
        components = self.card.manifest.components
        if name not in components:
            raise BadInput(f"card '{self.card.id}' has no component '{name}'; components: {', '.join(components)}")
        return components[name]

    def _weight_files(self, name: str) -> list[tuple[Path, str]]:
        spec = self._spec(name)
        if spec.weights:
            path = self.card.weights_file(name)
            return [(path, tensor_digest(path))]
        source = self.card.source_path(name)
        if source is None or not source.is_dir():
            return []
        weights = [(path, tensor_digest(path)) for path in sorted(source.glob("*.safetensors"))]
        # config.json, tokenizer.json, vocab.txt, spiece.model …: what transformers reads beside the weights
        beside = [(path, sha256_file(path)) for path in sorted(source.iterdir())
                  if path.suffix in _DECIDING and is_regular_file(path)]
        return weights + beside if weights else []


_DECIDING = (".json", ".txt", ".model")  # a source folder's config and tokenizer files


def _on(platform: Platform, device: str) -> Platform:
    """The platform a cell runs on: a numpy component on a CPU platform runs on the numpy rung."""
    return platform if device == platform.device else Platform(device, "generic")


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        return file_stamp(path)
    except OSError:  # gone: changed
        return None


def _combine(digests: list[str]) -> str:
    import hashlib

    return hashlib.sha256("|".join(digests).encode()).hexdigest()
