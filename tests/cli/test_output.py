"""The output layer every command shares (cli/output.py): console width, the formatters, warnings, the one JSON
document, errors turned into messages and exit codes, and the late progress reports."""

from __future__ import annotations

import errno
import io
import json
import os
from types import SimpleNamespace

import pytest
import typer

from cardtool.cli import output
from cardtool.errors import BadInput, CardValidationError, Problem, RunFailed


class Terminal(io.StringIO):
    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


# --- the console ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("columns, width", [("100", 100), ("50", 80), ("80", 80), ("20", 80), ("19", 160), ("0", 160),
                                            ("wide", 160), ("²", 160), (None, 160), ("10000", 10_000),
                                            ("10001", 160), pytest.param("9" * 5000, 160, id="5000-digits"),
                                            ("000080", 160)])
def test_off_a_terminal_the_console_is_160_wide_unless_columns_says_otherwise(columns, width, monkeypatch):
    monkeypatch.delenv("LINES", raising=False)  # set (as under xdist), it kept Rich from reading COLUMNS itself
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert output.console().width == width
    assert output.console(stderr=True).width == width


@pytest.mark.parametrize("lines, height", [("40", 40), ("0", 24), ("²", 24), ("tall", 24), (None, 24),
                                          pytest.param("9" * 5000, 24, id="5000-digits")])
def test_lines_is_the_console_s_height_where_it_is_one(lines, height, monkeypatch):
    """Rich read LINES (and COLUMNS) with str.isdigit: '²' passes it, and int() then raised in every table."""
    monkeypatch.setenv("COLUMNS", "²")
    if lines is None:
        monkeypatch.delenv("LINES", raising=False)
    else:
        monkeypatch.setenv("LINES", lines)
    console = output.console()
    assert (console.width, console.height) == (160, height)
    console.print("a table's worth")


@pytest.mark.parametrize("size", ["²", "0", "2", "abc", "9" * 5000, "10000000000"],
                         ids=["superscript", "zero", "two", "word", "5000-digits", "ten-billion"])
def test_a_size_no_terminal_has_leaves_help_and_usage_errors_at_the_default_width(size):
    """Rich and Typer read COLUMNS, LINES and TERMINAL_WIDTH themselves for the help and a usage error: with `int()`
    of anything (TERMINAL_WIDTH=abc), Python's int limit (5,000 digits), and a line of 10¹⁰ spaces (MemoryError, or
    a help screen of gigabytes) each ended in a traceback, and a width of 2 left the help blank. The CLI drops such
    a size before they read it."""
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": size, "LINES": size, "TERMINAL_WIDTH": size}
    for args, code in ((["--help"], 0), (["cards", "list", "--bogus"], 2)):
        shown = subprocess.run([sys.executable, "-m", "cardtool", *args], env=env, capture_output=True, text=True,
                               timeout=120)
        assert shown.returncode == code and "Traceback" not in shown.stderr, shown.stderr[-2000:]
        text = shown.stdout + shown.stderr
        assert "Usage: " in text and max(len(line) for line in text.splitlines()) == 80, text


def test_on_a_terminal_the_console_is_the_terminal_s_width(monkeypatch):
    import shutil

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size((132, 40)))
    monkeypatch.setattr("sys.stdout", Terminal())
    assert output.console().width == 132
    assert output.console(stderr=True).width == 160  # stderr is not the terminal here
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback: os.terminal_size(fallback))
    assert output.console().width == 160  # a terminal whose size is unknown


def test_the_error_console_writes_to_stderr_without_wrapping(capsys):
    err, out = output.console(stderr=True), output.console()
    assert err.stderr and err.soft_wrap and not out.stderr and not out.soft_wrap
    err.print("x" * 300)
    captured = capsys.readouterr()
    assert captured.err == "x" * 300 + "\n" and captured.out == ""


def test_the_console_shows_control_characters_as_escapes_in_lines_tables_and_titles(capsys):
    from rich.table import Table

    table = Table(title="title \x1b]0;x\x07")
    table.add_column("c\x1b[2J")
    table.add_row("a folder\x1b[31m", "tab\tkept")
    out = output.console()
    out.print(table)
    out.print("[bold]line\x1b[0m[/bold]", markup=True)
    out.print("plain \x9b", markup=False)
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown, repr(shown)
    for escaped in ("title \\x1b]0;x\\x07", "c\\x1b[2J", "a folder\\x1b[31m", "line\\x1b[0m", "plain \\x9b"):
        assert escaped in shown, (escaped, shown)


def test_a_card_folder_named_with_an_escape_sequence_is_listed_and_validated_with_it_escaped(tmp_path, monkeypatch):
    import shutil

    from helpers import EXAMPLE_CARDS
    from typer.testing import CliRunner

    from cardtool.cli import app

    folder = tmp_path / "cards" / "x\x1b]0;owned\x07"
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", folder)
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "cards"))
    for args in (["cards", "list"], ["cards", "validate", str(folder)]):
        result = CliRunner().invoke(app, args, env={"COLUMNS": "1000"})
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "x\\x1b]0;owned\\x07" in result.stdout, result.stdout


# --- the formatters ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seconds, text", [(0, "0:00"), (59.4, "0:59"), (59.6, "1:00"), (61, "1:01"),
                                           (3599.4, "59:59"), (3600, "1:00:00"), (3725.4, "1:02:05"),
                                           (36000, "10:00:00")])
def test_clock_is_minutes_and_seconds_with_hours_from_an_hour(seconds, text):
    assert output.clock(seconds) == text


@pytest.mark.parametrize("number, text", [(0, "0 images"), (1, "1 image"), (2, "2 images")])
def test_counted_says_the_plural_except_for_one(number, text):
    assert output.counted(number, "image") == text


def test_a_progress_line_shows_each_figure_and_the_method_s_own_metrics():
    entry = {"step": 3, "steps": 8, "loss": 0.123456, "lr": 0.001, "samples_per_second": 123.4,
             "grad_norm": 1.23456}
    assert output.progress_line("step", entry) == "step 3/8  loss 0.1235  lr 1.00e-03  123 samples/s  grad_norm 1.235"
    timed = {**entry, "elapsed_seconds": 3725.4, "eta_seconds": 59.6}
    assert output.progress_line("distill", timed) == ("distill 3/8  loss 0.1235  lr 1.00e-03  123 samples/s  "
                                                      "grad_norm 1.235  1:02:05 elapsed, 1:00 left")


def test_paired_cells_show_each_difference_with_its_interval_or_a_dash():
    d = {"accuracy": 0.0125, "accuracy_ci95": [-0.001, 0.026], "only_a": 3, "only_b": 8, "mcnemar_p": 0.2266,
         "fid_fmnist": -1.25, "fid_fmnist_ci95": [-2.0, -0.5]}
    assert output.paired_cells(d) == ["+0.0125 (-0.001…+0.026)", "3 / 8", "0.227", "-1.250 (-2.00…-0.50)"]
    assert output.paired_cells({**d, "accuracy": None}) == ["–", "–", "–", "-1.250 (-2.00…-0.50)"]
    assert output.paired_cells({**d, "fid_fmnist": None}) == ["+0.0125 (-0.001…+0.026)", "3 / 8", "0.227", "–"]
    assert output.paired_cells({}) == ["–"] * 4


def test_printable_escapes_control_characters_but_keeps_tabs_and_newlines():
    assert output.printable("a\x1b[31mred\x07\tb\nc\x7f") == "a\\x1b[31mred\\x07\tb\nc\\x7f"
    assert output.printable("plain é ✓") == "plain é ✓"


# --- plain lines and warnings --------------------------------------------------------------------------------

def test_say_writes_one_line_to_the_stream_asked_for(capsys):
    output.say("to stdout")
    output.say("[bold]to stderr[/bold]", stderr=True)
    output.say("out/\x1b[2J/a.png\ttab")  # a path from --out: its escape is shown, not sent
    output.say("x\u202egpj.png \u2066y")  # bidi controls would show it as xgnp.jpg
    captured = capsys.readouterr()
    assert captured.out == "to stdout\nout/\\x1b[2J/a.png\ttab\nx\\u202egpj.png \\u2066y\n"
    assert captured.err == "[bold]to stderr[/bold]\n"


def test_off_a_terminal_a_warning_is_one_plain_line_on_stderr(capsys):
    output.warn("the \x1b[2J card is [old]")
    captured = capsys.readouterr()
    assert captured.err == "warning the \\x1b[2J card is [old]\n" and captured.out == ""


def test_on_a_terminal_a_warning_is_yellow_and_its_markup_is_text(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    output.warn("keep [bold]this[/bold] :dog: \x1b[2J")
    text = terminal.getvalue()
    assert "\x1b[33mwarning\x1b[0m" in text and "keep [bold]this[/bold] :dog: \\x1b[2J" in text
    assert "\x1b[2J" not in text


def test_no_color_keeps_a_terminal_s_warning_plain(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    output.warn("plain")
    assert terminal.getvalue() == "warning plain\n"


# --- the JSON document ---------------------------------------------------------------------------------------

def test_json_is_indented_and_keeps_unicode(capsys):
    output.emit_json({"prompt": "café", "n": [1, 2.5]})
    text = capsys.readouterr().out
    assert text == '{\n  "prompt": "café",\n  "n": [\n    1,\n    2.5\n  ]\n}\n'


@pytest.mark.parametrize("encoding", ["ascii", "no-such-codec"])
def test_json_on_a_stdout_that_cannot_hold_unicode_is_escaped(encoding, monkeypatch):
    stream = type("Stream", (io.StringIO,), {"encoding": encoding})()
    monkeypatch.setattr("sys.stdout", stream)
    output.emit_json({"prompt": "café"})
    assert stream.getvalue() == '{\n  "prompt": "caf\\u00e9"\n}\n'
    assert json.loads(stream.getvalue()) == {"prompt": "café"}


def test_an_undecoded_byte_of_a_path_is_written_as_its_escape_a_lone_surrogate_is_an_error(capsys):
    output.emit_json({"path": "/a/caf\udce9", "list": ["\udc80"], "\udcff": 1})
    assert json.loads(capsys.readouterr().out) == {"path": "/a/caf\\udce9", "list": ["\\udc80"], "\\udcff": 1}
    with pytest.raises(typer.Exit):
        output.emit_json({"path": "/a/caf\udce9", "x": "\ud800"})  # no byte's: not a path's undecoded byte
    assert json.loads(capsys.readouterr().out)["error"]["kind"] == "internal"


def test_json_that_cannot_be_written_is_an_internal_error_document_and_exit_1(capsys):
    with pytest.raises(typer.Exit) as exit_:
        output.emit_json({"x": float("nan")})
    assert exit_.value.exit_code == 1
    text = capsys.readouterr().out
    assert text.startswith('{\n  "error": {\n    "kind": "internal",')
    document = json.loads(text)
    assert document["error"]["problems"] == []
    assert document["error"]["message"].startswith("the result cannot be written as JSON (ValueError: ")


def problem(file: str, message: str = "bad") -> Problem:
    return Problem(file, 3, 5, "components.dit", message, "fix it")


@pytest.mark.parametrize("files, message", [
    (["a.toml"], "a.toml failed validation (1 problem)"),
    (["a.toml", "a.toml"], "a.toml failed validation (2 problems)"),
    (["a.toml", "b.toml", "c.toml"], "a.toml, b.toml, c.toml failed validation (3 problems)"),
    (["a.toml", "b.toml", "c.toml", "d.toml"], "a.toml, b.toml, c.toml … failed validation (4 problems)"),
])
def test_a_validation_error_document_names_the_files_and_counts_the_problems(files, message):
    document = output.error_json(CardValidationError([problem(f) for f in files]))["error"]
    assert document["kind"] == "validation" and document["message"] == message
    assert document["problems"] == [problem(f).to_json() for f in files]


def test_an_error_document_carries_partial_work_only_when_there_is_some():
    kept = {"images": ["a.png"]}
    assert output.error_json(RunFailed("diverged", partial=kept)) == {
        "error": {"kind": "failed", "message": "diverged", "problems": [], "partial": kept}}
    assert output.error_json(BadInput("no such card")) == {
        "error": {"kind": "bad_input", "message": "no such card", "problems": []}}


# --- errors into messages and exit codes ---------------------------------------------------------------------

def exit_of(error: BaseException, json_mode: bool = False) -> int:
    with pytest.raises(typer.Exit) as exit_:
        with output.handled(json_mode):
            raise error
    return exit_.value.exit_code


def test_an_error_is_a_red_line_on_stderr_with_its_exit_code(capsys):
    assert exit_of(BadInput("no card [named] at /data/:dog:/ \x1b[2J x")) == 2
    captured = capsys.readouterr()
    assert captured.err == "error no card [named] at /data/:dog:/ \\x1b[2J x\n" and captured.out == ""
    assert exit_of(RunFailed("diverged")) == 1


def test_a_validation_error_prints_each_problem_and_in_json_mode_one_document(capsys):
    error = CardValidationError([problem("a.toml", "one"), problem("b.toml", "two")])
    assert exit_of(error, json_mode=True) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"error {problem('a.toml', 'one')}", f"error {problem('b.toml', 'two')}"]
    assert json.loads(captured.out) == output.error_json(error)


@pytest.mark.parametrize("error, code, line", [
    (OSError(errno.ENOSPC, "No space left on device", "/out/a.png"), 1,
     "error /out/a.png: No space left on device — free space on its disk"),
    (OSError(errno.EROFS, "Read-only file system"), 1,
     "error Read-only file system — put it on a writable file system"),
    (OSError(errno.EIO, "Input/output error", "/out/a.png"), 1, "error /out/a.png: Input/output error"),
    (OSError("gone"), 1, "error gone"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300), 2, f"error {'x' * 300}: File name too long"),
    (OSError(errno.ELOOP, "Too many levels of symbolic links", "/a"), 2, "error /a: Too many levels of symbolic links"),
    # Path.resolve's error for a loop before Python 3.13
    (RuntimeError("Symlink loop from '/runs/it\\'s'"), 2, "error /runs/it's: Too many levels of symbolic links"),
])
def test_a_disk_error_is_a_message_not_a_traceback(error, code, line, capsys):
    assert exit_of(error, json_mode=True) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n"
    document = json.loads(captured.out)["error"]
    assert document["kind"] == ("failed" if code == 1 else "bad_input") and document["message"] == line[6:]


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"),
                                   RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: "
                                                "can't allocate memory: you tried to allocate 10 bytes")])
def test_an_allocation_that_fails_is_out_of_memory_with_advice(error, capsys):
    assert exit_of(error, json_mode=True) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("error out of memory (") and "--max-batch" in captured.err
    assert json.loads(captured.out)["error"]["kind"] == "failed"


def test_any_other_error_is_not_handled():
    for error in (RuntimeError("shape mismatch"), ValueError("bug")):
        with pytest.raises(type(error), match=str(error)):
            with output.handled(False):
                raise error


def test_no_error_passes_through(capsys):
    with output.handled(True):
        value = 1
    assert value == 1 and capsys.readouterr() == ("", "")


# --- late progress -------------------------------------------------------------------------------------------

@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(output, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    return now


def test_off_a_terminal_progress_is_a_line_every_ten_seconds_at_the_pace_since_the_first_report(clock, capsys):
    progress = output.LateProgress(True, terminal=False, what="sampling")
    for at, done, total in [(100, 1, 100), (105, 3, 100), (105.5, 3, 100), (109.9, 4, 100), (110, 6, 100),
                            (115, 7, 100), (120.5, 100, 100),
                            (125, 2, 12_000), (134, 1_000, 12_000), (135, 1_234, 12_000)]:
        clock[0] = at
        progress(done, total)
    assert capsys.readouterr().err.splitlines() == [
        "sampling 6 of 100 request-steps (6%), 0:10 elapsed, 3:08 left",  # 10 s for 5 steps: 94 left
        "sampling 1,234 of 12,000 request-steps (10%), 0:10 elapsed, 1:27 left"]  # count went back: pace anew


def test_off_a_terminal_the_first_and_last_counts_print_nothing(clock, capsys):
    progress = output.LateProgress(True, terminal=False)
    progress(5, 10)
    clock[0] += 60
    progress(5, 10)  # no step since the first report: no pace yet
    clock[0] += 60
    progress(10, 10)
    assert capsys.readouterr().err == ""


def test_progress_names_its_unit_and_a_finished_bar_leaves_the_screen_for_the_next(clock, capsys):
    """generate shows the prompts' encoding, then the sampling: one live bar at a time, so the first goes when done."""
    progress = output.LateProgress(True, terminal=False, what="encoding prompts", unit="prompts")
    for at, done in [(100, 256), (111, 2_560), (120, 20_000)]:
        clock[0] = at
        progress(done, 20_000)
    assert capsys.readouterr().err == "encoding prompts 2,560 of 20,000 prompts (12%), 0:11 elapsed, 1:23 left\n"
    bar = output.LateProgress(True, terminal=True)
    clock[0] += 2
    bar(5, 10)
    assert bar.bar is not None and bar.bar.live.is_started
    shown = bar.bar
    bar(10, 10)
    assert bar.bar is None and not shown.live.is_started
    bar(1, 4)  # the next count: a bar of its own
    assert bar.bar is not None and bar.bar is not shown
    bar.stop()
    assert bar.bar is None


def test_disabled_progress_reports_nothing(clock, capsys):
    for terminal in (True, False):
        progress = output.LateProgress(False, terminal=terminal)
        clock[0] += 60
        progress(1, 10)
        clock[0] += 60
        progress(5, 10)
        assert progress.bar is None
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_a_bar_appears_after_a_second_and_follows_the_count(clock, capsys):
    progress = output.LateProgress(True, terminal=True, what="evaluating")
    clock[0] = 100.99
    progress(1, 40)
    assert progress.bar is None
    clock[0] = 101.0
    progress(2, 40)
    try:
        task = progress.bar.tasks[0]
        assert (task.completed, task.total) == (2, 40)
        progress(30, 40)
        assert progress.bar.tasks[0].completed == 30
        progress(5, 80)  # the next row of a sweep: its own total
        assert (progress.bar.tasks[0].completed, progress.bar.tasks[0].total) == (5, 80)
    finally:
        shown = progress.bar
        progress.stop()
    assert not shown.live.is_started and progress.bar is None
