"""Step-level batching: many requests (prompts × seeds, any mix of guidance, steps, shift and solver)
advance together, compatible work sharing each transformer forward, up to `max_batch` samples a forward."""

from __future__ import annotations

from collections.abc import Callable

from cardtool.core.sampling.denoise import DenoiseLoop, LoopState, Request

__all__ = ["sample"]


def sample(loop: DenoiseLoop, requests: list[Request], *, capture: bool = False, max_batch: int = 128,
           on_step: Callable[[int, int], None] | None = None, grad: bool = False,
           sources: list | None = None, keeps: list | None = None) -> list[LoopState]:
    """Run every request to the end and return their final states (latents, and capture if asked).

    Each forward holds up to `max_batch` model rows (a request on a guided step counts twice), so 64 guided
    requests share one forward by default: larger products run more efficiently, bf16 ones especially.
    `on_step(done, total)` reports progress in request-steps. Without `grad` the forwards run under inference
    mode; either way at the instance's precision. `sources`: the start latents of requests that start from an image;
    `keeps`: their inpainting masks (`DenoiseLoop.latent_mask`), where they keep part of it."""
    states = loop.init(requests, capture, sources, keeps)
    total, done = sum(r.steps - s.step for r, s in zip(requests, states, strict=True)), 0
    # requests with the same LoRA stack side by side: the DiT then adds each run's delta in one product
    ordered = sorted(states, key=_stack) if any(s.adapters for s in states) else states
    with loop.arrays.inference() if not grad else loop.arrays.compute():
        while active := [s for s in ordered if not s.done]:
            for chunk in _chunks(active, max_batch):
                loop.step(chunk)
                done += len(chunk)
                if on_step:
                    on_step(done, total)
    return states


def _stack(state: LoopState) -> tuple:
    return tuple((use.adapter.version, use.scale) for use in state.adapters if use.adapter.kind == "lora")


def _chunks(states: list[LoopState], max_batch: int):
    chunk, size = [], 0
    for state in states:
        cost = 2 if state.guided else 1
        if chunk and size + cost > max_batch:
            yield chunk
            chunk, size = [], 0
        chunk.append(state)
        size += cost
    if chunk:
        yield chunk
