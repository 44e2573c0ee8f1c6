"""`generate --like IMAGE`: the settings an image cardtool made records (its PNG metadata), read back as generate's
options — to make it again, or to change one thing (the seed, the prompt, the card) and keep the rest."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.errors import BadInput

__all__ = ["Like", "read_like", "unlike"]

# what decides an image without being an option of the request: a difference means another image, said as a warning
PROVENANCE = ("cardtool", "weights", "platform", "control")


@dataclass
class Like:
    """An image's request: its card id, prompts and seed, and its settings as `LoadedCard.generate`'s keywords (steps,
    guidance, solver, precision, adapters, best-of …), which belong to its card: another card has its own."""

    path: Path
    card: str
    prompt: str
    negative_prompt: str
    seed: int | None
    settings: dict = field(default_factory=dict)
    control: tuple[Path, str] | None = None  # the control image file as it was given, and its preprocessor
    metadata: dict[str, str] = field(default_factory=dict)


def read_like(path: Path | str) -> Like:
    """The request recorded in PNG `path`; BadInput for a file that is not an image cardtool's generate made."""
    import io

    from PIL import Image

    from cardtool.files import read_small_file_bytes

    path = Path(path)
    data, reason = read_small_file_bytes(path, limit=64 << 20)  # never blocking on a FIFO or reading a device
    if reason:
        raise BadInput(f"--like: {reason}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            metadata = dict(getattr(image, "text", {}))
    except Image.UnidentifiedImageError:
        raise BadInput(f"--like {path}: not an image") from None
    except Exception as e:  # noqa: BLE001 - PIL's many errors for a damaged image
        raise BadInput(f"--like {path}: not a readable image ({type(e).__name__}: {e})"[:300]) from None
    if "cardtool" not in metadata or "card" not in metadata:
        raise BadInput(f"--like {path}: not an image cardtool made (its PNG records no card and settings)")
    if "workflow" in metadata:
        raise BadInput(f"--like {path}: made by step '{metadata.get('step', '?')}' of workflow "
                       f"'{metadata['workflow']}'; run the workflow again (cardtool workflow run)")
    text = _Fields(path, metadata)
    settings = {"steps": text.whole("steps"), "guidance": text.number("guidance"), "shift": text.number("shift"),
                "guidance_interval": text.interval("guidance_interval"), "solver": text.name("solver"),
                "precision": text.name("precision"), "adapters": text.adapters(),
                "fuse": metadata.get("fused") == "true"}
    if "best_of" in metadata:
        settings |= {"best_of": text.whole("best_of"), "reward": text.name("reward")}
    seed = text.whole("request_seed" if "best_of" in metadata else "seed")  # best-of: the request's, not the pick's
    return Like(path, text.name("card"), metadata.get("prompt", ""), metadata.get("negative_prompt", ""), seed,
                settings, text.control(), metadata)


def unlike(like: Like, made: dict[str, str]) -> list[str]:
    """What differs between the image asked to be like and one made from its settings, beyond the options the
    command changed: its weights, platform, cardtool version or control image — a reason the image is not the same."""
    differ = [key for key in PROVENANCE if like.metadata.get(key) != made.get(key)]
    if "weights" in differ:  # which components' weights: named when both records are maps of versions
        try:
            old, new = json.loads(like.metadata.get("weights", "{}")), json.loads(made.get("weights", "{}"))
        except ValueError:
            old = new = None
        if isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(str(k) for k in {*old, *new} if old.get(k) != new.get(k))
            differ[differ.index("weights")] = "weights of " + ", ".join(changed)
    return differ


class _Fields:
    """The metadata's text fields as typed values, a malformed one a BadInput naming the field."""

    def __init__(self, path: Path, metadata: dict[str, str]):
        self.path, self.metadata = path, metadata

    def _bad(self, key: str) -> BadInput:
        return BadInput(f"--like {self.path}: its '{key}' field is malformed: {self.metadata.get(key)!r}"[:300])

    def name(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value or None

    def whole(self, key: str) -> int | None:
        if key not in self.metadata:
            return None
        try:
            return int(self.metadata[key])
        except ValueError:
            raise self._bad(key) from None

    def number(self, key: str) -> float | None:
        if key not in self.metadata:
            return None
        try:
            value = float(self.metadata[key])
        except ValueError:
            raise self._bad(key) from None
        if not math.isfinite(value):
            raise self._bad(key)
        return value

    def interval(self, key: str) -> tuple[float, float] | None:
        if key not in self.metadata:
            return None
        from cardtool.core.sampling.generate import parse_interval

        try:
            return parse_interval(self.metadata[key])
        except BadInput:
            raise self._bad(key) from None

    def adapters(self) -> list[tuple[str, float]]:
        """The stack as (name, scale); [] for an image made without one (the card's default stack may differ)."""
        if "adapters" not in self.metadata:
            return []
        try:
            stack = [(entry["name"], float(entry["scale"])) for entry in json.loads(self.metadata["adapters"])]
        except (ValueError, TypeError, KeyError):
            raise self._bad("adapters") from None
        if not all(isinstance(name, str) and math.isfinite(scale) for name, scale in stack):
            raise self._bad("adapters")
        return stack  # a ControlNet's entry too: with the control image, it is the same request

    def control(self) -> tuple[Path, str] | None:
        if "control" not in self.metadata:
            return None
        try:
            record = json.loads(self.metadata["control"])
            return Path(record["source"]), str(record["preprocessor"])
        except (ValueError, TypeError, KeyError):
            raise self._bad("control") from None
