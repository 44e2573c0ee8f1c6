"""`cardtool generate`: plan requests from a card's loop defaults and the user's options, run them through
the denoise loop with step-level batching, and write PNGs carrying their generation metadata."""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cardtool import __version__
from cardtool.atomic import replaceable_file, writable_folder
from cardtool.backends.platform import Platform
from cardtool.core import distributed
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.sampling.control import ControlImage
from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages, Request
from cardtool.core.sampling.images import grid_image, save_png
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.errors import BadInput, RunFailed
from cardtool.files import read_small_file

__all__ = ["GeneratedImage", "GenerateReport", "LoadedCard", "generate", "image_metadata", "parse_interval",
           "plan_requests", "read_prompts_file", "save_image"]

LOOP = "denoise"
MAX_IMAGES = 100_000  # one command; beyond this a planning mistake, not a job (script several runs)
GRID_SIDE = 64  # prompts (rows) and images a prompt (columns) a --grid shows


@dataclass
class GeneratedImage:
    path: Path
    metadata: dict[str, str]

    def to_json(self) -> dict:
        return {"path": str(self.path), **{k: _json_value(v) for k, v in self.metadata.items()}}


@dataclass
class GenerateReport:
    card: str
    platform: str
    images: list[GeneratedImage]
    grid: Path | None = None
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    rank: int = 0  # under torchrun, the process this report is from: rank 0 has every image, the others none
    skipped: int = 0  # images kept from an earlier run (skip_existing), listed with the others

    def to_json(self) -> dict:
        return {"card": self.card, "platform": self.platform, "images": [i.to_json() for i in self.images],
                "grid": str(self.grid) if self.grid else None, "warnings": self.warnings,
                "seconds": round(self.seconds, 3), "skipped": self.skipped,
                "images_per_second": round((len(self.images) - self.skipped) / self.seconds, 3) if self.seconds
                else None}


def read_prompts_file(path: str | Path) -> list[str]:
    """One prompt a line; blank lines and lines starting with # are skipped. A regular UTF-8 file of at most
    16 MiB (never a FIFO or a device, which could block or never end), or `-`: standard input, as piped."""
    limit = 16 << 20
    if str(path) == "-":
        import sys

        data = sys.stdin.buffer.read(limit + 1) if sys.stdin is not None else b""
        text, reason = "", f"standard input is larger than {limit} bytes" if len(data) > limit else ""
        if not reason:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                reason = "standard input is not UTF-8 text"
    else:
        text, reason = read_small_file(Path(path), limit=limit)
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
    prompts = _checked(prompts, num=num, seed=seed, steps=steps, guidance=guidance, shift=shift,
                       guidance_interval=guidance_interval, adapters=adapters, control_scale=control_scale,
                       texts={"solver": solver, "negative_prompt": negative_prompt})
    if not prompts:
        raise BadInput("no prompts: give -p PROMPT or --prompts-file FILE")
    if not 1 <= num <= MAX_IMAGES or len(prompts) * num > MAX_IMAGES:
        raise BadInput(f"--num must be at least 1 and prompts × num at most {MAX_IMAGES:,}, got {len(prompts)} × {num}")
    loop = card.manifest.loops.get(LOOP)
    if loop is None:
        raise BadInput(f"card '{card.id}' has no '{LOOP}' loop to generate with")
    defaults = FlowDenoiseDefaults.model_validate(loop.defaults)  # validated when the card loaded
    steps = steps if steps is not None else defaults.steps
    warnings = []
    assumed = card.manifest.recipe.assumes.steps
    if assumed is not None and steps != assumed:
        message = f"card '{card.id}' assumes {assumed} steps; sampling with {steps} may give poor images"
        if strict:
            raise BadInput(message + " (--strict)")
        warnings.append(message)
    stack = adapter_stack(card, list(defaults.adapters.items()) if adapters is None else adapters, control,
                          control_scale)
    requests = [Request(prompt=p, seed=seed + j, steps=steps,
                        guidance=float(guidance if guidance is not None else defaults.guidance),
                        shift=float(shift if shift is not None else defaults.shift),
                        solver=solver or defaults.solver,
                        guidance_interval=tuple(map(float, guidance_interval or defaults.guidance_interval)),
                        adapters=stack, control=control, negative_prompt=negative_prompt or "")
                for p in prompts for j in range(num)]
    for request in requests:
        request.check()
    if negative_prompt and not any(r.guidance != 1 for r in requests):
        warnings.append("a negative prompt conditions CFG's unconditional branch; with guidance 1 (no CFG) it "
                        "changes nothing")
    return requests, warnings


def _checked(prompts, *, guidance_interval, adapters, out="", texts=None, on_step=None, switches=None,
             **values) -> list[str] | tuple[str, ...]:
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
    if not isinstance(out, (str, os.PathLike)):
        raise BadInput(f"out must be a path, got {out!r}")
    for name, value in (texts or {}).items():
        if value is not None and not isinstance(value, str):
            raise BadInput(f"{name} must be a name (text), got {value!r}")
    for name, value in (switches or {}).items():
        if not isinstance(value, bool):
            raise BadInput(f"{name} must be True or False, got {value!r}"[:300])
    if on_step is not None and not callable(on_step):
        raise BadInput(f"on_step must be a function of (step, steps), got {on_step!r}")
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


def adapter_stack(card: Card, stack: list[tuple[str, float]], control: ControlImage | None,
                  control_scale: float | None) -> tuple[tuple[str, float], ...]:
    """The request's stack, every name declared by the card; with a control image, its ControlNet in it."""
    declared = card.manifest.adapters
    for name, _ in stack:
        if name not in declared:
            raise BadInput(f"card '{card.id}' declares no adapter '{name}'; its adapters: "
                           f"{', '.join(declared) or 'none'}")
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
    return tuple((name, float(scale)) for name, scale in stack)


def parse_interval(text: str) -> tuple[float, float]:
    """`LO,HI` as typed on the command line (a σ range for --guidance-interval)."""
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise BadInput(f"--guidance-interval takes LO,HI (a σ range such as 0,0.4), got '{text}'")
    return low, high


class LoadedCard:
    """A card loaded once for many `generate` calls: each precision asked for gets an instance that keeps the
    components it has built, and all share the text-feature cache of encoded prompts, so a script that
    generates a hundred times loads once. Not for concurrent calls from several threads."""

    def __init__(self, card_ref: str | Card, *, device: str | None = None, cache: TextFeatureCache | None = None,
                 precision: str | None = None):
        if cache is not None and not isinstance(cache, TextFeatureCache):
            raise BadInput(f"cache must be a TextFeatureCache, got {cache!r}")
        if precision is not None and not isinstance(precision, str):
            raise BadInput(f"precision must be a name (float32, bfloat16, float16), got {precision!r}"[:300])
        self.card = card_ref if isinstance(card_ref, Card) else load_card(card_ref, adapters=False)
        self.platform = Platform.detect(device)
        self.cache = cache or TextFeatureCache()
        self.precision = precision or self.card.manifest.recipe.assumes.precision
        self._loops: dict[str, DenoiseLoop] = {}
        self._rewards: dict[str, object] = {}
        self.loop(self.precision)  # a precision the platform cannot run is refused here, not at the first call

    @property
    def instance(self) -> ModelInstance:
        """The instance at the default precision."""
        return self.loop(self.precision).instance

    def loop(self, precision: str | None = None) -> DenoiseLoop:
        precision = precision or self.precision
        if precision not in self._loops:
            self._loops[precision] = DenoiseLoop(ModelInstance(self.card, self.platform, precision), LOOP,
                                                 self.cache)
        return self._loops[precision]

    def reward(self, ref: str):
        """The reward card `ref` on this card's platform, loaded once (best-of-N)."""
        from cardtool.core.evaluation.reward import load_reward

        if ref not in self._rewards:
            self._rewards[ref] = load_reward(ref, self.platform)
        return self._rewards[ref]

    def _make(self, requests: list[Request], loop: DenoiseLoop, judge, best_of: int, max_batch: int, on_step,
              fused) -> list[tuple]:
        """(request, image, extra metadata, finite) per request: best-of-N's selection and the adapters used go in
        the metadata; an image sampled as NaN or inf (best-of: every candidate so) is not finite."""
        if judge is None:
            states = sample(loop, requests, on_step=on_step, max_batch=max_batch)
            images, finite = loop.decode(states)
            extras = [adapter_metadata(s.adapters, s.request.control, fused is not None) for s in states]
            return list(zip(requests, images, extras, finite, strict=True))
        from cardtool.core.sampling.best_of import best_of_n

        picked = best_of_n(loop, judge, requests, best_of, max_batch=max_batch, on_step=on_step)
        extras = [{**e, **({"fused": "true"} if fused is not None else {})} for e in picked.metadata()]
        return list(zip(picked.requests, picked.images, extras, picked.finite, strict=True))

    def generate(self, prompts: str | list[str], *, num: int = 1, seed: int = 0, steps: int | None = None,
                 guidance: float | None = None, shift: float | None = None, solver: str | None = None,
                 guidance_interval: tuple[float, float] | None = None, precision: str | None = None,
                 out: str | Path = "outputs", grid: bool = False, strict: bool = False,
                 on_step: Callable[[int, int], None] | None = None, max_batch: int = 128, best_of: int = 1,
                 reward: str | None = None, adapters: list[tuple[str, float]] | None = None,
                 control=None, preprocessor: str | None = None, control_scale: float | None = None,
                 fuse: bool = False, skip_existing: bool = False, negative_prompt: str = "") -> GenerateReport:
        """Sample prompts × num images and write them; with `best_of` N > 1, each image is the best of N candidates
        under the reward card `reward`, and its metadata records every candidate's score.

        `adapters`: the stack of (name, scale) every image uses (default: the card's loop defaults); `control`: an
        image file, a grey uint8 array or a ControlImage for the card's ControlNet, through `preprocessor` (default:
        the ControlNet's own); `fuse`: merge the stack's LoRAs into the base weights for this call, then restore
        them; `skip_existing`: keep each image whose file is already there with this request's settings tag (an
        earlier run of the same call, interrupted, say) and make only the others; `negative_prompt`: what CFG steers
        away from (default: the empty prompt, the null condition)."""
        prompts = _checked(prompts, num=num, seed=seed, steps=steps, guidance=guidance, shift=shift, best_of=best_of,
                           max_batch=max_batch, guidance_interval=guidance_interval, adapters=adapters,
                           control_scale=control_scale, out=out, on_step=on_step,
                           switches={"grid": grid, "strict": strict, "fuse": fuse, "skip_existing": skip_existing},
                           texts={"reward": reward, "solver": solver, "precision": precision,
                                  "preprocessor": preprocessor, "negative_prompt": negative_prompt})
        if max_batch < 1:
            raise BadInput(f"--max-batch must be at least 1, got {max_batch}")
        if best_of != 1 and reward is None:
            raise BadInput("--best-of N needs --reward REWARD_CARD, the card that scores the candidates")
        if best_of < 1:
            raise BadInput(f"--best-of must be at least 1, got {best_of}")
        if best_of * num * max(1, len(prompts)) > MAX_IMAGES:
            asked = f"{len(prompts):,} prompts × {num:,} images" + (f" × {best_of:,} candidates" if best_of > 1 else "")
            raise BadInput(f"at most {MAX_IMAGES:,} images a call (candidates counted), got {asked}; split the run")
        card, platform = self.card, self.platform
        loop = self.loop(precision)
        instance = loop.instance
        control = control_image(loop, control, preprocessor, adapters)
        requests, warnings = plan_requests(card, prompts, num=num, seed=seed, steps=steps, guidance=guidance,
                                           shift=shift, solver=solver, guidance_interval=guidance_interval,
                                           strict=strict, adapters=adapters, control=control,
                                           control_scale=control_scale, negative_prompt=negative_prompt)
        warnings = instance.warnings + warnings
        judge = self.reward(reward) if reward is not None else None
        selection = _selection(judge, best_of, fuse)
        tags = [settings_tag({**image_metadata(loop, r), **selection}) for r in requests]
        paths = _output_paths(Path(out), card.id, requests, tags)
        started = time.perf_counter()
        ranks = distributed.ranks(platform.device)
        kept = _already_made(paths, tags, requests, ranks, grid) if skip_existing else {}
        todo = [i for i in range(len(requests)) if i not in kept]
        # requests are made in waves of a forward's worth a process, each written when done, so an interrupted or
        # failing run keeps what it finished; under torchrun each rank makes its share of a wave, gathered to rank 0,
        # which writes them all
        size = max(1, max_batch // best_of) * ranks.world
        waves = [[todo[k + j] for j in ranks.shard(todo[k:k + size])] for k in range(0, len(todo), size)]
        total = sum(requests[i].steps for wave in waves for i in wave) * best_of
        images, order, broken, done = [], [], [], 0  # order: each written image's index
        with _fusing(loop, requests[0].adapters if fuse else ()) as fused, stop_requests(ranks.world == 1) as caught:
            if fuse and fused is None:
                raise BadInput("--fuse merges the LoRAs of the request's adapter stack; this one has none")
            for number, wave in enumerate(waves):
                progress = (lambda d, t, before=done: on_step(before + d, total)) if on_step else None
                made = self._make([requests[i] for i in wave], loop, judge, best_of, max_batch, progress, fused) \
                    if wave else []
                done += sum(requests[i].steps for i in wave) * best_of
                shares = ranks.gather([(i, *item) for i, item in zip(wave, made, strict=True)])
                if not ranks.main:
                    continue
                for i, request, image, extra, finite in sorted((item for share in shares for item in share),
                                                               key=lambda item: item[0]):
                    if not finite:
                        broken.append(request)
                        continue
                    metadata = {**image_metadata(loop, request), **extra, "tag": tags[i]}
                    try:
                        save_image(paths[i], image, metadata)
                    except RunFailed as failed:  # the images written before it are kept, and listed
                        raise RunFailed(f"{failed}; the {len(images)} images written before it are kept",
                                        {"images": [image.to_json() for image, _, _ in images]}) from None
                    images.append((GeneratedImage(paths[i], metadata), request, image))
                    order.append(i)
                if caught and number < len(waves) - 1:
                    raise Interrupted.after(caught[0], f"{len(images) + len(kept)} of {len(requests)} images: those "
                                            f"are written in {paths[0].parent}; the same command with "
                                            "--skip-existing makes the rest",
                                            {"images": [image.to_json() for image, _, _ in [*kept.values(), *images]]})
        seconds = time.perf_counter() - started
        if self.cache.problem:  # said once: the cache writes nothing more
            warnings, self.cache.problem = [*warnings, self.cache.problem], None
        if not ranks.main:
            return GenerateReport(card.id, f"{platform.device}/{platform.arch}", [], None, warnings, seconds,
                                  rank=ranks.rank)
        if broken:  # the finite images are written, and listed
            raise NonFiniteImages(card.id, broken, len(requests), written=len(images),
                                  partial={"images": [image.to_json() for image, _, _ in images]})
        if kept:  # in the order asked for, as if made now
            made = dict(zip(order, images, strict=True))
            images = [kept.get(i) or made[i] for i in range(len(requests))]
        grid_path = None
        if grid:
            grid_path = paths[0].parent / f"{card.id}-grid-{settings_tag([p.name for p in paths])}.png"
            by_prompt: dict[str, list] = {}
            for _, request, pixels in images:
                by_prompt.setdefault(request.prompt, []).append(pixels)
            rows = list(by_prompt.items())
            if len(rows) > GRID_SIDE or any(len(row) > GRID_SIDE for _, row in rows):  # a picture, not a memory bomb
                warnings = [*warnings, f"the grid shows at most {GRID_SIDE} images of each of the first {GRID_SIDE} "
                                       "prompts; every image is written"]
                rows = [(prompt, row[:GRID_SIDE]) for prompt, row in rows[:GRID_SIDE]]
            save_image(grid_path, grid_image(rows), {"card": card.id, "cardtool": __version__})
        return GenerateReport(card.id, f"{platform.device}/{platform.arch}", [image for image, _, _ in images],
                              grid_path, warnings, seconds, skipped=len(kept))


def _already_made(paths: list[Path], tags: list[str], requests: list[Request], ranks, pixels: bool) -> dict[int, tuple]:
    """The images already on disk as this call would make them — a file at the request's path whose metadata holds
    the request's settings tag — as (GeneratedImage, request, its pixels where a grid needs them), by index. Rank
    0's folder decides: it writes every image."""
    from cardtool.core.sampling.images import read_png

    found = {}
    if ranks.main:
        for i, path in enumerate(paths):
            if not path.is_file():
                continue
            try:
                image, metadata = read_png(path, pixels)
            except (OSError, ValueError, SyntaxError):  # not a PNG we can read: made again
                continue
            if metadata.get("tag") == tags[i]:
                found[i] = (GeneratedImage(path, metadata), requests[i], image)
    indices = ranks.all_gather(sorted(found))[0] if ranks.world > 1 else sorted(found)
    return found if ranks.main else dict.fromkeys(indices)


def control_image(loop: DenoiseLoop, control, preprocessor: str | None, adapters) -> ControlImage | None:
    """A request's control image from a file, an array or a ControlImage, preprocessed by `preprocessor` or by the
    ControlNet's own (the one named in `adapters`, else the card's only one)."""
    if control is None or isinstance(control, ControlImage):
        if preprocessor is not None and control is None:
            raise BadInput("a control preprocessor needs a control image (--control IMAGE:PREPROCESSOR)")
        return control
    from cardtool.core.sampling.control import read_control

    declared = loop.instance.card.manifest.adapters
    nets = [n for n, _ in adapters or () if n in declared and declared[n].kind == "controlnet"] or \
        [n for n, a in declared.items() if a.kind == "controlnet"]
    if preprocessor is None:
        if not nets:
            raise BadInput(f"--control needs a ControlNet; card '{loop.instance.card.id}' declares none")
        preprocessor = declared[nets[0]].control
    if isinstance(control, (str, Path)):
        size = loop.instance.component(loop.vae).config.image_size
        return ControlImage.make(read_control(Path(control), size), preprocessor, str(control))
    return ControlImage.make(control, preprocessor)


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


@contextlib.contextmanager
def _fusing(loop: DenoiseLoop, stack: tuple):
    """With a stack, its LoRAs merged into the DiT for the block (the loop then adds nothing for that stack's
    rows), restored after; yields the merged (adapter, scale) pairs, or None when nothing was merged."""
    loras = tuple((u.adapter, u.scale) for u in loop.instance.adapters.resolve(stack) if u.adapter.kind == "lora") \
        if stack else ()
    if not loras:
        yield None
        return
    from cardtool.backends.lora import fused

    with fused(loop.instance.component(loop.transformer), tuple((a.value, scale) for a, scale in loras)):
        loop.fused = loras
        try:
            yield loras
        finally:
            loop.fused = None


def generate(card_ref: str, prompts: str | list[str], *, device: str | None = None,
             cache: TextFeatureCache | None = None, precision: str | None = None, **options) -> GenerateReport:
    """One call: load the card, generate (options as `LoadedCard.generate`), done."""
    return LoadedCard(card_ref, device=device, cache=cache, precision=precision).generate(prompts, **options)


def _output_paths(out: Path, card_id: str, requests: list[Request], tags: list[str]) -> list[Path]:
    """A file for a single image given as NAME.png, else numbered files in the folder `out`, each name ending in
    its request's settings tag; checked writable before any work is done."""
    if out.suffix.lower() == ".png" and not out.is_dir():  # an existing folder named like a PNG is a folder
        if len(requests) != 1:
            raise BadInput(f"--out {out} names one file, but {len(requests)} images are asked for; give a folder")
        paths, folder = [replaceable_file(out, "--out")], out.parent
    else:
        folder = out
        paths = [out / f"{card_id}-{i:03d}-{prompt_slug(r.prompt)}-seed{r.seed}-{tag}.png"
                 for i, (r, tag) in enumerate(zip(requests, tags, strict=True))]
    writable_folder(folder, "the output folder")
    return paths


def settings_tag(settings) -> str:
    """Eight hex digits of a hash of everything that decides an image (its metadata: card, weights versions,
    prompt, seed, every setting, adapters, platform, precision): the end of its file name, so a run with other
    settings never overwrites an earlier image, while the same command again rewrites its files with the same bits."""
    import hashlib

    text = json.dumps(settings, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _selection(judge, best_of: int, fuse: bool) -> dict[str, str]:
    """What else decides a call's images: best-of-N's count and reward (by its weights), and fusing."""
    selection = {"fused": "true"} if fuse else {}
    if judge is not None:
        instance = getattr(judge, "instance", None)
        version = instance.weights_version(judge.classifier_name) if instance is not None else ""
        selection.update(best_of=str(best_of), reward=f"{judge.card_id}@{version}")
    return selection


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


def save_image(path: Path, pixels, metadata: dict) -> None:
    """Write one PNG: a name the file system refuses is bad input, a disk that fails (full, gone) fails the run."""
    import errno

    try:
        save_png(path, pixels, metadata)
    except OSError as e:  # the folder passed the probe, so a full disk or a file system that refuses the name
        error = BadInput if e.errno in (errno.ENAMETOOLONG, errno.EINVAL, errno.EILSEQ) else RunFailed
        raise error(f"cannot write {path}: {e.strerror or e}") from None


def prompt_slug(prompt: str) -> str:
    """A file-name part for a prompt: its ASCII words, or — for a prompt with none (another script, only symbols) — a
    short hash of it, so such prompts stay told apart; `unconditional` for the empty prompt alone."""
    import hashlib

    words = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:40]
    if words or not prompt.strip():
        return words or "unconditional"
    return "prompt-" + hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def _json_value(value: str):
    return json.loads(value) if value.startswith(("{", "[")) else value
