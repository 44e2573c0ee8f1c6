"""Best-of-N: N candidates per request sampled together by the denoise loop, scored by a reward card in one batch,
the highest kept (ties go to the earlier candidate). Candidate 0 is the request itself, so best-of-N never scores
below plain sampling on the reward; candidate i's seed is derived from (seed, i), so every candidate — the winner
included — is reproduced by plain sampling at its own seed. A candidate sampled as NaN or inf has no score and is
never kept; a request whose every candidate is one is broken as a plain sample would be (`Picked.finite`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable

import numpy as np

from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages, Request
from cardtool.core.sampling.sampler import sample
from cardtool.errors import BadInput

__all__ = ["MAX_CANDIDATES", "Picked", "best_of_n", "candidate_seed"]

MAX_CANDIDATES = 1024  # per request: beyond this a planning mistake


def candidate_seed(seed: int, i: int) -> int:
    """The seed of candidate i of a request with `seed`: the seed itself for i = 0, else a 63-bit hash of both."""
    if i == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"best-of:{seed}:{i}".encode(), digest_size=8).digest(), "big") >> 1


@dataclasses.dataclass
class Picked:
    requests: list[Request]  # the winning candidate of each request (its seed reproduces the image)
    images: np.ndarray  # uint8 (B, H, W), the winners
    scores: list[list[float | None]]  # every candidate's reward, in candidate order (None: it sampled NaN)
    chosen: list[int]  # the winner's candidate index
    request_seeds: list[int]  # the seed each request asked for (candidate 0's)
    reward: str  # the reward card's id
    finite: np.ndarray  # per request: whether any candidate was an image (a request without one has a black image)

    def checked(self, card: str, precision: str | None = None) -> Picked:
        """These picks, or NonFiniteImages naming the requests whose every candidate sampled NaN or inf."""
        lost = [r for r, ok in zip(self.requests, self.finite, strict=True) if not ok]
        if lost:
            raise NonFiniteImages(card, lost, len(self.requests), precision=precision)
        return self

    def metadata(self) -> list[dict[str, str]]:
        """What each kept image's PNG records about its selection, beside its generation metadata."""
        return [{"best_of": str(len(row)), "reward": self.reward, "request_seed": str(seed), "candidate": str(c),
                 "scores": json.dumps([None if x is None else round(x, 6) for x in row])}
                for seed, c, row in zip(self.request_seeds, self.chosen, self.scores, strict=True)]


def best_of_n(loop: DenoiseLoop, reward, requests: list[Request], n: int, *, max_batch: int = 128,
              on_step: Callable[[int, int], None] | None = None, sources: list | None = None,
              keeps: list | None = None) -> Picked:
    """The best of `n` candidates of each request under `reward` (a `Reward`: `score(images, prompts)`); a request
    that starts from an image (`sources` and `keeps`, as `sample` takes them) starts every candidate from it."""
    if not 1 <= n <= MAX_CANDIDATES:
        raise BadInput(f"best-of N must be in 1…{MAX_CANDIDATES}, got {n}")
    candidates = [dataclasses.replace(r, seed=candidate_seed(r.seed, i)) for r in requests for i in range(n)]
    sources, keeps = ([item for item in per_request for _ in range(n)] if per_request is not None else None
                      for per_request in (sources, keeps))
    images, finite = loop.decode(sample(loop, candidates, max_batch=max_batch, on_step=on_step, sources=sources,
                                        keeps=keeps))
    scores = np.asarray(reward.score(images, [c.prompt for c in candidates]), dtype=np.float64)
    if scores.shape != (len(candidates),):
        raise BadInput(f"reward '{reward.card_id}' gave {scores.shape} scores for {len(candidates)} images")
    scores[~finite] = np.nan  # a candidate sampled as NaN or inf is not an image: it has no score and never wins
    grouped = scores.reshape(len(requests), n)
    chosen = [int(np.argmax(np.where(np.isnan(row), -np.inf, row))) for row in grouped]
    rows = [k * n + c for k, c in enumerate(chosen)]
    return Picked([candidates[i] for i in rows], images[rows],
                  [[None if np.isnan(s) else float(s) for s in row] for row in grouped], chosen,
                  [r.seed for r in requests], reward.card_id, finite[rows])
