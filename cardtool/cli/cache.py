"""`cardtool cache info | clear` — light: what cardtool keeps to recompute faster (encoded prompts, weights
digests, FID reference features), where, and clearing it."""

from __future__ import annotations

from typing import Annotated

import typer

from cardtool.cli.output import counted, emit_json, handled, say, warn

app = typer.Typer(help="cardtool's cache of encoded prompts, weights digests and FID reference features: where it is, "
                  "its size, clearing it.", no_args_is_help=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout (see README).")]
_KINDS = {"text": "encoded prompts", "digests": "weights digests", "features": "FID reference features",
          "temporary": "left by interrupted writes"}


def _size(count: int) -> str:
    """'512 bytes', '26.4 KB', '16.2 MB', '1.3 GB', '2.0 TB' (decimal units)."""
    if count < 1000:
        return f"{count} bytes"
    exponent = min(6, (len(str(count)) - 1) // 3)
    if exponent < 6 and round(count / 1000 ** exponent, 1) >= 1000:  # 999,999 bytes: 1.0 MB, not 1000.0 KB
        exponent += 1
    return f"{count / 1000 ** exponent:.1f} {('KB', 'MB', 'GB', 'TB', 'PB', 'EB')[exponent - 1]}"


def _lines(report: dict, verb: str) -> None:
    say(f"{verb} {report['path']}" + (f"  (encoded prompts kept up to {_size(report['limit'])}; CARDTOOL_CACHE_MAX)"
                                      if "limit" in report else ""))
    for kind, what in _KINDS.items():
        if report[kind]["files"] or kind != "temporary":
            say(f"  {what:<26} {counted(report[kind]['files'], 'file'):>12}  {_size(report[kind]['bytes'])}")


@app.command("info")
def info_command(json_: JsonOption = False) -> None:
    """Where the cache is (CARDTOOL_CACHE, else $XDG_CACHE_HOME/cardtool, else ~/.cache/cardtool) and what it holds."""
    from cardtool.cache import usage

    with handled(json_):
        report = usage()
    if json_:
        emit_json(report)
        return
    _lines(report, "cache")
    if report["unreadable"]:
        warn(f"{counted(len(report['unreadable']), 'folder')} of cardtool's cache could not be read (another user's?) "
             f"and what they hold is not counted, e.g. {report['unreadable'][0]}")
    if report["problem"]:
        warn(f"{report['problem']}: runs keep nothing here and encode their prompts again (set CARDTOOL_CACHE)")


@app.command("clear")
def clear_command(json_: JsonOption = False) -> None:
    """Remove cardtool's files from the cache (nothing else in its folder); everything in it is recomputed on use."""
    from cardtool.cache import clear

    with handled(json_):
        report = clear()
    if json_:
        emit_json({"cleared": report})
        return
    _lines(report, "cleared")


@app.command("prune")
def prune_command(
    max_size: Annotated[str | None, typer.Option(
        "--max-size", help="Keep at most this much of encoded prompts, the most recently used (e.g. 500MB; default: "
        "CARDTOOL_CACHE_MAX, else 5GB, which every run also holds the cache to).")] = None,
    json_: JsonOption = False,
) -> None:
    """Remove the least recently used encoded prompts until the rest fit in --max-size."""
    from cardtool.cache import parse_size, prune

    with handled(json_):
        report = prune(None if max_size is None else parse_size(max_size), strict=True)
    if json_:
        emit_json({"pruned": report})
        return
    say(f"pruned {report['path']} to {_size(report['limit'])}: removed {counted(report['removed']['files'], 'file')} "
        f"({_size(report['removed']['bytes'])}), kept {counted(report['text']['files'], 'file')} "
        f"({_size(report['text']['bytes'])})")
