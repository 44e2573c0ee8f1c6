"""`cardtool generate`: the requests planned from a card's loop defaults and the user's options (`planning`), run
through the denoise loop with step-level batching in waves, each wave's PNGs written with their generation metadata
(`outputs`) as it finishes."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool import __version__
from cardtool.backends.platform import Platform
from cardtool.core import distributed
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.evaluation.reward import free_text_reading
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.sampling.best_of import MAX_CANDIDATES, best_of_n
from cardtool.core.sampling.control import ControlImage
from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages, Request
from cardtool.core.sampling.images import grid_image
from cardtool.core.sampling.init_image import init_images
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.outputs import (
    GeneratedImage,
    adapter_metadata,
    already_made,
    image_metadata,
    not_over_inputs,
    output_paths,
    save_image,
    settings_tag,
)
from cardtool.core.sampling.planning import LOOP, MAX_IMAGES, checked_arguments, plan_requests, started_warnings
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache, filled_prompts
from cardtool.errors import BadInput, OutOfMemory, RunFailed, said_as_cardtool_errors
from cardtool.words import counted

__all__ = ["GenerateReport", "LoadedCard", "control_image", "generate"]

GRID_SIDE = 64  # prompts (rows) and images a prompt (columns) a --grid shows


@dataclass
class GenerateReport:
    card: str
    platform: str
    images: list[GeneratedImage]
    grid: Path | None = None
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0  # making the images: encoding, sampling, decoding, writing
    load_seconds: float = 0.0  # building the card's components on first use (a LoadedCard's first call)
    rank: int = 0  # under torchrun, the process this report is from: rank 0 has every image, the others none
    skipped: int = 0  # images kept from an earlier run (skip_existing), listed with the others

    def to_json(self) -> dict:
        return {"card": self.card, "platform": self.platform, "images": [i.to_json() for i in self.images],
                "grid": str(self.grid) if self.grid else None, "warnings": self.warnings,
                "seconds": round(self.seconds, 3), "load_seconds": round(self.load_seconds, 3), "skipped": self.skipped,
                "images_per_second": round((len(self.images) - self.skipped) / self.seconds, 3) if self.seconds
                else None}


def _one_at_a_time(method):
    """Calls on one LoadedCard from several threads take turns: a call may change the weights every call shares
    (`fuse` merges a stack into the base for its run, an adapter file's new version replaces the old), and a call
    that ran beside it would make its images with those weights and record another stack. Torch's own threads
    already keep the cores busy within a call, so turns cost little."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._turn:
            return method(self, *args, **kwargs)

    return locked


class LoadedCard:
    """A card loaded once for many `generate` calls: each precision asked for gets an instance that keeps the
    components it has built, and all share the text-feature cache of encoded prompts, so a script that
    generates a hundred times loads once. Safe to share between threads: their calls take turns."""

    @said_as_cardtool_errors
    def __init__(self, card_ref: str | Card, *, device: str | None = None, cache: TextFeatureCache | None = None,
                 precision: str | None = None):
        if cache is not None and not isinstance(cache, TextFeatureCache):
            raise BadInput(f"cache must be a TextFeatureCache, got {cache!r}")
        if precision is not None and not isinstance(precision, str):
            raise BadInput(f"precision must be a name (float32, bfloat16, float16), got {precision!r}"[:300])
        self.card = card_ref if isinstance(card_ref, Card) else load_card(card_ref, adapters=False)
        self.platform = Platform.detect(device)
        self.cache = cache or TextFeatureCache()
        self.precision = self.card.manifest.recipe.assumes.precision if precision is None else precision
        self._loops: dict[str, DenoiseLoop] = {}
        self._rewards: dict[str, object] = {}
        self._turn = threading.RLock()
        self.loop(self.precision)  # a precision the platform cannot run is refused here, not at the first call

    @property
    def instance(self) -> ModelInstance:
        """The instance at the default precision."""
        return self.loop(self.precision).instance

    @_one_at_a_time
    def loop(self, precision: str | None = None) -> DenoiseLoop:
        precision = self.precision if precision is None else precision
        if precision not in self._loops:
            self._loops[precision] = DenoiseLoop(ModelInstance(self.card, self.platform, precision), LOOP,
                                                 self.cache)
        return self._loops[precision]

    @_one_at_a_time
    def reward(self, ref: str):
        """The reward card `ref` on this card's platform, loaded once (best-of-N)."""
        from cardtool.core.evaluation.reward import load_reward

        if ref not in self._rewards:
            self._rewards[ref] = load_reward(ref, self.platform, scores=self.card)
        return self._rewards[ref]

    def _make(self, requests: list[Request], loop: DenoiseLoop, judge, best_of: int, max_batch: int, on_step,
              fused, starts=None) -> list[tuple]:
        """(request, image, extra metadata, finite) per request, each started from its (latent, keep mask) in
        `starts` if given: best-of-N's selection and the adapters used go in the metadata; an image sampled as NaN or
        inf (best-of: every candidate so) is not finite."""
        sources, keeps = ([start[k] for start in starts] for k in (0, 1)) if starts else (None, None)
        if judge is None:
            states = sample(loop, requests, on_step=on_step, max_batch=max_batch, sources=sources, keeps=keeps)
            images, finite = loop.decode(states)
            extras = [adapter_metadata(s.adapters, s.request.control, fused is not None) for s in states]
            return list(zip(requests, images, extras, finite, strict=True))
        picked = best_of_n(loop, judge, requests, best_of, max_batch=max_batch, on_step=on_step, sources=sources,
                           keeps=keeps)
        extras = [{**e, **({"fused": "true"} if fused is not None else {})} for e in picked.metadata()]
        return list(zip(picked.requests, picked.images, extras, picked.finite, strict=True))

    @_one_at_a_time
    @said_as_cardtool_errors
    def generate(self, prompts: str | list[str], *, num: int = 1, seed: int = 0, steps: int | None = None,
                 guidance: float | None = None, shift: float | None = None, solver: str | None = None,
                 guidance_interval: tuple[float, float] | None = None, precision: str | None = None,
                 out: str | Path | None = "outputs", grid: bool = False, strict: bool = False,
                 on_step: Callable[[int, int], None] | None = None,
                 on_encode: Callable[[int, int], None] | None = None, max_batch: int = 128, best_of: int = 1,
                 reward: str | None = None, adapters: list[tuple[str, float]] | None = None,
                 control=None, preprocessor: str | None = None, control_scale: float | None = None,
                 fuse: bool = False, skip_existing: bool = False, negative_prompt: str = "", image=None,
                 strength: float | None = None, mask=None) -> GenerateReport:
        """Sample prompts × num images and write them to `out` (a folder, or NAME.png for one image; None: write
        nothing, each GeneratedImage's `pixels` holds its image); with `best_of` N > 1, each image is the best of N
        candidates under the reward card `reward`, and its metadata records every candidate's score.

        `adapters`: the stack of (name, scale) every image uses (default: the card's loop defaults); `control`: an image
        file, a PIL image (made grey and resized as a file is), a grey uint8 array or a ControlImage for the card's
        ControlNet, through `preprocessor` (default: the ControlNet's own); `fuse`: merge the stack's LoRAs into the
        base weights for this call, then restore them; `skip_existing`: keep each image whose file is already there with
        this request's settings tag (an earlier run of the same call, interrupted, say) and make only the others;
        `negative_prompt`: what CFG steers away from (default: the empty prompt, the null condition); `image`: an image
        file, a PIL image or a grey uint8 array to start from (image-to-image, SDEdit), or a list of one per prompt,
        re-noised to σ = `strength` (default 0.8) and denoised from there; `mask` (likewise): inpainting — its white
        part generated anew (strength default 1), its black part kept from the image. `on_step(done, total)` reports
        the sampling in request-steps; `on_encode(done, total)` the encoding of the distinct prompts, before it."""
        prompts = checked_arguments(prompts, num=num, seed=seed, steps=steps, guidance=guidance, shift=shift,
                                    best_of=best_of, max_batch=max_batch, guidance_interval=guidance_interval,
                                    adapters=adapters, control_scale=control_scale, strength=strength, out=out,
                                    on_step=on_step, on_encode=on_encode,
                                    switches={"grid": grid, "strict": strict, "fuse": fuse,
                                              "skip_existing": skip_existing},
                                    texts={"reward": reward, "solver": solver, "precision": precision,
                                           "preprocessor": preprocessor, "negative_prompt": negative_prompt})
        if max_batch < 1:
            raise BadInput(f"--max-batch must be at least 1, got {max_batch}")
        if best_of != 1 and reward is None:
            raise BadInput("--best-of N needs --reward REWARD_CARD, the card that scores the candidates")
        if best_of < 1:
            raise BadInput(f"--best-of must be at least 1, got {best_of}")
        if best_of > MAX_CANDIDATES:  # here, not when the candidates are planned: before the output folder is made
            raise BadInput(f"--best-of must be at most {MAX_CANDIDATES} candidates a request, got {best_of}")
        if best_of * num * max(1, len(prompts)) > MAX_IMAGES:
            asked = f"{len(prompts):,} prompts × {num:,} images" + (f" × {best_of:,} candidates" if best_of > 1 else "")
            raise BadInput(f"at most {MAX_IMAGES:,} images a call (candidates counted), got {asked}; split the run")
        card, platform = self.card, self.platform
        loop = self.loop(precision)
        instance = loop.instance
        before = instance.build_seconds  # what this call builds from here on is loading (a start image's VAE, say)
        inputs = {"--image": image, "--mask": mask, "--control": control}
        control = control_image(loop, control, preprocessor, adapters)
        requests, warnings = plan_requests(card, prompts, num=num, seed=seed, steps=steps, guidance=guidance,
                                           shift=shift, solver=solver, guidance_interval=guidance_interval,
                                           strict=strict, adapters=adapters, control=control,
                                           control_scale=control_scale, negative_prompt=negative_prompt)
        size = instance.component(loop.vae).config.image_size if image is not None else None  # no VAE built for none
        starts = init_images(image, strength, size, len(prompts), mask)
        planned = requests[0]
        requests, latents, from_image = _started(loop, requests, starts, num)
        warnings = instance.warnings + started_warnings(warnings, planned, requests[0])
        judge = self.reward(reward) if reward is not None else None
        selection = _selection(judge, best_of, fuse)
        tags = [settings_tag({**image_metadata(loop, r), **selection, **from_image[k]}) for k, r in enumerate(requests)]
        if out is None and (grid or skip_existing):
            raise BadInput(f"{'grid' if grid else 'skip_existing'} needs out, a folder; out=None writes nothing")
        paths = [None] * len(requests) if out is None else output_paths(Path(out), card.id, requests, tags)
        not_over_inputs(paths, inputs)
        started, built = time.perf_counter(), instance.build_seconds
        ranks = distributed.ranks(platform.device)
        kept = already_made(paths, tags, requests, ranks) if skip_existing else {}
        todo = [i for i in range(len(requests)) if i not in kept]
        # on every rank: a reward that cannot read a prompt refuses it on all of them, not on rank 0 alone
        read = free_text_reading(judge, [requests[i].prompt for i in todo]) if judge is not None else None
        if ranks.main:  # the rank that reports; the features its encoding makes the sampler reads from the cache
            filled = filled_prompts(instance, [text for i in todo for text in (
                requests[i].prompt, *([requests[i].negative_prompt] if requests[i].guidance != 1 else []))],
                self.cache, loop.text_encoder, on_encoded=on_encode)
            warnings = [*warnings, *(w for w in (filled, read) if w)]
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
                with OutOfMemory.raised(f"; {_kept_before(len(images) + len(kept), out)}",
                                        {"images": [image.to_json() for image, _, _ in images]}):
                    made = self._make([requests[i] for i in wave], loop, judge, best_of, max_batch, progress, fused,
                                      [latents[i] for i in wave] if latents else None) if wave else []
                done += sum(requests[i].steps for i in wave) * best_of
                shares = ranks.gather([(i, *item) for i, item in zip(wave, made, strict=True)])
                if not ranks.main:
                    continue
                for i, request, image, extra, finite in sorted((item for share in shares for item in share),
                                                               key=lambda item: item[0]):
                    if not finite:
                        broken.append(request)
                        continue
                    metadata = {**image_metadata(loop, request), **extra, **from_image[i], "tag": tags[i]}
                    try:
                        if paths[i] is not None:
                            save_image(paths[i], image, metadata)
                    except RunFailed as failed:  # the images written before it are kept, and listed
                        raise RunFailed(f"{failed}; {_kept_before(len(images) + len(kept), out)}",
                                        {"images": [image.to_json() for image, _, _ in images]}) from None
                    images.append((GeneratedImage(paths[i], metadata, image), request, image))
                    order.append(i)
                if caught and number < len(waves) - 1:
                    where = "none is written (out=None)" if out is None else \
                        f"those are written in {paths[0].parent}; the same command with --skip-existing makes the rest"
                    raise Interrupted.after(caught[0], f"{len(images) + len(kept)} of {len(requests)} images: {where}",
                                            {"images": [image.to_json() for image, _, _ in [*kept.values(), *images]]})
        # a first call builds the components it uses as it goes: that is loading the card, not making images, and
        # counted apart — else its images/s is a twentieth of the next call's (the text encoder alone takes seconds)
        seconds = time.perf_counter() - started - (instance.build_seconds - built)
        load = instance.build_seconds - before
        if self.cache.problem:  # said once: the cache writes nothing more
            warnings, self.cache.problem = [*warnings, self.cache.problem], None
        if not ranks.main:
            return GenerateReport(card.id, f"{platform.device}/{platform.arch}", [], None, warnings, seconds, load,
                                  rank=ranks.rank)
        if broken:  # the finite images are written, and listed
            raise NonFiniteImages(card.id, broken, len(requests), written=len(images),
                                  partial={"images": [image.to_json() for image, _, _ in images]},
                                  precision=instance.precision)
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
                              grid_path, warnings, seconds, load, skipped=len(kept))


def _started(loop: DenoiseLoop, requests: list[Request], starts, num: int) -> tuple[list[Request], list, list]:
    """The requests with their start image's strength, each one's (latent, keep mask), and the metadata its image
    records of them; the requests as they are, no latents and empty records without start images. Request k is
    prompt k // num's; each distinct image (and mask) is encoded once, before any file is written."""
    if not starts:
        return requests, [], [{}] * len(requests)
    starts = [starts[k // num] for k in range(len(requests))]
    distinct = list({start.image.digest: start.image for start in starts}.values())
    encoded = dict(zip([d.digest for d in distinct], loop.encode(np.stack([d.pixels for d in distinct])), strict=True))
    masks = {start.mask.digest: loop.latent_mask(start.mask.pixels) for start in starts if start.mask}
    latents = [(encoded[start.image.digest], masks[start.mask.digest] if start.mask else None) for start in starts]
    return ([dataclasses.replace(r, strength=start.strength) for r, start in zip(requests, starts, strict=True)],
            latents, [start.metadata() for start in starts])


def control_image(loop: DenoiseLoop, control, preprocessor: str | None, adapters) -> ControlImage | None:
    """A request's control image from a file, an array or a ControlImage, preprocessed by `preprocessor` or by the
    ControlNet's own (the one named in `adapters`, else the card's only one)."""
    if control is None or isinstance(control, ControlImage):
        if preprocessor is not None and control is None:
            raise BadInput("a control preprocessor needs a control image (--control IMAGE:PREPROCESSOR)")
        return control
    from cardtool.core.sampling.control import is_pil_image, pil_pixels, read_grey

    declared = loop.instance.card.manifest.adapters
    nets = [n for n, _ in adapters or () if n in declared and declared[n].kind == "controlnet"] or \
        [n for n, a in declared.items() if a.kind == "controlnet"]
    if preprocessor is None:
        if not nets:
            raise BadInput(f"--control needs a ControlNet; card '{loop.instance.card.id}' declares none")
        preprocessor = declared[nets[0]].control
    size = loop.instance.component(loop.vae).config.image_size
    if isinstance(control, (str, os.PathLike)):
        return ControlImage.make(read_grey(Path(control), size), preprocessor, str(control))
    if is_pil_image(control):  # made grey and resized as a file is
        return ControlImage.make(pil_pixels(control, size, "the control image"), preprocessor)
    return ControlImage.make(control, preprocessor)


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


@said_as_cardtool_errors
def generate(card_ref: str, prompts: str | list[str], *, device: str | None = None,
             cache: TextFeatureCache | None = None, precision: str | None = None, **options) -> GenerateReport:
    """One call: load the card, generate (options as `LoadedCard.generate`), done."""
    return LoadedCard(card_ref, device=device, cache=cache, precision=precision).generate(prompts, **options)


def _kept_before(count: int, out) -> str:
    """What a call stopped by a failure keeps of its images, and how to finish it."""
    are = "is" if count == 1 else "are"
    if out is None:
        return f"the {counted(count, 'image')} made before it {are} kept (out=None: none is written)"
    if not count:
        return "no image was written before it"
    return f"the {counted(count, 'image')} written before it {are} kept: the same command with --skip-existing makes " \
        "the rest"


def _selection(judge, best_of: int, fuse: bool) -> dict[str, str]:
    """What else decides a call's images: best-of-N's count and reward (by its weights), and fusing."""
    selection = {"fused": "true"} if fuse else {}
    if judge is not None:
        instance = getattr(judge, "instance", None)
        version = instance.weights_version(judge.classifier_name) if instance is not None else ""
        selection.update(best_of=str(best_of), reward=f"{judge.card_id}@{version}")
    return selection

