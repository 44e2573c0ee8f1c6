"""What `generate` writes: each image's file (named by its prompt, seed and settings tag, or the one NAME.png asked
for), the metadata its PNG carries — enough to make it again — and the images an interrupted run already wrote."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cardtool import __version__
from cardtool.atomic import refuse_stream, replaceable_file, writable_folder
from cardtool.core.sampling.control import ControlImage
from cardtool.core.sampling.denoise import DenoiseLoop, Request
from cardtool.core.sampling.images import IMAGE_SUFFIXES, save_png
from cardtool.core.sampling.planning import LOOP
from cardtool.errors import BadInput, RunFailed, disk_said

if TYPE_CHECKING:
    import numpy as np

__all__ = ["JSON_FIELDS", "STREAM_REFUSED", "GeneratedImage", "adapter_metadata", "already_made", "image_metadata",
           "output_paths", "prompt_slug", "save_image", "settings_tag"]

# the metadata fields that record a JSON value (reported as that value); every other field is text, a prompt that
# reads like JSON ("[a dress", '{"x": 1}') too
JSON_FIELDS = ("weights", "adapters", "control", "image", "mask", "scores")

STREAM_REFUSED = "images are written as PNG files that carry their metadata"  # `--out -` (atomic.refuse_stream)


@dataclass
class GeneratedImage:
    """One image: its file (None where the call wrote none: `out=None`), its metadata, and its pixels (H × W
    uint8, grey) for a script to use without reading the file back."""
    path: Path | None
    metadata: dict[str, str]
    pixels: np.ndarray | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict:
        path = None if self.path is None else str(self.path)
        return {"path": path, **{k: json.loads(v) if k in JSON_FIELDS else v for k, v in self.metadata.items()}}


def output_paths(out: Path, card_id: str, requests: list[Request], tags: list[str]) -> list[Path]:
    """A file for a single image given as NAME.png, else numbered files in the folder `out`, each name ending in
    its request's settings tag; checked writable before any work is done."""
    refuse_stream(out, STREAM_REFUSED, alternative=", or NAME.png for one image")
    if out.suffix.lower() in set(IMAGE_SUFFIXES) - {".png"} and not os.path.isdir(out):
        raise BadInput(f"--out {out}: images are written as PNG, which holds their metadata; name the file "
                       f"{out.with_suffix('.png').name}, or give a folder")
    if out.suffix.lower() == ".png" and not os.path.isdir(out):  # an existing folder named like a PNG is a folder
        if len(requests) != 1:
            raise BadInput(f"--out {out} names one file, but {len(requests)} images are asked for; give a folder")
        paths, folder = [replaceable_file(out, "--out")], out.parent
    else:
        folder = out
        paths = [out / f"{card_id}-{i:03d}-{prompt_slug(r.prompt)}-seed{r.seed}-{tag}.png"
                 for i, (r, tag) in enumerate(zip(requests, tags, strict=True))]
    writable_folder(folder, "the output folder")
    return paths


def not_over_inputs(paths: list[Path | None], inputs: dict[str, object]) -> None:
    """No image is written over a file the call reads (`--image`, `--mask`, `--control`, as given): it would replace the
    input the image was made from, and which its metadata names."""
    written = {os.path.realpath(path): path for path in paths if path is not None}
    for option, value in inputs.items():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, (str, os.PathLike)) and str(item) and os.path.realpath(item) in written:
                raise BadInput(f"--out {written[os.path.realpath(item)]} is the {option} file this call reads "
                               f"({item}): the image written there would replace it; give another --out")


def already_made(paths: list[Path], tags: list[str], requests: list[Request], ranks) -> dict[int, tuple]:
    """The images already on disk as this call would make them — a file at the request's path whose metadata holds
    the request's settings tag — as (GeneratedImage, request, its pixels), by index. Rank 0's folder decides: it
    writes every image."""
    from cardtool.core.sampling.images import DAMAGED, read_png

    found = {}
    if ranks.main:
        for i, path in enumerate(paths):
            if not path.is_file():
                continue
            try:
                image, metadata = read_png(path)
            except DAMAGED:  # not a PNG we can read: made again
                continue
            if metadata.get("tag") == tags[i]:
                found[i] = (GeneratedImage(path, metadata, image), requests[i], image)
    indices = ranks.all_gather(sorted(found))[0] if ranks.world > 1 else sorted(found)
    return found if ranks.main else dict.fromkeys(indices)


def settings_tag(settings) -> str:
    """Eight hex digits of a hash of everything that decides an image (its metadata: card, weights versions,
    prompt, seed, every setting, adapters, platform, precision): the end of its file name, so a run with other
    settings never overwrites an earlier image, while the same command again rewrites its files with the same bits."""
    import hashlib

    text = json.dumps(settings, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def image_metadata(loop: DenoiseLoop, request: Request) -> dict[str, str]:
    """What a PNG records about the image: card, weights versions, every setting of its request, platform and
    precision — enough to make it again."""
    instance, platform = loop.instance, loop.instance.platform
    versions = {name: instance.weights_version(name) for name in instance.card.manifest.loops[LOOP].uses}
    metadata = {"cardtool": __version__, "card": instance.card.id, "weights": json.dumps(versions, sort_keys=True),
                "prompt": request.prompt, "negative_prompt": request.negative_prompt,
                "seed": str(request.seed), "steps": str(request.steps), "guidance": repr(request.guidance),
                "shift": repr(request.shift), "guidance_interval": ",".join(map(repr, request.guidance_interval)),
                "solver": request.solver, "platform": f"{platform.device}/{platform.arch}",
                "precision": instance.precision}
    if request.strength < 1:
        metadata["strength"] = repr(request.strength)
    if request.adapters:  # the versions now on disk; `generate` records those its states held
        metadata.update(adapter_metadata(instance.adapters.resolve(request.adapters), request.control, False))
    return metadata


def adapter_metadata(stack, control: ControlImage | None, fused: bool) -> dict[str, str]:
    """What a PNG records about its adapters: each one's name, version (sha256) and scale; the control image."""
    from cardtool.core.sampling.adapters import stack_record

    out = {}
    if stack:
        out["adapters"] = json.dumps(stack_record(stack))
    if fused:
        out["fused"] = "true"
    if control is not None:
        out["control"] = json.dumps({"sha256": control.digest, "preprocessor": control.preprocessor,
                                     "source": control.source})
    return out


def save_image(path: Path, pixels, metadata: dict) -> None:
    """Write one PNG: a name the file system refuses is bad input, a disk that fails (full, gone) fails the run."""
    import errno

    try:
        save_png(path, pixels, metadata)
    except OSError as e:  # the folder passed the probe, so a full disk or a file system that refuses the name
        error = BadInput if e.errno in (errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ) else RunFailed
        raise error(f"cannot write {path}: {disk_said(e)}") from None


def prompt_slug(prompt: str) -> str:
    """A file-name part for a prompt: its ASCII words, or — for a prompt with none (another script, only symbols) — a
    short hash of it, so such prompts stay told apart; `unconditional` for the empty prompt alone."""
    import hashlib

    words = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40]
    if words or not prompt.strip():
        return words or "unconditional"
    return "prompt-" + hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:8]
