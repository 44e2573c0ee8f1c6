"""Running a workflow manifest (in one process, or split by rank under torchrun): each card is loaded once on one
platform (generators and rewards side by side), steps run in dependency order, every step's images are written as
PNGs whose metadata names the workflow and the step, and the report lists them (with best-of-N's scores).

Each image is planned before anything is sampled, and its file name ends in a tag of what decides it (card, weights,
request; for a chain its input's tag; for best-of-N the N and the reward's weights, not the pick): with
`skip_existing` an image already written under its name is read back instead of made again, so a run that was
stopped resumes where it stopped."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import numbers
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool.atomic import refuse_stream, writable_folder
from cardtool.backends.platform import Platform
from cardtool.core import distributed
from cardtool.core.evaluation.reward import free_text_reading
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.sampling.denoise import Request
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.outputs import (
    JSON_FIELDS,
    STREAM_REFUSED,
    image_metadata,
    prompt_slug,
    save_image,
    settings_tag,
)
from cardtool.core.sampling.planning import plan_requests, started_warnings
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache, filled_prompts
from cardtool.core.workflows.manifest import Workflow, load_workflow
from cardtool.errors import BadInput, OutOfMemory, RunFailed, said_as_cardtool_errors

__all__ = ["Output", "WorkflowReport", "run_workflow"]


@dataclass
class Output:
    image: np.ndarray  # uint8 (H, W)
    prompt: str
    metadata: dict[str, str]
    path: Path | None = None


@dataclass
class _Job:
    """One image of a step, as planned: its card (as the workflow names it), how it is made (`sample`, `refine`
    from `source`, `best_of`), its request, the precision it is sampled at and the metadata it is named by."""

    ref: str
    how: str
    request: Request
    precision: str | None
    metadata: dict[str, str]
    source: Output | None = None
    selection: dict[str, str] = field(default_factory=dict)  # best-of-N's N and reward: in the tag only
    mask: np.ndarray | None = None  # inpainting: the pixel mask of `source` whose white part is generated

    @property
    def tag(self) -> str:
        return settings_tag({**self.metadata, **self.selection})


@dataclass
class WorkflowReport:
    workflow: str
    platform: str
    steps: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # as `generate` says them, each once

    def to_json(self) -> dict:
        return {"workflow": self.workflow, "platform": self.platform, "seconds": round(self.seconds, 3),
                "steps": self.steps, "warnings": self.warnings}


class _Runner:
    def __init__(self, workflow: Workflow, device: str | None, max_batch: int):
        self.workflow, self.max_batch = workflow, max_batch
        self.platform = Platform.detect(device)
        self.device = device
        self.cache = TextFeatureCache()  # keyed by card and weights version: safe to share between cards
        self.cards: dict[str, LoadedCard] = {}
        self.ranks = distributed.ranks(self.platform.device)  # under torchrun each step's images are split by rank
        self.warnings: list[str] = []

    def locate(self, ref: str) -> Path:
        from cardtool.core.cards.discovery import locate

        return locate(self.workflow.card_ref(ref), near=self.workflow.folder)

    def repeated_cards(self, step: str, refs: list[str]) -> None:
        """A parallel step naming one card twice (by id and by path, say) makes the same images twice: said."""
        files = [self.locate(ref).resolve() for ref in refs]
        twice = next((ref for i, ref in enumerate(refs) if files[i] in files[:i]), None)
        if twice is not None:
            self.warnings.append(f"step '{step}': card {twice} is in its cards twice; the same requests make the "
                                 "same images again")

    def card(self, ref: str) -> LoadedCard:
        if ref not in self.cards:
            self.cards[ref] = LoadedCard(str(self.locate(ref)), device=self.device, cache=self.cache)
        return self.cards[ref]

    def _requests(self, ref: str, prompts: list[str], num: int, body, control=None,
                  strength: float | None = None) -> list[Request]:
        """The step's requests, started at `strength` where it refines an image (its warnings then of the steps the
        start runs, as `generate` says them)."""
        adapters = list(body.adapters.items()) if body.adapters is not None else None
        interval = tuple(body.guidance_interval) if body.guidance_interval is not None else None
        requests, warnings = plan_requests(self.card(ref).card, prompts, num=num, seed=body.seed, steps=body.steps,
                                           guidance=body.guidance, guidance_interval=interval, shift=body.shift,
                                           solver=body.solver, adapters=adapters, negative_prompt=body.negative_prompt,
                                           control=control, control_scale=body.control_scale)
        if strength is not None:
            planned, requests = requests[0], [dataclasses.replace(r, strength=strength) for r in requests]
            warnings = started_warnings(warnings, planned, requests[0])
        for warning in self.card(ref).loop(body.precision).instance.warnings + warnings:
            if warning not in self.warnings:
                self.warnings.append(warning)
        return requests

    def _control(self, ref: str, body, image=None):
        """The step's ControlImage for card `ref`: its file, or `image` (an input) where it says `input`."""
        from cardtool.core.sampling.control import parse_control
        from cardtool.core.sampling.generate import control_image

        if body.control is None:
            return None
        path, preprocessor = parse_control(body.control)
        adapters = list(body.adapters.items()) if body.adapters is not None else None
        source = image if str(path) == "input" else str(self.workflow.file(path))
        return control_image(self.card(ref).loop(body.precision), source, preprocessor, adapters)

    def sampled(self, ref: str, prompts: list[str], num: int, body) -> list[_Job]:
        """Sample `prompts` with card `ref` — from the step's `image` file (and `mask`) where it gives one, as
        `generate --image` does."""
        loop, control = self.card(ref).loop(body.precision), self._control(ref, body)
        if getattr(body, "image", None) is None:
            requests = self._requests(ref, prompts, num, body, control)
            return [_Job(ref, "sample", r, body.precision, image_metadata(loop, r)) for r in requests]
        from cardtool.core.sampling.init_image import init_images

        files = [None if p is None else str(self.workflow.file(p)) for p in (body.image, body.mask)]
        (start,) = init_images(files[0], body.strength, loop.instance.component(loop.vae).config.image_size, 1,
                               files[1])
        jobs = []
        for r in self._requests(ref, prompts, num, body, control, start.strength):
            jobs.append(_Job(ref, "refine", r, body.precision, {**image_metadata(loop, r), **start.metadata()},
                             Output(start.image.pixels, r.prompt, {}), mask=start.mask.pixels if start.mask else None))
        return jobs

    def refined(self, ref: str, inputs: list[Output], body, source: str) -> list[_Job]:
        """SDEdit with card `ref`: each input re-noised to σ = strength with seed body.seed + k, then denoised. The
        input's tag is part of the image's: a rerun whose input step changed writes beside, never over, it."""
        loop = self.card(ref).loop(body.precision)
        jobs = []
        for k, item in enumerate(inputs):
            (request,) = self._requests(ref, [item.prompt], 1, body.model_copy(update={"seed": body.seed + k}),
                                        self._control(ref, body, item.image), body.strength)
            jobs.append(_Job(ref, "refine", request, body.precision, {
                **image_metadata(loop, request), "input": f"{source}/{k}", "input_tag": item.metadata.get("tag", "")},
                item))
        return jobs

    def picked(self, body) -> list[_Job]:
        reward = self.card(body.card).reward(str(self.locate(body.reward)))
        selection = {"best_of": str(body.n),
                     "reward": f"{reward.card_id}@{reward.instance.weights_version(reward.classifier_name)}"}
        read = free_text_reading(reward, body.prompts)  # as `generate --best-of` says it
        if read and read not in self.warnings:
            self.warnings.append(read)
        return [dataclasses.replace(job, how="best_of", selection=selection)
                for job in self.sampled(body.card, body.prompts, body.num, body)]

    def make(self, jobs: list[_Job], body) -> list[Output]:
        """Make `jobs` (one card's, one kind), split across ranks; every rank gets every output, in order."""
        loaded = self.card(jobs[0].ref)
        loop, how = loaded.loop(jobs[0].precision), jobs[0].how

        def work(chosen: list[_Job]) -> list[Output]:
            requests = [job.request for job in chosen]
            if how == "best_of":
                from cardtool.core.sampling.best_of import best_of_n

                reward = loaded.reward(str(self.locate(body.reward)))
                picked = best_of_n(loop, reward, requests, body.n, max_batch=self.max_batch)
                picked = picked.checked(loaded.card.id, loop.instance.precision)
                return [Output(image, r.prompt, {**image_metadata(loop, r), **extra})
                        for r, image, extra in zip(picked.requests, picked.images, picked.metadata(), strict=True)]
            # strength 1 re-noises all the way: the input is forgotten, the step is plain sampling of its prompts —
            # unless a mask keeps part of it (inpainting)
            masked = how == "refine" and any(job.mask is not None for job in chosen)
            sources = loop.encode(np.stack([job.source.image for job in chosen])) \
                if how == "refine" and (masked or any(job.request.strength < 1 for job in chosen)) else None
            keeps = [loop.latent_mask(job.mask) if job.mask is not None else None for job in chosen] \
                if masked else None
            images = loop.finalize(sample(loop, requests, max_batch=self.max_batch, sources=sources, keeps=keeps))
            return [Output(image, job.request.prompt, job.metadata) for job, image in zip(chosen, images, strict=True)]

        return self.ranks.spread(jobs, work)

    def image_size(self, job: _Job) -> int:
        loop = self.card(job.ref).loop(job.precision)
        return loop.instance.component(loop.vae).config.image_size

    def already_made(self, jobs: list[_Job], paths: list[Path]) -> dict[int, Output]:
        """The images on disk as these jobs would make them — a PNG at the job's path whose metadata holds its tag
        and whose size is the card's — by index. Rank 0's folder decides (it writes every image); under torchrun
        every rank gets its outputs, which later steps read."""
        from cardtool.core.sampling.images import DAMAGED, read_png

        found = {}
        if self.ranks.main:
            for k, (job, path) in enumerate(zip(jobs, paths, strict=True)):
                try:
                    image, metadata = read_png(path) if path.is_file() else (None, {})
                except DAMAGED:  # not a PNG we can read: made again
                    continue
                size = self.image_size(job)
                if metadata.get("tag") == job.tag and image.shape == (size, size):
                    found[k] = Output(image, job.request.prompt, metadata, path)
        return self.ranks.all_gather(found)[0]


@said_as_cardtool_errors
def run_workflow(workflow: Workflow | str | os.PathLike, *, overrides: list[str] = (), out: str | Path = "outputs",
                 device: str | None = None, max_batch: int = 128, on_step=None, on_wave=None,
                 skip_existing: bool = False) -> WorkflowReport:
    """Run every step of a workflow (a loaded one, or its file with `--set` style `overrides`); images go to
    OUT/WORKFLOW_ID/STEP/NNN-….png, written a forward's worth at a time. `on_step(entry)` after each step,
    `on_wave(step, images it has, images it makes)` after each wave of a step that takes several; `skip_existing`:
    keep each image already written there with the settings it would be made with, and make only the others."""
    if not isinstance(out, (str, os.PathLike)):
        raise BadInput(f"out must be a path, got {out!r}"[:300])
    refuse_stream(out, STREAM_REFUSED)
    if isinstance(max_batch, bool) or not isinstance(max_batch, numbers.Integral) or max_batch < 1:  # numpy's too
        raise BadInput(f"--max-batch must be at least 1, got {max_batch!r}")
    if not isinstance(skip_existing, bool):
        raise BadInput(f"skip_existing must be True or False, got {skip_existing!r}"[:300])
    for name, callback in (("on_step", on_step), ("on_wave", on_wave)):
        if callback is not None and not callable(callback):
            raise BadInput(f"{name} must be a function, got {callback!r}"[:300])
    if not isinstance(overrides, (list, tuple)) or not all(isinstance(o, str) for o in overrides):
        raise BadInput(f"overrides are a list of KEY=VALUE strings, got {overrides!r}"[:300])
    if not isinstance(workflow, Workflow):
        if not isinstance(workflow, (str, os.PathLike)):
            raise BadInput(f"a workflow is a manifest file or a loaded Workflow, got {workflow!r}"[:300])
        workflow = load_workflow(workflow, list(overrides))
    elif overrides:
        raise BadInput("overrides apply when the workflow is loaded: give its file, or load it with them")
    runner = _Runner(workflow, device, int(max_batch))
    manifest = workflow.manifest
    folder = writable_folder(Path(out) / manifest.id, "the output folder")  # before the first step, not after
    _preflight(runner, workflow)
    report = WorkflowReport(manifest.id, f"{runner.platform.device}/{runner.platform.arch}")
    outputs: dict[str, list[Output]] = {}
    started = time.perf_counter()
    resume = f"their images are written in {folder}; the same command with --skip-existing makes the rest"
    with stop_requests(runner.ranks.world == 1) as caught:  # Ctrl-C / SIGTERM: the wave in flight finishes first
        for number, name in enumerate(workflow.order):
            try:
                with _naming(name, report):
                    _run_step(runner, workflow, name, outputs, folder, report, (on_step, on_wave), skip_existing,
                              caught)
            except _Stopped as stop:
                report.steps.append(stop.entry)
                done = f"{number} of {len(workflow.order)} steps and {len(stop.entry['images'])} of {stop.images} " \
                       f"images of step '{name}'"
                raise Interrupted.after(caught[0], f"{done}: {resume}", report.to_json()) from None
            except RunFailed as failed:  # a full disk, NaN images: the finished steps stay listed
                if report.steps and failed.partial is None:
                    failed.partial = report.to_json()
                raise
            if caught and number < len(workflow.order) - 1:
                raise Interrupted.after(caught[0], f"{number + 1} of {len(workflow.order)} steps: {resume}",
                                        report.to_json())
    report.seconds = time.perf_counter() - started
    report.warnings = runner.warnings + ([runner.cache.problem] if runner.cache.problem else [])
    return report


@contextlib.contextmanager
def _naming(step: str, report: WorkflowReport | None = None) -> Iterator[None]:
    """A request the step cannot run (BadInput) is said of the step, with the finished steps as `partial`."""
    try:
        yield
    except BadInput as error:
        named = type(error)(f"step '{step}': {error}")
        named.partial = report.to_json() if report is not None and report.steps else error.partial
        raise named from None


def _preflight(runner: _Runner, workflow: Workflow) -> None:
    """Plan every step's images — chains on stand-in inputs, blank images of their input's size — encode their
    prompts, and encode one image of each card a step starts from images with, before the first image is made: what
    the platform or the cards cannot do (an adapter file that does not fit, a VAE with no encoder, a prompt numpy's
    cache does not hold) is refused now, naming the step, not after the steps before it have run."""
    stand_ins: dict[str, list[Output]] = {}
    for name in workflow.order:
        with _naming(name):
            if workflow.manifest.steps[name].kind == "parallel":
                runner.repeated_cards(name, workflow.manifest.steps[name].body.cards)
            jobs = _jobs(runner, workflow.manifest.steps[name], stand_ins)
            for (ref, precision), group in itertools.groupby(jobs, key=lambda job: (job.ref, job.precision)):
                loop, requests = runner.card(ref).loop(precision), [job.request for job in group]
                prompts = list(dict.fromkeys([r.prompt for r in requests] +
                                             [r.negative_prompt for r in requests if r.guidance != 1]))
                filled = filled_prompts(loop.instance, prompts, runner.cache, loop.text_encoder)  # the cache keeps them
                if filled and f"step '{name}': {filled}" not in runner.warnings:
                    runner.warnings.append(f"step '{name}': {filled}")
            encoded = set()
            for job in jobs:
                if job.how == "refine" and (job.ref, job.precision) not in encoded and \
                        (job.mask is not None or job.request.strength < 1):
                    loop = runner.card(job.ref).loop(job.precision)
                    loop.encode(job.source.image[None])
                    if job.mask is not None:
                        loop.latent_mask(job.mask)
                    encoded.add((job.ref, job.precision))
        stand_ins[name] = [Output(np.zeros((size, size), np.uint8), job.request.prompt, {})
                           for job in jobs for size in [runner.image_size(job)]]


class _Stopped(Exception):
    """A signal stopped a step between two waves; `entry` lists the images it has (kept or written)."""

    def __init__(self, entry: dict, images: int):
        super().__init__()
        self.entry, self.images = entry, images


def _jobs(runner: _Runner, step, outputs: dict[str, list[Output]]) -> list[_Job]:
    body = step.body
    if step.kind == "generate":
        return runner.sampled(body.card, body.prompts, body.num, body)
    if step.kind == "chain":
        return runner.refined(body.card, outputs[body.input], body, body.input)
    if step.kind == "best_of_n":
        return runner.picked(body)
    # parallel: every card in order, merged card by card
    return [job for ref in body.cards
            for job in (runner.sampled(ref, body.prompts, body.num, body) if body.input is None
                        else runner.refined(ref, outputs[body.input], body, body.input))]


def _run_step(runner: _Runner, workflow: Workflow, name: str, outputs: dict[str, list[Output]], folder: Path,
              report: WorkflowReport, callbacks, skip_existing: bool, caught: list[int] = ()) -> None:
    """Run step `name` on the earlier steps' `outputs` and add it to `report`: its images are made card by card in
    waves of a forward's worth (split across ranks), each wave written when done; a signal in `caught` stops the
    step after the wave in flight (`_Stopped`)."""
    manifest = workflow.manifest
    step = manifest.steps[name]
    begun, (on_step, on_wave) = time.perf_counter(), callbacks
    jobs = _jobs(runner, step, outputs)
    writable_folder(folder / name, "the output folder")
    paths = [folder / name / f"{k:03d}-{job.metadata['card']}-{prompt_slug(job.request.prompt)}-{job.tag}.png"
             for k, job in enumerate(jobs)]
    produced = runner.already_made(jobs, paths) if skip_existing else {}
    kept = len(produced)
    todo = [k for k in range(len(jobs)) if k not in produced]
    size = max(1, runner.max_batch // (step.body.n if step.kind == "best_of_n" else 1)) * runner.ranks.world
    groups = [list(group) for _, group in itertools.groupby(todo, key=lambda k: jobs[k].ref)]
    waves = [group[i:i + size] for group in groups for i in range(0, len(group), size)]

    def entry() -> dict:
        return {"step": name, "kind": step.kind, "seconds": round(time.perf_counter() - begun, 3), "kept": kept,
                "images": [{"path": str(o.path), **{k: json.loads(o.metadata[k]) if k in JSON_FIELDS else o.metadata[k]
                                                    for k in _REPORTED if k in o.metadata}}
                           for o in (produced[k] for k in range(len(jobs)) if k in produced)]}

    for number, wave in enumerate(waves):
        try:
            with OutOfMemory.raised("; the images written before it are listed (--json: partial)"):
                made = runner.make([jobs[k] for k in wave], step.body)
            for k, item in zip(wave, made, strict=True):
                item.path = paths[k]
                item.metadata = {**item.metadata, "workflow": manifest.id, "step": name, "step_kind": step.kind,
                                 "tag": jobs[k].tag}
                if runner.ranks.main:  # under torchrun the other ranks hold the same outputs
                    save_image(item.path, item.image, item.metadata)
                produced[k] = item
        except (RunFailed, BadInput):  # a full disk, NaN images, a refusal: what the step wrote is listed too
            if produced:
                report.steps.append(entry())
            raise
        if number < len(waves) - 1:
            if caught:
                raise _Stopped(entry(), len(jobs))
            if on_wave:
                on_wave(name, len(produced), len(jobs))
    outputs[name] = [produced[k] for k in range(len(jobs))]
    report.steps.append(entry())
    if on_step:
        on_step(report.steps[-1])


_REPORTED = ("card", "prompt", "seed", "steps", "strength", "input", "image", "mask", "best_of", "reward",
             "request_seed", "candidate", "scores")
