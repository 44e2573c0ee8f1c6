"""`cardtool eval CARD` — class accuracy, FID-FMNIST, mean reward and images/s, measured the same way."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from cardtool.cli.output import LateProgress, console, counted, emit_json, handled, paired_cells, warn


def eval_command(
    card: Annotated[str, typer.Argument(help="A text-to-image card id, folder or manifest.")],
    judge: Annotated[str, typer.Option("--judge", "--reward", help="The judge card: its classifier gives accuracy "
                                       "and reward, its features FID (fashion-referee is a held-out second "
                                       "judge).")] = "fashion-classifier",
    steps: Annotated[list[int] | None, typer.Option("--steps", help="Step counts; repeat for several.")] = None,
    guidance: Annotated[list[float] | None, typer.Option("--guidance", help="CFG scales; repeat.")] = None,
    guidance_interval: Annotated[str | None, typer.Option(
        "--guidance-interval", metavar="LO,HI", help="σ range whose steps use CFG (default: the card's).")] = None,
    shift: Annotated[float | None, typer.Option("--shift", help="σ-grid shift (default: the card's).")] = None,
    solver: Annotated[str | None, typer.Option(
        "--solver", help="euler, dpmpp_2m, sde or renoise (default: the card's).")] = None,
    per_class: Annotated[int, typer.Option("--per-class", help="Images per class (10 classes).")] = 100,
    seed: Annotated[int, typer.Option("--seed", help="First seed of each class.")] = 0,
    device: Annotated[str | None, typer.Option("--device", help="Override the device (cuda, cpu).")] = None,
    data: Annotated[str | None, typer.Option("--data", help="An IDX folder, or images with captions in "
                                             "metadata.jsonl (default: Fashion-MNIST).")] = None,
    precision: Annotated[list[str] | None, typer.Option(
        "--precision", help="Sampling precision (float32, bfloat16, float16); repeat for several.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", metavar="NAME[=SCALE]", help="Evaluate with this adapter stack (repeat to compose) instead "
        "of the card's default one.")] = None,
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write the report (JSON) to this file after every row.")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Keep the rows --out already holds for this evaluation (a stopped sweep) and measure the "
        "rest.")] = False,
    record: Annotated[bool, typer.Option(
        "--record", help="Write the report beside the card (eval.json), its summary into the recipe.")] = False,
    max_batch: Annotated[int, typer.Option(
        "--max-batch", help="Model rows per forward (a guided request takes two); lower it to save memory, the "
        "images are the same.")] = 256,
    expect: Annotated[list[str] | None, typer.Option(
        "--expect", metavar="METRIC>=VALUE", help="A threshold every row must meet (or <=, >, <; repeat): "
        "class_accuracy, fid_fmnist, kid, manifold_precision, manifold_recall, mean_reward or images_per_second. "
        "Exit 1 if a row misses one.")] = None,
    versus: Annotated[str | None, typer.Option(
        "--versus", metavar="CARD", help="Also evaluate this card on the same requests and compare the two image "
        "pair by image pair: B − A in accuracy (McNemar's exact test) and FID, with paired 95% intervals.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")] = False,
) -> None:
    """Evaluate a card: per step count and guidance, accuracy by the judge, FID-FMNIST with its floors."""
    from cardtool.core.evaluation.evaluate import evaluate
    from cardtool.core.sampling.planning import parse_interval

    err = console(stderr=True)

    def progress(row, of: str | None = None) -> None:  # on stderr, also under --json
        card_of = f"{of}: " if of else ""
        err.print(f"{card_of}{row.precision} steps {row.steps} guidance {row.guidance:g}{_interval(row)}: "
                  f"accuracy {_accuracy(row)}  FID {_fid(row)}  "
                  f"KID×1000 {1000 * row.kid:.2f} ± {1000 * row.kid_std:.2f}  {_manifold(row)}  "
                  f"reward {_reward(row)}  "
                  f"{row.images_per_second:.0f} img/s",
                  markup=False)

    with handled(json_):
        from cardtool.core.sampling.adapters import parse_adapter
        from cardtool.errors import BadInput, RunFailed, disk_said

        if versus is not None:
            given = [name for name, value in (("--record", record), ("--out", out), ("--resume", resume),
                                              ("--expect", expect)) if value]
            if given:
                raise BadInput(f"--versus measures and compares two cards in one run; drop {', '.join(given)}")
        if record and (adapter or shift is not None or solver is not None):
            raise BadInput("--record keeps the eval of the card as it serves by default; drop --adapter, --shift and "
                           "--solver to record")
        if record:
            from cardtool.core.cards.record import recordable

            recordable(card)
        from cardtool.core.evaluation.expectations import parse_expectation

        expectations = [parse_expectation(e) for e in expect or []]  # a typo found now, not after the eval
        interval = parse_interval(guidance_interval) if guidance_interval is not None else None
        steps_done = LateProgress(enabled=not sys.stderr.isatty(), terminal=False, what="this row:")
        options = dict(judge=judge, steps=steps, guidance=guidance, guidance_interval=interval, per_class=per_class,
                       seed=seed, device=device, data=data, precision=precision,
                       adapters=[parse_adapter(a) for a in adapter] if adapter else None, shift=shift, solver=solver,
                       on_step=steps_done, max_batch=max_batch)
        if versus is None:
            comparison, report = None, evaluate(card, **options, on_row=progress, out=out, resume=resume)
        else:
            from cardtool.core.evaluation.versus import compare

            comparison = compare(card, versus, **options, on_row=lambda of, row: progress(row, of))
            report = comparison.a
        document = comparison.to_json() if comparison else report.to_json()
        for measured in [report] + ([comparison.b] if comparison else []):
            if measured.rank == 0 and measured.rows and all(math.isnan(r.fid_fmnist) for r in measured.rows):
                # the work made no result: a script reading the exit status must not take null rows for a measurement
                raise RunFailed(f"no row{f' of {measured.card}' if comparison else ''} measured: " + "; ".join(
                    w for w in measured.warnings if "no measurement" in w)
                    + ("; the card was not recorded" if record else ""), document)
        if record and report.rank == 0:
            from cardtool.core.cards.record import record_eval

            try:
                record_eval(card, report.to_json())
            except OSError as e:  # a full disk: the measured rows are not lost with the record
                raise RunFailed(f"the eval ran, but recording it failed: {e.filename or card}: {disk_said(e)}; "
                                "its report is under 'partial' (--json)", report.to_json()) from None
    if report.rank != 0:  # under torchrun rank 0 reports for every rank
        return
    checks = [(str(e), e.failures(report.rows)) for e in expectations]
    missed = [line for _, failures in checks for line in failures]
    if json_:
        emit_json({**document, "ok": not missed,
                   "expectations": [{"expect": e, "passed": not f, "failures": f} for e, f in checks]})
        raise typer.Exit(1 if missed else 0)
    from rich.markup import escape

    shown = console()
    for measured in [report] + ([comparison.b] if comparison else []):
        _print_report(shown, measured)
    if comparison:
        _print_differences(shown, comparison.a.card, comparison.b.card, comparison.differences)
    elif report.precision_differences:
        _print_differences(shown, report.card, report.card, report.precision_differences, by="precision")
    if report.kept_rows:
        err.print(f"{report.kept_rows} of {len(report.rows)} rows kept from {out} (measured before)", markup=False)
    for line in missed:
        err.print(f"[red]expectation missed[/red] {escape(line)}")
    if checks and not missed:
        err.print(f"every row meets {', '.join(e for e, _ in checks)}", markup=False)
    if missed:
        raise typer.Exit(1)


def _print_report(shown, report) -> None:
    """One card's table, its floors and its warnings."""
    from rich import box
    from rich.table import Table

    stack = ", ".join(f"{a['name']}={a['scale']:g}" for a in report.adapters)
    sampler = f", {report.rows[0].solver} on shift {report.rows[0].shift:g}" if report.rows else ""
    what = f"{counted(report.per_class, 'image')} per class" if report.prompts == "classes" else \
        "one image per test caption (no classes: no accuracy or reward)"
    title = f"{report.card}{f' with {stack}' if stack else ''} judged by {report.judge} on {report.platform}, " \
            f"{what}{sampler}"
    table = Table(box=box.SIMPLE_HEAD, title=title, title_justify="left")
    for column in ("precision", "steps", "guidance", "class accuracy (95%)", "FID-FMNIST (± boot.)", "KID×1000",
                   "manifold P / R", "mean reward", "images/s"):
        table.add_column(column, justify="right")
    for r in report.rows:
        table.add_row(r.precision, str(r.steps), f"{r.guidance:g}{_interval(r)}", _accuracy(r), _fid(r),
                      f"{1000 * r.kid:.2f} ± {1000 * r.kid_std:.2f}", _manifold(r, short=True), _reward(r),
                      f"{r.images_per_second:.0f}")
    shown.print(table)
    for r in report.rows:  # where a card falls short, class by class
        if r.accuracy_by_class:
            weakest = sorted(r.accuracy_by_class.items(), key=lambda item: item[1])[:3]
            shown.print(f"{r.precision}, {counted(r.steps, 'step')}, guidance {r.guidance:g}: weakest classes "
                        + " · ".join(f"{name} {value:.3f}" for name, value in weakest), markup=False)
    floors, kid, manifold = report.floors, report.kid_floors, report.manifold_floors

    def floor(name: str) -> str:
        pair = manifold.get(name)
        return (f"FID {floors[name]:.3f} / KID×1000 {1000 * kid[name]:.2f}"
                + (f" / precision {pair[0]:.3f}, recall {pair[1]:.3f}" if pair else ""))

    shown.print(f"floors: real train vs test {floor('train_vs_test')}; VAE reconstructions vs test "
                f"{floor('vae_reconstruction')}", markup=False)
    for warning in report.warnings:
        warn(warning)


def _print_differences(shown, a: str, b: str, differences, by: str = "card") -> None:
    """The paired differences, B − A, row pair by row pair (of two cards, or of one card's precisions)."""
    from rich import box
    from rich.table import Table

    what = "the same prompts and seeds" + (", each precision against the first" if by == "precision" else "")
    table = Table(box=box.SIMPLE_HEAD, title=f"B − A: {what}, image pair by image pair", title_justify="left")
    for column in (f"A: {a}", f"B: {b}", "Δ accuracy (95%)", "only A / only B right", "McNemar p",
                   "Δ FID-FMNIST (95%)"):
        table.add_column(column, justify="right")
    for d in differences:
        settings = [f"{s['precision']}, {counted(s['steps'], 'step')}, guidance {s['guidance']:g}" for s in (d.a, d.b)]
        table.add_row(*settings, *paired_cells(asdict(d)))
    shown.print(table)


def _interval(row) -> str:
    """' on σ ≤ 0.4' style suffix when guidance applies to part of the trajectory only."""
    low, high = row.guidance_interval
    if row.guidance == 1 or (low, high) == (0, 1):
        return ""
    return f" on σ ≤ {high:g}" if low == 0 else f" on σ ∈ [{low:g}, {high:g}]"


def _accuracy(row) -> str:
    """The accuracy with its 95% interval, where the row has one (rows measured before it did have none); '–' for
    a row of captions, which have no class."""
    if row.class_accuracy is None or math.isnan(row.class_accuracy):
        return "–"
    ci = row.class_accuracy_ci95
    return f"{row.class_accuracy:.4f}" + (f" ({ci[0]:.3f}–{ci[1]:.3f})" if ci else "")


def _reward(row) -> str:
    return "–" if row.mean_reward is None or math.isnan(row.mean_reward) else f"{row.mean_reward:.4f}"


def _manifold(row, short: bool = False) -> str:
    """Improved precision and recall, where the row has them (rows measured before they existed have none)."""
    if row.manifold_precision is None:
        return "–" if short else ""
    if short:
        return f"{row.manifold_precision:.3f} / {row.manifold_recall:.3f}"
    return f"precision {row.manifold_precision:.3f} recall {row.manifold_recall:.3f}"


def _fid(row) -> str:
    return f"{row.fid_fmnist:.3f}" + (f" ± {row.fid_fmnist_std:.2f}" if row.fid_fmnist_std is not None else "")
