"""`cardtool eval`: quality and speed of a text-to-image card, measured the same way every time.

For each step count and guidance: N images per class from the class prompts with fixed seeds (0…N−1), sampled
with the card's own loop and its defaults for the rest (shift, solver, guidance interval); the judge card
gives class accuracy and mean reward; FID-FMNIST is the Fréchet distance of the judge's features, generated
vs the 10,000 real test images, and KID (unbiased, with its spread over subsets) the kernel distance of the same
features, which stays meaningful where N is too small for FID (the report says when). Two floors put both in
scale: N real train images vs the test set, and N VAE reconstructions of train images vs the test set."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import numbers
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from cardtool.atomic import refuse_stream, replaceable_file, writable_folder
from cardtool.backends.platform import Platform
from cardtool.backends.precision import check_precision
from cardtool.core import distributed
from cardtool.core.cards.loader import load_card
from cardtool.core.data import CLASS_NAMES, data_dir, load_split
from cardtool.core.evaluation.metrics import (
    fid_warning,
    frechet_distance,
    frechet_std,
    kernel_distance,
    precision_recall,
    wilson_interval,
)
from cardtool.core.evaluation.paired import precision_differences
from cardtool.core.evaluation.reference import cached_floors, reference_features
from cardtool.core.evaluation.resume import ROW_SETTINGS, identity, previous_rows, report_stamp, write_report
from cardtool.core.evaluation.reward import FashionJudge, reward_card
from cardtool.core.interrupt import Interrupted, stop_requests
from cardtool.core.prompts import class_prompt
from cardtool.core.sampling.denoise import DenoiseLoop, NonFiniteImages
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.planning import MAX_IMAGES, MissingControl, plan_requests, unguided_warning
from cardtool.core.sampling.sampler import sample
from cardtool.core.sampling.text_cache import TextFeatureCache, filled_prompts
from cardtool.errors import BadInput, OutOfMemory, RunFailed, disk_said, said_as_cardtool_errors
from cardtool.words import counted

__all__ = ["EvalRow", "EvalReport", "checked_per_class", "evaluate"]

_FLOORS = ("train_vs_test", "vae_reconstruction")


@dataclass
class EvalRow:
    steps: int
    guidance: float
    guidance_interval: list[float]  # the σ range of the guided steps
    precision: str  # the sampler's compute precision (the judge always runs in float32)
    images: int
    class_accuracy: float | None  # None (null) in a row of captions, which have no class
    fid_fmnist: float
    kid: float  # ×1000 is the usual way to print it
    kid_std: float
    mean_reward: float | None
    images_per_second: float
    model_evaluations: int = 0  # transformer evaluations per image: two on each guided step
    shift: float = 1.0  # the σ grid's shift
    solver: str = "euler"
    class_accuracy_ci95: list[float] | None = None  # its Wilson interval (metrics.wilson_interval)
    fid_fmnist_std: float | None = None  # its bootstrap deviation over the generated images (metrics.frechet_std)
    manifold_precision: float | None = None  # improved precision and recall (metrics.precision_recall), k = 3
    manifold_recall: float | None = None
    accuracy_by_class: dict[str, float] | None = None  # each class's share judged right (per_class images each)


@dataclass
class EvalReport:
    card: str
    judge: str
    platform: str
    per_class: int
    rows: list[EvalRow] = field(default_factory=list)
    floors: dict[str, float] = field(default_factory=dict)
    kid_floors: dict[str, float] = field(default_factory=dict)
    manifold_floors: dict[str, list[float]] = field(default_factory=dict)  # [precision, recall] of each floor's images
    warnings: list[str] = field(default_factory=list)
    adapters: list[dict] = field(default_factory=list)  # the stack every image used: name, scale
    rank: int = 0  # under torchrun, the process this report is from: rank 0 holds the rows, the others none
    kept_rows: int = 0  # rows read back from --out (--resume), not measured again
    # "classes": the class prompts, judged for accuracy; "captions": an image folder's test captions, which have no
    # class — its rows measure FID, KID and precision/recall against the folder's test images, accuracy and reward null
    prompts: str = "classes"
    # with keep_samples: per row, each image's (judged correct, judge features), None for a row without; and the real
    # images' features — what a paired comparison of two cards needs (versus.py); never in the JSON
    samples: list[tuple[np.ndarray, np.ndarray] | None] = field(default_factory=list, repr=False)
    real: np.ndarray | None = field(default=None, repr=False)
    # with several precisions: each later precision's rows against the first's, pair by pair (paired.py)
    precision_differences: list | None = None

    def to_json(self) -> dict:
        return {"card": self.card, "judge": self.judge, "platform": self.platform, "per_class": self.per_class,
                "prompts": self.prompts, "adapters": self.adapters,
                "floors": self.floors, "kid_floors": self.kid_floors, "manifold_floors": self.manifold_floors,
                "rows": [_finite(asdict(r)) for r in self.rows],
                **({"precision_differences": [asdict(d) for d in self.precision_differences]}
                   if self.precision_differences is not None else {}),
                "kept_rows": self.kept_rows, "warnings": self.warnings}


def _listed(name: str, value) -> list | None:
    """A list parameter of `evaluate` as a list: one value alone is a list of one (not a string's characters); a
    range or a numpy vector is its values."""
    if value is None:
        return None
    if isinstance(value, np.ndarray) and value.ndim <= 1:  # np.arange(1, 5), np.array(20)
        value = value.reshape(-1).tolist()
    if isinstance(value, (str, numbers.Real)) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (list, tuple, range)):  # numpy scalars as Python's, so that the report stays JSON
        values = [v.item() if isinstance(v, np.generic) else v for v in value]
        try:
            return list(dict.fromkeys(values))  # a repeated value is one row
        except TypeError:  # an unhashable value, refused with the others when the rows are planned
            return values
    raise BadInput(f"{name} must be a list of values (or one value), got {value!r}")


def _finite(row: dict) -> dict:
    """A measurement that is not finite (a card sampling NaN) is null: strict JSON has no NaN."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def _floors_kept(kept: dict) -> bool:
    """Whether a report read back from --out holds both floors as eval writes them — FID and KID numbers, precision
    and recall pairs — so they are kept, not measured again."""
    def number(value) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

    return all(set(kept.get(k, {})) == set(_FLOORS) for k in ("floors", "kid_floors", "manifold_floors")) \
        and all(number(kept[k][name]) for k in ("floors", "kid_floors") for name in _FLOORS) \
        and all(isinstance(pair, list) and len(pair) == 2 and all(number(v) for v in pair)
                for pair in kept["manifold_floors"].values())


def _restored(row: dict | None) -> EvalRow | None:
    """A row read back from --out, or None — measured again — where one of its fields is missing or of another
    type than a row's (a report edited or damaged by hand)."""
    if row is None:
        return None
    from pydantic import TypeAdapter, ValidationError

    try:  # strict: a count written as 2.0 or "2" is not one eval wrote
        restored = TypeAdapter(EvalRow).validate_json(json.dumps({f.name: row[f.name] for f in fields(EvalRow)
                                                                   if f.name in row}), strict=True)
    except ValidationError:
        return None
    # what the types do not say: pairs of two, and precision with its recall (a row printed with one of them failed)
    pairs = [restored.guidance_interval, *([restored.class_accuracy_ci95] if restored.class_accuracy_ci95 else [])]
    if any(len(pair) != 2 for pair in pairs) or \
            (restored.manifold_precision is None) != (restored.manifold_recall is None):
        return None
    return restored


def checked_per_class(per_class) -> int:
    """`--per-class` as an int: a whole number from 1 to MAX_IMAGES / 10 (a row's images), checked before anything is
    sized by it (an array of that many labels, a flywheel's two training stages before its eval)."""
    if not isinstance(per_class, numbers.Integral) or isinstance(per_class, bool) or per_class < 1:
        raise BadInput(f"--per-class must be a whole number, at least 1, got {per_class!r}"[:300])
    if per_class * len(CLASS_NAMES) > MAX_IMAGES:
        raise BadInput(f"--per-class {per_class} asks for {per_class * len(CLASS_NAMES):,} images a row; at most "
                       f"{MAX_IMAGES:,} (--per-class {MAX_IMAGES // len(CLASS_NAMES):,})"[:300])
    return int(per_class)


@said_as_cardtool_errors
def evaluate(card_ref: str, *, judge: str = "fashion-classifier", steps: list[int] | None = None,
             guidance: list[float] | None = None, guidance_interval: tuple[float, float] | None = None,
             per_class: int = 100, seed: int = 0, device: str | None = None, data: str | None = None,
             precision: list[str] | None = None, on_row: Callable[[EvalRow], None] | None = None,
             adapters: list[tuple[str, float]] | None = None, shift: float | None = None,
             solver: str | None = None, out: str | os.PathLike | None = None, resume: bool = False,
             on_step: Callable[[int, int], None] | None = None, max_batch: int = 256,
             keep_samples: bool = False, stop: list[int] | None = None) -> EvalReport:
    """`adapters`: the stack every image uses instead of the card's default one (see Adapters in the README);
    `steps`, `guidance` and `precision` each a list of values (one value is a list of one), a row per combination;
    `shift` and `solver` for every row (default: the card's loop). `out`: a JSON file the report is written to after
    every row; with `resume`, the rows (and floors) it already holds for this evaluation are kept, not measured
    again. `on_step(done, total)`: progress inside each row, in request-steps (this process's share). `max_batch`:
    model rows per forward (a guided request takes two) — lower it to save memory; the images are the same.
    `keep_samples`: keep each row's per-image results in `report.samples` (see EvalReport), for `versus.compare`
    (kept for the eval's own use, and dropped after it, where several precisions are paired);
    `stop`: the signal list of a caller's own `stop_requests` block (one around several evaluations), used instead of
    this evaluation's own, so that a stop asked during its last row reaches the caller."""
    per_class = checked_per_class(per_class)
    if not isinstance(max_batch, numbers.Integral) or isinstance(max_batch, bool) or max_batch < 1:
        raise BadInput(f"--max-batch must be a whole number, at least 1, got {max_batch!r}")
    if not isinstance(judge, (str, os.PathLike)):
        raise BadInput(f"judge must be a reward card's id or folder, got {judge!r}")
    if data is not None and not isinstance(data, (str, os.PathLike)):
        raise BadInput(f"data must be a folder of Fashion-MNIST files, got {data!r}"[:300])
    data_dir(data)  # a folder that is not there, before any model loads
    for name, callback in (("on_row", on_row), ("on_step", on_step)):  # found after a row's work otherwise
        if callback is not None and not callable(callback):
            raise BadInput(f"{name} must be a function, got {callback!r}"[:300])
    for name, flag in (("resume", resume), ("keep_samples", keep_samples)):
        if not isinstance(flag, bool):
            raise BadInput(f"{name} must be True or False, got {flag!r}"[:300])
    if stop is not None and not isinstance(stop, list):
        raise BadInput(f"stop must be the list a stop_requests block yields, got {stop!r}"[:300])
    if resume and out is None:
        raise BadInput("--resume continues the report in --out FILE; give --out")
    if out is not None:
        if not isinstance(out, (str, os.PathLike)) or str(out) == "":
            raise BadInput(f"out must be the report's file name, got {out!r}"[:300])
        refuse_stream(out, "the report is written to a file that --resume continues", "a file name")
        out = Path(out)
        if os.path.isdir(out):  # False for a name too long to exist, which replaceable_file says
            raise BadInput(f"--out {out} is a folder; give the report's file name")
        replaceable_file(out, "--out")
        writable_folder(out.parent, "the report's folder", keep=False)  # found now, not after the first row
    steps, guidance, precision = (_listed(name, value) for name, value in
                                  (("steps", steps), ("guidance", guidance), ("precision", precision)))
    card, judge_card, planned = plan_rows(card_ref, judge=judge, steps=steps, guidance=guidance, seed=seed,
                                          guidance_interval=guidance_interval, adapters=adapters, shift=shift,
                                          solver=solver)
    for read in (card, judge_card):
        _not_read_from(out, read)
    # the class prompts × seeds seed … seed + per_class − 1 (plan_requests orders prompts × seeds)
    count, labels = per_class * len(CLASS_NAMES), np.repeat(np.arange(len(CLASS_NAMES)), per_class)
    plans = planned([class_prompt(c) for c in range(len(CLASS_NAMES))], per_class)
    platform = Platform.detect(device)
    for name in precision or []:
        check_precision(platform, name)
    ranks = distributed.ranks(platform.device)
    cache = TextFeatureCache()
    loops = {p: DenoiseLoop(ModelInstance(card, platform, p), cache=cache)
             for p in precision or [card.manifest.recipe.assumes.precision]}
    first = next(iter(loops.values()))  # its VAE makes the reconstruction floor
    keeping = keep_samples or len(loops) > 1  # several precisions: their rows paired at the end
    judge_instance = ModelInstance(judge_card, platform, "float32")
    referee = FashionJudge(judge_instance)
    test, train, count = eval_splits(data, per_class)
    if test.captions is not None:  # your own images: the first `count` test captions, one image each at seed + i
        plans, labels = planned(list(test.captions[:count]), 1, apart=True), None
    test_digest = test.digest()
    real = reference_features(referee, test.images, test_digest)
    report = EvalReport(card.id, judge_instance.card.id, f"{platform.device}/{platform.arch}", per_class,
                        rank=ranks.rank, real=real if keeping else None,
                        prompts="classes" if labels is not None else "captions")
    stack = [{"name": name, "scale": scale} for name, scale in next(iter(plans.values()))[0].adapters]
    ident = identity(first.instance, judge_instance, per_class, seed, data_dir(data), stack, report.platform)
    # by content: an uncompressed IDX file rewritten with other images keeps its size, and an image folder's images
    # lie in subfolders the listing of its files does not reach
    ident["data"]["digest"] = {"train": train.digest(), "test": test_digest}
    # None: the card's loop default for steps and guidance
    cells = list(itertools.product(loops.items(), guidance or [None], steps or [None]))
    if out is not None and not resume:
        _refuse_dropping(out, ident, {_settings(p, plans[(g, k)][0]) for (p, _), g, k in cells})
    kept_floors, kept_rows = _previous(out, ident, ranks) if resume else ({}, [])
    seen = report_stamp(out) if out is not None and ranks.main else None  # what this run may write over
    if _floors_kept(kept_floors):
        report.floors, report.kid_floors = kept_floors["floors"], kept_floors["kid_floors"]
        report.manifold_floors = kept_floors["manifold_floors"]
    else:
        def measured() -> dict:
            picked = np.random.default_rng(seed).choice(len(train), count, replace=False)
            floors = {"train_vs_test": referee.features(train.images[picked]),
                      "vae_reconstruction": referee.features(_reconstruct(first.instance, first.vae,
                                                                          train.images[picked]))}
            return {"floors": {name: round(frechet_distance(f, real), 4) for name, f in floors.items()},
                    "kid_floors": {name: round(kernel_distance(f, real)[0], 6) for name, f in floors.items()},
                    "manifold_floors": {name: _rounded(precision_recall(f, real)) for name, f in floors.items()}}

        kept = cached_floors(referee, first.instance, first.vae, {"data": ident["data"]["digest"], "seed": seed,
                                                                "count": count}, measured, _floors_kept)
        report.floors, report.kid_floors, report.manifold_floors = (kept[k] for k in ("floors", "kid_floors",
                                                                                      "manifold_floors"))
    warning = fid_warning(count, real.shape[1])
    report.warnings += [warning] if warning else []
    report.warnings += [w for loop in loops.values() for w in loop.instance.warnings]
    report.warnings += list(dict.fromkeys(w for requests in plans.values() if (w := unguided_warning(requests[0]))))
    if ranks.main:  # the prompts every row samples, encoded once here for all of them
        filled = filled_prompts(first.instance, [r.prompt for r in next(iter(plans.values()))], cache,
                                first.text_encoder, "prompt" if labels is not None else "caption")
        report.warnings += [filled] if filled else []
    saved = {_row_key(row): row for row in kept_rows}
    keys = [_settings(p, plans[(g, k)][0]) for (p, _), g, k in cells]
    restored = {key: _restored(saved.get(key)) for key in keys}  # None: measured (again)
    report.adapters = stack

    def save(reached: int) -> None:
        """The report so far, and the kept rows of the cells after the first `reached`: a run stopped before it
        reaches them loses none."""
        nonlocal seen
        if out is not None and ranks.main:
            document = report.to_json()
            document["rows"] += [saved[key] for key in keys[reached:] if restored[key] is not None]
            so_far = f"the {counted(len(report.rows), 'row')} so far {'is' if len(report.rows) == 1 else 'are'} " \
                     "under 'partial' (--json)"
            now = report_stamp(out)  # gone is no one's loss; another file there is another eval's (the same --out)
            if now is not None and now != seen:
                measured = f"; {so_far}" if report.rows else ""
                raise RunFailed(f"{out} was written by another process while this eval ran (another eval with the "
                                f"same --out?) and is left as it wrote it{measured}: give this eval another --out",
                                report.to_json())
            try:
                write_report(out, document, ident)
                seen = report_stamp(out)
            except OSError as e:  # a full disk: the rows measured are not lost with the file
                done = f"; {so_far}, and the same command with --resume measures those {out} does not hold" \
                    if report.rows else ""
                raise RunFailed(f"cannot write the report to {out}: {disk_said(e)}{done}", report.to_json()) from None

    save(0)
    stopping = stop_requests(ranks.world == 1) if stop is None else contextlib.nullcontext(stop)
    with stopping as caught:  # Ctrl-C / SIGTERM: the row in flight finishes, then a stop
        for number, ((p, loop), g, k) in enumerate(cells):
            requests = plans[(g, k)]
            row = restored[keys[number]]
            if row is not None:  # measured before under the same identity: kept as it was measured
                report.rows.append(row)
                report.samples += [None] if keeping else []
                report.kept_rows += 1
                if on_row:
                    on_row(report.rows[-1])
            else:
                kept = f"; the rows measured are in {out} (--resume keeps them)" if out else ""
                with OutOfMemory.raised(kept, report.to_json()):
                    _measure_row(report, referee, real, labels, count, ranks, p, loop, requests, on_row,
                                 on_step=on_step, max_batch=int(max_batch), keep=keeping)
            save(number + 1)
            if caught and number < len(cells) - 1:
                hint = f"; the same command with --resume measures the rest (rows so far in {out})" if out else ""
                raise Interrupted.after(caught[0], f"{number + 1} of {len(cells)} rows{hint}", report.to_json())
    report.warnings += [cache.problem] if cache.problem else []
    if len(loops) > 1:
        report.precision_differences = precision_differences(report)
        if not keep_samples:
            report.samples, report.real = [], None
    return report


def plan_rows(card_ref: str, *, judge: str = "fashion-classifier", steps: list[int] | None = None,
              guidance: list[float] | None = None, seed: int = 0, guidance_interval: tuple[float, float] | None = None,
              adapters: list[tuple[str, float]] | None = None, shift: float | None = None,
              solver: str | None = None) -> tuple:
    """(card, judge card, planned) of an evaluation, where `planned(prompts, num, apart)` plans every row's requests;
    the class prompts' are planned here, so that what cannot run (steps, guidance, seeds, adapters, a judge that
    cannot score the card, a card with no loop, weights that are not the ones its manifest declares) is refused before
    any data or model loads — also for a card measured only after another's hour (`--versus`, the flywheel's
    `--compare`)."""
    steps, guidance = _listed("steps", steps), _listed("guidance", guidance)
    card = load_card(card_ref, checksums=True)
    judge_card = reward_card(judge, scores=card)[0]

    def planned(prompts: list[str], num: int, apart: bool = False) -> dict:
        return {(g, k): _seeded(plan_requests(card, prompts, num=num, seed=seed, steps=k, guidance=g,
                                              guidance_interval=guidance_interval, adapters=adapters, shift=shift,
                                              solver=solver)[0], apart)
                for g, k in itertools.product(guidance or [None], steps or [None])}

    try:
        planned([class_prompt(0)], 1)
    except MissingControl as missing:
        raise BadInput(f"{missing}; eval makes its images without one: drop it from --adapter (generate --control "
                       "makes images with one)") from None
    return card, judge_card, planned


def eval_splits(data: str | None, per_class: int) -> tuple:
    """(test split, train split, images a row) of an eval of `per_class` images a class on `data` — a class's prompt
    per image, or with captioned images the first test captions, one image each — refused where it cannot be
    measured: FID and KID need two test images, the floors as many training images as a row has."""
    test, train = load_split("test", data), load_split("train", data)
    if len(test) < 2:  # one row has no covariance: FID's would be NaN and KID's estimator undefined
        raise BadInput(f"the test split of {data_dir(data)} holds {len(test)} image{'s' * (len(test) != 1)}; FID "
                       'and KID need at least two (an image folder holds out every tenth image, or the rows marked '
                       '"split": "test")')
    count = per_class * len(CLASS_NAMES)
    if test.captions is not None:
        count = min(count, len(test.captions))
    if count > len(train):
        raise BadInput(f"--per-class {per_class} asks for {count} images, more than the {len(train)} training images "
                       "the floors are measured on")
    return test, train, count


def _not_read_from(out: Path | None, card) -> None:
    """`--out` may not name a file the evaluation reads: the report would replace the card's manifest or weights."""
    if out is not None and out.resolve() in {path.resolve() for path in card.files()}:
        raise BadInput(f"--out {out} is a file of card '{card.id}' (its manifest or weights), which the report would "
                       "replace; give the report a file of its own")


def _seeded(requests: list, apart: bool) -> list:
    """The requests, each at its own seed (seed + i for the i-th) where `apart`: two test images with one caption
    then get two images, not one twice."""
    return [dataclasses.replace(r, seed=r.seed + i) for i, r in enumerate(requests)] if apart else requests


def _previous(out: Path, ident: dict, ranks) -> tuple[dict, list[dict]]:
    """`previous_rows` of --out as rank 0 reads it, on every rank: the rows it keeps are the rows no rank samples, and
    rank 0 rewrites the file while a slower rank may still be about to read it."""
    if ranks.world == 1:
        return previous_rows(out, ident)
    read = None
    if ranks.main:
        try:
            read = previous_rows(out, ident)
        except BadInput as e:  # said by every rank: its peers would wait for rank 0 in the first row
            read = str(e)
    read = ranks.all_gather(read)[0]
    if isinstance(read, str):
        raise BadInput(read)
    return read


def _refuse_dropping(out: Path, ident: dict, wanted: set) -> None:
    """Without --resume, --out is written from the start: refused where it holds rows of this same evaluation that
    this run measures again — a stopped sweep run again without --resume would lose its hours at the first write.
    Another evaluation's report, or a file that is none, is replaced as --out says."""
    if not out.exists():
        return
    try:
        _, rows = previous_rows(out, ident)
    except BadInput:
        return
    again = sum(_row_key(row) in wanted for row in rows)
    if again:
        them = "them" if again > 1 else "it"
        raise BadInput(f"{out} holds {again} row{'s' if again > 1 else ''} of this evaluation already (a stopped "
                       f"sweep's?): --resume keeps {them} and measures the rest; to measure {them} again, remove the "
                       "file or give another --out")


def _settings(precision: str, request) -> tuple[str, ...]:
    """A row's settings (ROW_SETTINGS) as a report on disk holds them."""
    return _row_key({"precision": precision, "steps": request.steps, "guidance": request.guidance,
                     "guidance_interval": list(request.guidance_interval), "shift": request.shift,
                     "solver": request.solver})


def _row_key(row: dict) -> tuple[str, ...]:
    """What tells a report's rows apart: their ROW_SETTINGS, as JSON."""
    return tuple(json.dumps(row[k]) for k in ROW_SETTINGS)


def _measure_row(report: EvalReport, referee: FashionJudge, real: np.ndarray, labels: np.ndarray | None, count: int,
                 ranks, p: str, loop: DenoiseLoop, requests: list, on_row, on_step=None, max_batch: int = 256,
                 keep: bool = False) -> None:
    """Sample one row's images at precision `p` and add its measurements to `report` (on rank 0; under torchrun each
    rank samples its share and rank 0 measures them all). Without `labels` (captions) no accuracy or reward."""
    mine = ranks.shard(requests)
    if mine:  # one request first, untimed: what a device does once (building the components, loading CUDA's kernels
        # for this precision: 1.7 s for bfloat16 on an H200, nearly a 1,000-image row's work) is not the row's speed
        loop.decode(sample(loop, [requests[mine[0]]]))
    started = time.perf_counter()
    broken = None
    try:
        mine_requests = [requests[i] for i in mine]
        made = loop.finalize(sample(loop, mine_requests, max_batch=max_batch, on_step=on_step)) if mine else []
    except NonFiniteImages as e:  # this row measures nothing; the others still do
        made, broken = [None] * len(mine), str(e)
    shares = ranks.gather(list(zip(mine, made, strict=True)))
    if not ranks.main:
        return
    made = [image for _, image in sorted((item for share in shares for item in share), key=lambda item: item[0])]
    seconds = time.perf_counter() - started
    first = requests[0]
    if any(image is None for image in made):
        nan = math.nan
        row = EvalRow(first.steps, first.guidance, list(first.guidance_interval), p, count, nan, nan, nan, nan,
                      nan, nan, first.model_evaluations(), first.shift, first.solver)
        kept = None
        report.warnings.append(f"{p}, {counted(first.steps, 'step')}, guidance {first.guidance:g}: no measurement, "
                               f"{broken or 'another rank made NaN or inf images'}")
    else:
        images = np.stack(made)
        features, probabilities = referee.judged(images)
        kid, kid_std = kernel_distance(features, real)
        fidelity, coverage = _rounded(precision_recall(features, real)) or (None, None)
        hits, judged = None, (math.nan, math.nan, None, None)
        if labels is not None:
            hits = probabilities.argmax(1) == labels
            judged = (round(float(hits.mean()), 4), round(float(probabilities[np.arange(count), labels].mean()), 4),
                      [round(bound, 4) for bound in wilson_interval(int(hits.sum()), count)],
                      {name: round(float(hits[labels == c].mean()), 4) for c, name in enumerate(CLASS_NAMES)})
        accuracy, reward, interval, by_class = judged
        row = EvalRow(first.steps, first.guidance, list(first.guidance_interval), p, count, accuracy,
                      round(frechet_distance(features, real), 4), round(kid, 6), round(kid_std, 6), reward,
                      round(count / seconds, 1), first.model_evaluations(), first.shift, first.solver, interval,
                      round(frechet_std(features, real), 4) if count > 1 else None, fidelity, coverage, by_class)
        kept = (hits, features)
    report.rows.append(row)
    if keep:
        report.samples.append(kept)
    if on_row:
        on_row(row)


def _rounded(pair: tuple[float, float] | None) -> list[float] | None:
    return [round(v, 4) for v in pair] if pair else None


def _reconstruct(instance: ModelInstance, vae_name: str, images: np.ndarray) -> np.ndarray:
    """uint8 reconstructions through the card's VAE (posterior mean), as the VAE floor."""
    vae, arrays = instance.component(vae_name), instance.arrays
    out = []
    with arrays.inference():
        for i in range(0, len(images), 500):
            x = arrays.asarray(images[i:i + 500].astype(np.float64)[:, None] / 127.5 - 1.0)
            out.append(arrays.to_numpy(vae.decode(vae.encode(x)[0]))[:, 0])
    return np.clip(np.round((np.concatenate(out).astype(np.float64) + 1) * 127.5), 0, 255).astype(np.uint8)
