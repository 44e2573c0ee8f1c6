"""Rendering for people (Rich, on stdout; errors on stderr) and for scripts (one JSON document on stdout)."""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from cardtool.errors import CardtoolError, CardValidationError, OutOfMemory, as_cardtool_error, escaped_surrogates
from cardtool.words import counted  # noqa: F401 - the commands take it from here

__all__ = ["LateProgress", "console", "emit_json", "handled", "printable", "quoted_prompt", "say", "warn"]


def console(*, stderr: bool = False):
    """A Rich console; when not a terminal (a log, a pipe) it is 160 columns wide, not Rich's 80, so
    tables stay readable. COLUMNS overrides both when it is a width (at least 80); Rich would render nothing at 0.
    No emoji codes: a path or a description with `:dog:` in it is shown as written. Its height is given too, so that
    Rich never reads the environment's size itself (`terminal_size_from_environment`)."""
    import shutil

    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    size = shutil.get_terminal_size((160, 24)) if terminal else os.terminal_size((160, 24))
    columns, lines = terminal_size_from_environment("COLUMNS"), terminal_size_from_environment("LINES")
    width = max(columns, 80) if columns else size.columns
    return _printable_console()(file=stream if terminal else _TrimmedLines(stream), stderr=stderr, highlight=False,
                                soft_wrap=stderr, width=width, height=lines or size.lines, emoji=False)


class _TrimmedLines:
    """A stream whose lines lose the spaces Rich pads them with to the console's width: off a terminal, a table's
    last column padded every line of a piped `cards list` to 160 columns."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(re.sub(r" +(?=\n)", "", text))

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


TERMINAL_SIZES = {"COLUMNS": 20, "LINES": 1, "TERMINAL_WIDTH": 20}  # Rich's and Typer's, each with its least
MOST_CELLS = 10_000


def terminal_size_from_environment(name: str) -> int | None:
    """The size the environment variable `name` gives, when it is one a terminal can have (20 to 10,000 columns, 1
    to 10,000 lines); else None. Rich and Typer read COLUMNS, LINES and TERMINAL_WIDTH with `int()` after
    `str.isdigit` or nothing: COLUMNS=² or TERMINAL_WIDTH=abc raised, one of 5,000 digits passed Python's int limit,
    COLUMNS=10¹⁰ asked for lines of that many spaces (MemoryError, or a help screen of gigabytes), and a width of 2
    left the help blank."""
    value = os.environ.get(name, "")
    plausible = value.isascii() and value.isdecimal() and len(value) <= 5 and \
        TERMINAL_SIZES[name] <= int(value) <= MOST_CELLS
    return int(value) if plausible else None


def keep_plausible_terminal_sizes() -> None:
    """Removes each of TERMINAL_SIZES from the environment unless it is a size a terminal can have, before Rich or
    Typer read it: they then use the terminal's own size (or their defaults off a terminal)."""
    for name in TERMINAL_SIZES:
        if name in os.environ and terminal_size_from_environment(name) is None:
            del os.environ[name]


@functools.cache
def _printable_console():
    """Rich's Console, but every string it renders (a line, a table's cells and title) goes through `printable`
    first: a folder or file named with an ESC in it (`cards list`, `cards validate`) must not send the terminal an
    escape sequence. Rich itself drops only a few control codes (bell, backspace, CR), not ESC."""
    from rich.console import Console

    class PrintableConsole(Console):
        def render_str(self, text: str, **options):
            return super().render_str(printable(text), **options)

    return PrintableConsole


def say(line: str, *, stderr: bool = False) -> None:
    """One plain line (no markup, no wrapping): the per-image lines of `generate` need no Rich, whose import is
    a measurable part of a one-image command."""
    stream = sys.stderr if stderr else sys.stdout
    stream.write(printable(line) + "\n")
    stream.flush()


def progress_line(what: str, entry: dict) -> str:
    """A training run's progress line (train, distill, rl and each flywheel stage): `what step/steps`, the loss, the
    learning rate, samples/s, each method's own metrics, then the time spent and left (from this process's pace)."""
    fixed = ("step", "steps", "loss", "lr", "samples_per_second", "elapsed_seconds", "eta_seconds")
    parts = [f"{what} {entry['step']}/{entry['steps']}", f"loss {entry['loss']:.4f}", f"lr {entry['lr']:.2e}",
             f"{entry['samples_per_second']:.0f} samples/s",
             *(f"{k} {v:.4g}" for k, v in entry.items() if k not in fixed)]
    if "elapsed_seconds" in entry:
        parts.append(f"{clock(entry['elapsed_seconds'])} elapsed, {clock(entry['eta_seconds'])} left")
    return "  ".join(parts)


def paired_cells(d: dict) -> list[str]:
    """A paired difference's cells (paired.py, as a dict): Δ accuracy with its interval, the discordant pairs,
    McNemar's p, Δ FID with its interval — '–' where it has none."""
    judged = ["–"] * 3 if d.get("accuracy") is None else [
        f"{d['accuracy']:+.4f} ({d['accuracy_ci95'][0]:+.3f}…{d['accuracy_ci95'][1]:+.3f})",
        f"{d['only_a']} / {d['only_b']}", f"{d['mcnemar_p']:.3g}"]
    fid = "–" if d.get("fid_fmnist") is None else \
        f"{d['fid_fmnist']:+.3f} ({d['fid_fmnist_ci95'][0]:+.2f}…{d['fid_fmnist_ci95'][1]:+.2f})"
    return [*judged, fid]


def clock(seconds: float) -> str:
    """H:MM:SS (M:SS under an hour)."""
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def quoted_prompt(prompt: str, limit: int = 80) -> str:
    """`prompt` quoted for a one-line listing, cut to its first `limit` characters with '…' (the PNG's metadata and
    --json keep it whole): a paragraph-long prompt would otherwise fill the terminal once per image."""
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "…")


# the bidi embeddings, overrides and isolates, each to its escape
_REORDERING = {code: f"\\u{code:04x}" for code in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def printable(text: str) -> str:
    """`text` with its control characters (tab and newline aside) written as escapes: a message that quotes a file
    from elsewhere (a tokenizer's parse error, a path) never sends a terminal an escape sequence. So are the bidi
    controls that reorder what follows them on screen ('Trojan Source'): a folder named 'x', U+202E, 'gpj.png' must
    not read as 'xgnp.jpg'."""
    from cardtool.core.cards.source import CONTROL_CHARACTERS  # the pattern manifests refuse

    return CONTROL_CHARACTERS.sub(lambda m: repr(m[0])[1:-1], text).translate(_REORDERING)


def typed_command(name: str) -> str | None:
    """The command as typed — console script or `python -m cardtool` — for the card it makes to record, or None where
    `name` is not the command run (a call from Python rebuilds its own). Less `--resume`: a resumed run makes the
    card an uninterrupted one makes, and the command must run again where no run has started."""
    from cardtool.shell_words import shell_join

    if sys.argv[1:2] != [name]:
        return None
    return shell_join(["cardtool", *(word for word in sys.argv[1:] if word != "--resume")])


def warn(message: str) -> None:
    """A warning on stderr, yellow on a terminal."""
    message = printable(message)
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        from rich.markup import escape

        console(stderr=True).print(f"[yellow]warning[/yellow] {escape(message)}", highlight=False)
    else:
        say(f"warning {message}", stderr=True)


def emit_json(document: dict) -> None:
    """Print exactly one valid JSON document: `document`, or, if it cannot be written as strict JSON (a
    non-finite number, an integer past int-to-str's limit, a lone surrogate, an object JSON has no form
    for), an error document saying so — never `NaN`, `Infinity` or half a document. A byte of a path that is not
    UTF-8 (the file system's and the command line's, which Python holds as U+DC80–U+DCFF) is written as the
    text `\\udcXX`, as the messages print it: the work that path named was done."""
    try:
        text = json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = json.dumps(_bytes_shown(document), indent=2, ensure_ascii=False, allow_nan=False)
            text.encode("utf-8")
    except (ValueError, TypeError, RecursionError, UnicodeEncodeError) as e:
        message = f"the result cannot be written as JSON ({type(e).__name__}: {str(e)[:200]})"
        text = json.dumps({"error": {"kind": "internal", "message": message, "problems": []}}, indent=2)
        sys.stdout.write(text + "\n")
        raise typer.Exit(1)
    try:
        text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):  # a stdout that cannot hold a prompt's é (PYTHONIOENCODING=ascii)
        text = json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False)
    sys.stdout.write(text + "\n")


UNDECODED = re.compile("[\udc80-\udcff]")  # a byte Python could not decode (PEP 383)


def _bytes_shown(value):
    """`value` with each undecoded byte of a path (surrogateescape's U+DC80–U+DCFF) as the text `\\udcXX`."""
    if isinstance(value, str):
        return escaped_surrogates(value, UNDECODED)
    if isinstance(value, dict):
        return {_bytes_shown(k): _bytes_shown(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_bytes_shown(v) for v in value]
    return value


def error_json(error: CardtoolError) -> dict:
    if isinstance(error, CardValidationError):  # a card's, a workflow's or a recipe's manifest: named by its files
        files = list(dict.fromkeys(str(p.file) for p in error.problems)) or ["the manifest"]
        count = len(error.problems)
        message = f"{', '.join(files[:3])}{' …' if len(files) > 3 else ''} failed validation " \
                  f"({count} problem{'s' if count != 1 else ''})"
        return {"error": {"kind": "validation", "message": message, "problems": [p.to_json() for p in error.problems]}}
    return {"error": {"kind": error.kind, "message": str(error), "problems": [],
                      **({"partial": error.partial} if error.partial is not None else {})}}


OUT_OF_MEMORY = False  # a command said it ran out of memory: the exit skips the interpreter's teardown (`cli.main`)


@contextmanager
def handled(json_mode: bool) -> Iterator[None]:
    """Turn cardtool's own errors into a message (and a JSON error document) and its exit code."""
    try:
        with as_cardtool_error():  # the machine's errors — a full disk, too much memory asked — as cardtool's
            yield
    except CardtoolError as error:
        if json_mode:
            emit_json(error_json(error))
        lines = error.problems if isinstance(error, CardValidationError) else [error]
        try:
            from rich.markup import escape

            err = console(stderr=True)
            for line in lines:
                err.print(f"[red]error[/red] {escape(printable(str(line)))}")
        except Exception:  # noqa: BLE001 - memory ran out (a `ulimit -v` that torch filled): Rich's import fails
            # with MemoryError, ENOMEM, even CPython's SystemError; the message must still be said: a plain line fits
            sys.stderr.write("".join(f"error {printable(str(line))}\n" for line in lines))
        if isinstance(error, OutOfMemory):
            global OUT_OF_MEMORY
            OUT_OF_MEMORY = True
        raise typer.Exit(error.exit_code) from None


class LateProgress:
    """Progress on stderr once work has run for a while: on a terminal a Rich bar after a second; elsewhere (a log, CI)
    a line every LINE_EVERY seconds with the time left at the pace since the first report — a long run's log shows it
    moving without a line per step. A count that goes back (an eval's next row) starts a new run of reports."""

    LINE_EVERY = 10.0

    def __init__(self, enabled: bool, terminal: bool = True, what: str = "denoising", unit: str = "request-steps"):
        self.enabled, self.terminal, self.what, self.unit = enabled, terminal, what, unit
        self.started = time.perf_counter()
        self.first: tuple[float, int] | None = None  # (when, done) of this run's first report
        self.last_line, self.previous = self.started, 0
        self.bar = self.task = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if not self.terminal:
            now = time.perf_counter()
            if self.first is None or done < self.previous:
                self.first, self.last_line = (now, done), now
            self.previous = done
            since, first_done = self.first
            if now - self.last_line >= self.LINE_EVERY and first_done < done < total:
                self.last_line, spent = now, now - since
                left = clock(spent * (total - done) / (done - first_done))
                say(f"{self.what} {done:,} of {total:,} {self.unit} ({100 * done // total}%), {clock(spent)} "
                    f"elapsed, {left} left", stderr=True)
            return
        if self.bar is None:
            if time.perf_counter() - self.started < 1.0:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn(self.what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("denoise", total=total)
        self.bar.update(self.task, completed=done, total=total)  # a caller with a new total (a next row) resizes it
        if done >= total:  # done: off the screen, for the next bar (one live display at a time)
            self.stop()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
