"""An eval's report on disk (`eval --out FILE`), rewritten after every row, and read back by `--resume`: rows measured
under the same identity — cardtool's version, the card's and the judge's weights, images per class, seeds, data,
adapters, platform — are kept, so a sweep stopped after hours loses at most the row in flight."""

from __future__ import annotations

import json
import math
from pathlib import Path

from cardtool.atomic import write_atomic
from cardtool.errors import BadInput
from cardtool.files import file_stamp, parse_json, read_small_file

__all__ = ["ROW_SETTINGS", "identity", "previous_rows", "report_stamp", "write_report"]

ROW_SETTINGS = ("precision", "steps", "guidance", "guidance_interval", "shift", "solver")  # what tells rows apart
_MEASURED = ("fid_fmnist", "kid", "kid_std", "images_per_second")
_JUDGED = ("class_accuracy", "mean_reward")  # null in a row of captions (no classes), else measured too


def identity(instance, judge_instance, per_class: int, seed: int, data: Path, adapters: list, platform: str) -> dict:
    """What every row of a report shares: a row measured under another identity measures something else."""
    def versions(inst):
        return {name: inst.weights_version(name) for name in sorted(inst.card.manifest.components)}

    from cardtool import __version__

    files = sorted(p for p in data.iterdir() if p.is_file())
    return {"cardtool": __version__, "card": instance.card.id, "card_weights": versions(instance),
            "judge": judge_instance.card.id, "judge_weights": versions(judge_instance), "per_class": per_class,
            "seed": seed, "data": {"folder": str(data.resolve()), "files": {p.name: p.stat().st_size for p in files}},
            "adapters": adapters, "platform": platform}


def previous_rows(path: Path, expected: dict) -> tuple[dict, list[dict]]:
    """(floors document, rows) of the report at `path` if it was measured under `expected`; ({}, []) where there is no
    file yet. A file that is not such a report, or one of another identity, is a BadInput naming what differs."""
    if not path.exists() and not path.is_symlink():
        return {}, []
    text, reason = read_small_file(path, limit=1 << 26)  # never blocking on a FIFO
    try:
        report = parse_json(text) if not reason else None
    except ValueError as e:
        reason = f"it is not JSON ({e})"
    if reason:
        raise BadInput(f"cannot resume from {path}: {reason}")
    if not isinstance(report, dict) or not isinstance(report.get("identity"), dict) \
            or not isinstance(report.get("rows"), list):
        raise BadInput(f"cannot resume from {path}: it is not an eval report written by eval --out")
    found = report["identity"]
    differ = [key for key in expected if found.get(key) != expected[key]]
    if differ:
        raise BadInput(f"cannot resume from {path}: it was measured with other {', '.join(differ)}; drop --resume to "
                       "measure again from the start, or choose another --out")

    def measured(value) -> bool:
        return isinstance(value, (int, float)) and math.isfinite(value)

    rows = [row for row in report["rows"] if isinstance(row, dict) and all(k in row for k in ROW_SETTINGS)
            and all(measured(row.get(k)) for k in _MEASURED)
            and all(measured(row.get(k)) or (row.get(k) is None and report.get("prompts") == "captions")
                    for k in _JUDGED)]
    floors = {k: report[k] for k in ("floors", "kid_floors", "manifold_floors") if isinstance(report.get(k), dict)}
    return floors, rows


def report_stamp(path: Path) -> tuple | None:
    """The report file's `file_stamp`, None where there is none: each write replaces the file (a new inode), so a
    stamp that moved between two of this run's writes is another process's write."""
    try:
        return file_stamp(path)
    except FileNotFoundError:
        return None


def write_report(path: Path, document: dict, ident: dict) -> None:
    """The report so far, with its identity, atomically: the file always holds every finished row."""
    write_atomic(path, (json.dumps({**document, "identity": ident}, indent=2) + "\n").encode())
