"""Running a workflow manifest (in one process, or split by rank under torchrun): each card is loaded once on one
platform (generators and rewards side by side), steps run in dependency order, every step's images are written as
PNGs whose metadata names the workflow and the step, and the report lists them (with best-of-N's scores)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cardtool.atomic import writable_folder
from cardtool.backends.platform import Platform
from cardtool.core import distributed
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.sampling.generate import (
    LoadedCard,
    image_metadata,
    plan_requests,
    prompt_slug,
    save_image,
    settings_tag,
)
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache
from cardtool.core.workflows.manifest import Workflow
from cardtool.errors import RunFailed

__all__ = ["Output", "WorkflowReport", "run_workflow"]


@dataclass
class Output:
    image: np.ndarray  # uint8 (H, W)
    prompt: str
    metadata: dict[str, str]
    path: Path | None = None


@dataclass
class WorkflowReport:
    workflow: str
    platform: str
    steps: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"workflow": self.workflow, "platform": self.platform, "seconds": round(self.seconds, 3),
                "steps": self.steps}


class _Runner:
    def __init__(self, workflow: Workflow, device: str | None, max_batch: int):
        self.workflow, self.max_batch = workflow, max_batch
        self.platform = Platform.detect(device)
        self.device = device
        self.cache = TextFeatureCache()  # keyed by card and weights version: safe to share between cards
        self.cards: dict[str, LoadedCard] = {}
        self.ranks = distributed.ranks(self.platform.device)  # under torchrun each step's images are split by rank

    def locate(self, ref: str) -> Path:
        from cardtool.core.cards.discovery import locate

        return locate(self.workflow.card_ref(ref), near=self.workflow.folder)

    def card(self, ref: str) -> LoadedCard:
        if ref not in self.cards:
            self.cards[ref] = LoadedCard(str(self.locate(ref)), device=self.device, cache=self.cache)
        return self.cards[ref]

    def _requests(self, loaded: LoadedCard, prompts: list[str], num: int, body):
        adapters = list(body.adapters.items()) if body.adapters is not None else None
        requests, _ = plan_requests(loaded.card, prompts, num=num, seed=body.seed, steps=body.steps,
                                    guidance=body.guidance, shift=body.shift, solver=body.solver, adapters=adapters,
                                    negative_prompt=body.negative_prompt)
        return requests

    def generate(self, ref: str, prompts: list[str], num: int, body) -> list[Output]:
        loaded = self.card(ref)
        loop = loaded.loop()
        requests = self._requests(loaded, prompts, num, body)
        images = self.ranks.spread(requests, lambda chosen: list(loop.finalize(sample(loop, chosen,
                                                                                       max_batch=self.max_batch))))
        return [Output(i, r.prompt, image_metadata(loop, r)) for r, i in zip(requests, images, strict=True)]

    def refine(self, ref: str, inputs: list[Output], body, source: str) -> list[Output]:
        """SDEdit with card `ref`: each input re-noised to σ = strength with seed body.seed + k, then denoised."""
        loaded = self.card(ref)
        loop = loaded.loop()
        requests = []
        for k, item in enumerate(inputs):
            (request,) = self._requests(loaded, [item.prompt], 1, body.model_copy(update={"seed": body.seed + k}))
            requests.append(dataclasses.replace(request, strength=body.strength))
        if not inputs:
            return []

        def work(chosen):
            # strength 1 re-noises all the way: the input is forgotten, the step is plain sampling of its prompts
            sources = loop.encode(np.stack([inputs[k].image for k, _ in chosen])) if body.strength < 1 else None
            requests = [r for _, r in chosen]
            return list(loop.finalize(sample(loop, requests, max_batch=self.max_batch, sources=sources)))

        images = self.ranks.spread(list(enumerate(requests)), work)
        # the input's own tag makes this image's: a rerun whose input step changed writes beside, never over, it
        return [Output(i, r.prompt, {**image_metadata(loop, r), "input": f"{source}/{k}",
                                     "input_tag": inputs[k].metadata.get("tag", "")})
                for k, (r, i) in enumerate(zip(requests, images, strict=True))]

    def best_of_n(self, body) -> list[Output]:
        from cardtool.core.sampling.best_of import best_of_n

        loaded = self.card(body.card)
        loop = loaded.loop()
        reward = loaded.reward(str(self.locate(body.reward)))
        def work(chosen):
            picked = best_of_n(loop, reward, chosen, body.n, max_batch=self.max_batch).checked(loop.instance.card.id)
            return list(zip(picked.requests, picked.images, picked.metadata(), strict=True))

        made = self.ranks.spread(self._requests(loaded, body.prompts, body.num, body), work)
        return [Output(i, r.prompt, {**image_metadata(loop, r), **extra}) for r, i, extra in made]


def run_workflow(workflow: Workflow, *, out: str | Path = "outputs", device: str | None = None,
                 max_batch: int = 128, on_step=None) -> WorkflowReport:
    """Run every step; images go to OUT/WORKFLOW_ID/STEP/NNN-….png, each step's as it finishes."""
    runner = _Runner(workflow, device, max_batch)
    manifest = workflow.manifest
    folder = writable_folder(Path(out) / manifest.id, "the output folder")  # before the first step, not after
    report = WorkflowReport(manifest.id, f"{runner.platform.device}/{runner.platform.arch}")
    outputs: dict[str, list[Output]] = {}
    started = time.perf_counter()
    with stop_requests(runner.ranks.world == 1) as caught:  # Ctrl-C / SIGTERM: the step in flight finishes first
        for number, name in enumerate(workflow.order):
            try:
                _run_step(runner, workflow, name, outputs, folder, report, on_step)
            except RunFailed as failed:  # a full disk, NaN images: the finished steps stay listed
                if report.steps and failed.partial is None:
                    failed.partial = report.to_json()
                raise
            if caught and number < len(workflow.order) - 1:
                raise Interrupted.after(caught[0], f"{number + 1} of {len(workflow.order)} steps: their images are "
                                        f"written in {folder}", report.to_json())
    report.seconds = time.perf_counter() - started
    return report


def _run_step(runner: _Runner, workflow: Workflow, name: str, outputs: dict[str, list[Output]], folder: Path,
              report: WorkflowReport, on_step) -> None:
    """Run step `name` on the earlier steps' `outputs`, write its images and add it to `report`."""
    manifest = workflow.manifest
    step = manifest.steps[name]
    body, begun = step.body, time.perf_counter()
    if step.kind == "generate":
        produced = runner.generate(body.card, body.prompts, body.num, body)
    elif step.kind == "chain":
        produced = runner.refine(body.card, outputs[body.input], body, body.input)
    elif step.kind == "best_of_n":
        produced = runner.best_of_n(body)
    else:  # parallel: every card in order, merged card by card
        produced = [o for ref in body.cards
                    for o in (runner.generate(ref, body.prompts, body.num, body) if body.input is None
                              else runner.refine(ref, outputs[body.input], body, body.input))]
    outputs[name] = produced
    _write(folder / name, produced, manifest.id, name, step.kind, runner.ranks.main)
    entry = {"step": name, "kind": step.kind, "seconds": round(time.perf_counter() - begun, 3),
             "images": [{"path": str(o.path), **{k: json.loads(o.metadata[k]) if k == "scores" else o.metadata[k]
                                                 for k in _REPORTED if k in o.metadata}} for o in produced]}
    report.steps.append(entry)
    if on_step:
        on_step(entry)


_REPORTED = ("card", "prompt", "seed", "steps", "strength", "input", "best_of", "reward", "request_seed", "candidate",
             "scores")


def _write(folder: Path, produced: list[Output], workflow: str, step: str, kind: str, main: bool = True) -> None:
    """Name each image and write it (rank 0 only: under torchrun the other ranks hold the same outputs)."""
    writable_folder(folder, "the output folder")
    for k, item in enumerate(produced):
        tag = settings_tag(item.metadata)  # a run with other settings keeps this one's images
        item.path = folder / f"{k:03d}-{item.metadata['card']}-{prompt_slug(item.prompt)}-{tag}.png"
        item.metadata = {**item.metadata, "workflow": workflow, "step": step, "step_kind": kind, "tag": tag}
        if main:
            save_image(item.path, item.image, item.metadata)
