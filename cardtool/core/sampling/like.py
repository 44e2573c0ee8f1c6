"""`generate --like IMAGE`: the settings an image cardtool made records (its PNG metadata), read back as generate's
options — to make it again, or to change one thing (the seed, the prompt, the card) and keep the rest."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.errors import BadInput, raise_if_the_machines
from cardtool.files import parse_json

__all__ = ["Like", "read_like", "unlike"]

# what decides an image without being an option of the request: a difference means another image, said as a warning
PROVENANCE = ("cardtool", "weights", "platform", "control", "image", "mask")


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
    image: str | None = None  # the file the image started from (image-to-image) as it was given; "" an array
    mask: str | None = None  # its inpainting mask's file, likewise
    metadata: dict[str, str] = field(default_factory=dict)


def read_like(path: Path | str) -> Like:
    """The request recorded in PNG `path`; BadInput for a file that is not an image cardtool's generate made."""
    from PIL import Image

    from cardtool.core.sampling.images import read_png_metadata

    path = Path(path)
    try:
        metadata = read_png_metadata(path)
    except Image.UnidentifiedImageError:
        raise BadInput(f"--like {path}: not a PNG; a generation's settings are recorded in the PNG cardtool writes "
                       "(a JPEG or another format made from it keeps none)") from None
    except Exception as e:  # noqa: BLE001 - PIL's many errors for a damaged image
        if isinstance(e, OSError):
            raise_if_the_machines(e)
        raise BadInput(f"--like {path}: not a readable image ({type(e).__name__}: {e})"[:300]) from None
    if "cardtool" not in metadata or "card" not in metadata:
        raise BadInput(f"--like {path}: not an image cardtool made (its PNG records no card and settings)")
    if "seed" not in metadata and "request_seed" not in metadata:  # a --grid records its card, not one request
        raise BadInput(f"--like {path}: records no request (a --grid of several images records none); give --like "
                       "one of the images it shows")
    text = _Fields(path, metadata)
    image, control = text.picture("image"), text.control()
    if "input" in metadata:  # a workflow's chain: refined from another step's image, found where the workflow wrote it
        found = _workflow_input(path, metadata)
        if found is None:
            raise BadInput(f"--like {path}: made by refining an image of step '{metadata['input'].split('/')[0]}' "
                           f"in workflow '{metadata.get('workflow', '?')}', which is not beside it; run the workflow "
                           "again (cardtool workflow run)")
        image = str(found) if "strength" in metadata else None  # strength 1 (not recorded) forgot it
        if control is not None and not control[0].parts:  # `control: input` (no file): the input was the control
            control = (found, control[1])
    settings = {"steps": text.whole("steps"), "guidance": text.number("guidance"), "shift": text.number("shift"),
                "guidance_interval": text.interval("guidance_interval"), "solver": text.name("solver"),
                "precision": text.name("precision"), "adapters": text.adapters(),
                "fuse": metadata.get("fused") == "true", "strength": text.number("strength")}
    if "best_of" in metadata:
        settings |= {"best_of": text.whole("best_of"), "reward": text.card_id("reward")}
    seed = text.whole("request_seed" if "best_of" in metadata else "seed")  # best-of: the request's, not the pick's
    return Like(path, text.card_id("card"), metadata.get("prompt", ""), metadata.get("negative_prompt", ""), seed,
                settings, control, image, text.picture("mask"), metadata)


def _workflow_input(path: Path, metadata: dict[str, str]) -> Path | None:
    """The input image a workflow's chain step refined into the image at `path`: step S's image K, written beside
    it as WORKFLOW/S/KKK-…-TAG.png with the tag the image records (None where it is not there, or the record does
    not name one safely: a PNG from elsewhere may hold anything)."""
    step, _, index = metadata.get("input", "").partition("/")
    tag = metadata.get("input_tag", "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", step) or not index.isdecimal() or len(index) > 6 \
            or not re.fullmatch(r"[0-9a-f]{8}", tag):
        return None
    found = sorted(path.resolve().parent.parent.joinpath(step).glob(f"{int(index):03d}-*-{tag}.png"))
    return found[0] if len(found) == 1 and found[0].is_file() else None


def unlike(like: Like, made: dict[str, str]) -> list[str]:
    """What differs between the image asked to be like and one made from its settings, beyond the options the
    command changed: its weights, platform, cardtool version, control image, start image or mask — a reason the image
    is not the same."""
    differ = [key for key in PROVENANCE if _identity(key, like.metadata.get(key)) != _identity(key, made.get(key))
              and not (key == "image" and "input" in like.metadata)]  # a chain's: its input, found beside it
    if "weights" in differ:  # which components' weights: named when both records are maps of versions
        try:
            old, new = parse_json(like.metadata.get("weights", "{}")), parse_json(made.get("weights", "{}"))
        except ValueError:
            old = new = None
        if isinstance(old, dict) and isinstance(new, dict):
            changed = sorted(str(k) for k in {*old, *new} if old.get(k) != new.get(k))
            differ[differ.index("weights")] = "weights of " + ", ".join(changed)
    for key in ("platform", "cardtool"):  # short records worth showing: which machine or version made it
        if key in differ:
            there, here = (_cut(record.get(key)) for record in (like.metadata, made))
            differ[differ.index(key)] = f"{key} ({there} there, {here} here)"
    return differ


def _cut(value: str | None) -> str:
    return "none recorded" if value is None else value if len(value) <= 40 else value[:39] + "…"


def _identity(key: str, value: str | None):
    """What tells two records of `key` apart: an image to start from, a mask or a control image by its content (and
    a control image's preprocessor), wherever its file was."""
    if key not in ("image", "mask", "control") or value is None:
        return value
    try:
        record = parse_json(value)
        return (record.get("sha256"), record.get("preprocessor")) if key == "control" else record.get("sha256")
    except (ValueError, AttributeError):
        return value


class _Fields:
    """The metadata's text fields as typed values (None where absent), a malformed one a BadInput naming it."""

    def __init__(self, path: Path, metadata: dict[str, str]):
        self.path, self.metadata = path, metadata

    def _typed(self, key: str, convert):
        if key not in self.metadata:
            return None
        try:
            return convert(self.metadata[key])
        except (ValueError, TypeError, KeyError, BadInput):
            raise BadInput(f"--like {self.path}: its '{key}' field is malformed: {self.metadata[key]!r}"[:300]) \
                from None

    def name(self, key: str) -> str | None:
        return self.metadata.get(key) or None

    def card_id(self, key: str) -> str | None:
        """A card's id, as a manifest spells it: never a path, which a PNG from elsewhere could point anywhere."""
        from cardtool.core.cards.schema import checked_name

        return self._typed(key, checked_name)

    def whole(self, key: str) -> int | None:
        return self._typed(key, int)

    def number(self, key: str) -> float | None:
        return self._typed(key, _finite)

    def interval(self, key: str) -> tuple[float, float] | None:
        from cardtool.core.sampling.planning import parse_interval

        return self._typed(key, parse_interval)

    def adapters(self) -> list[tuple[str, float]]:
        """The stack as (name, scale), a ControlNet's entry too (with the control image, it is the same request);
        [] for an image made without one (the card's default stack may differ)."""
        def stack(text: str) -> list[tuple[str, float]]:
            entries = [(entry["name"], _finite(entry["scale"])) for entry in parse_json(text)]
            if not all(isinstance(name, str) for name, _ in entries):
                raise ValueError("an adapter's name is not text")
            return entries

        return self._typed("adapters", stack) or []

    def control(self) -> tuple[Path, str] | None:
        """The control image's file as it was given, and its preprocessor."""
        def record(text: str) -> tuple[Path, str]:
            fields = parse_json(text)
            return Path(fields["source"]), str(fields["preprocessor"])

        return self._typed("control", record)

    def picture(self, key: str) -> str | None:
        """The file the image started from (`image`) or its mask (`mask`), as it was given ("": an array)."""
        def record(text: str) -> str:
            source = parse_json(text)["source"]
            if not isinstance(source, str):
                raise ValueError("its source is not text")
            return source

        return self._typed(key, record)


def _finite(value) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{number} is not finite")
    return number
