"""Light commands never import torch or transformers (DESIGN.md invariant 5), proven in a fresh process."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from helpers import EXAMPLE_CARDS

PROBE = """
import json, sys
sys.argv = ["cardtool", *json.loads(sys.argv[1])]
from cardtool.cli import main
try:
    main()
except SystemExit as e:
    code = e.code
else:
    code = 0
heavy = [m for m in ("torch", "transformers", "diffusers") if m in sys.modules]
open(OUT, "w").write(json.dumps({"code": code, "heavy": heavy}))
"""

COMMANDS = [
    ["--help"],
    ["--version"],
    ["cards", "--help"],
    ["cards", "list"],
    ["cards", "list", "--json"],
    ["cards", "show", "tiny-distilled"],
    ["cards", "show", "tiny-distilled", "--json"],
    ["cards", "validate", "--checksums", str(EXAMPLE_CARDS)],
    ["cards", "lineage", "tiny-distilled", "--json"],
    ["cards", "diff", "tiny-base", "tiny-rl"],
    ["platform", "detect"],
    ["platform", "detect", "--json"],
    ["platform", "matrix"],
    ["platform", "matrix", "--json"],
    ["parity", "--help"],
    ["generate", "--help"],
    ["train", "--help"],
    ["eval", "--help"],
    ["cache", "info"],
    ["cache", "info", "--json"],
    ["cache", "prune", "--max-size", "1GB", "--json"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_light_command_imports_no_torch(args, tmp_path, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))  # prune removes nothing of the user's
    out = tmp_path / "probe.json"
    code = PROBE.replace("OUT", repr(str(out)))
    subprocess.run([sys.executable, "-c", code, json.dumps(args)], check=True, capture_output=True, timeout=60)
    report = json.loads(out.read_text())
    assert report["code"] in (0, None), f"cardtool {' '.join(args)} exited {report['code']}"
    assert report["heavy"] == [], f"cardtool {' '.join(args)} imported {report['heavy']}"


def test_help_shows_flags_as_flags_and_values_as_words():
    from typer.testing import CliRunner

    from cardtool.cli import app

    text = CliRunner().invoke(app, ["generate", "--help"], env={"COLUMNS": "160"}).stdout
    assert "<bool>" not in text and "list[str]" not in text and "{card}" not in text.lower(), text
    grid = next(line for line in text.splitlines() if "--grid" in line)
    assert grid.split("--grid", 1)[1].split()[0] == "Also", "a flag takes no value, so no metavar follows it"


def test_every_command_that_replaces_its_output_takes_both_spellings():
    """`--force` and `--overwrite` mean the same on every command that can replace what it writes: a script that
    passes one to `train` and the other to `distill` is not refused for the spelling."""
    import typer

    from cardtool.cli import app

    def commands(group, path=()):
        for name, command in group.commands.items():
            yield from commands(command, (*path, name)) if hasattr(command, "commands") else [((*path, name), command)]

    replacing = {}
    for path, command in commands(typer.main.get_command(app)):
        for param in command.params:
            if {"--force", "--overwrite"} & set(param.opts):
                replacing[" ".join(path)] = set(param.opts)
    assert {"train", "distill", "rl", "flywheel", "cards merge", "cards export"} <= set(replacing), replacing
    assert all(opts == {"--force", "--overwrite"} for opts in replacing.values()), replacing


def test_a_heavy_command_imports_torch_once_with_the_collector_paused(tmp_path, monkeypatch):
    """torch's first import (arrays.py) runs without garbage collection and freezes what it made, so later full
    collections skip it; the collector is running again afterwards (a training run must still free cycles)."""
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))  # prune removes nothing of the user's
    out = tmp_path / "probe.json"
    code = PROBE.replace("OUT", repr(str(out))).replace(
        '"heavy": heavy}', '"heavy": heavy, "gc": __import__("gc").isenabled(), '
                           '"frozen": __import__("gc").get_freeze_count()}')
    args = ["generate", "tiny-base", "-p", "a shirt", "--steps", "1", "--out", str(tmp_path / "one.png")]
    subprocess.run([sys.executable, "-c", code, json.dumps(args)], check=True, capture_output=True, timeout=120)
    report = json.loads(out.read_text())
    assert report["code"] in (0, None) and "torch" in report["heavy"]
    assert report["gc"] is True and report["frozen"] > 100_000


def test_a_reader_that_stops_reading_is_not_a_failure(tmp_path):
    """`cardtool … | head -1`: once the pipe closes, the command finishes as if it had been read (exit 0, its summary
    on stderr), not exit 1 as click makes of the broken pipe."""
    for args, summary in ((["cards", "list", "--json"], ""),
                          (["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "-n", "30", "--steps", "1",
                            "--out", str(tmp_path / "out")], "30 images from tiny-base")):
        process = subprocess.Popen([sys.executable, "-m", "cardtool", *args], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, env={**os.environ, "CARDTOOL_CACHE": str(tmp_path / "c")})
        process.stdout.close()  # before the command writes anything: its every write meets a closed pipe
        errors = process.stderr.read().decode()
        assert process.wait(timeout=120) == 0 and "Traceback" not in errors and summary in errors, errors
    assert len(list((tmp_path / "out").glob("*.png"))) == 30


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device every write to fails")
def test_an_output_that_cannot_be_written_is_said_not_a_traceback(tmp_path):
    """A full disk under stdout: a `--json` document that could not be written is exit 1 with one line saying so
    (not a traceback, not exit 0), after the work is done; under stderr, the warnings and progress are lost but
    the command is not — its images are written and it exits 0."""
    env = {**os.environ, "CARDTOOL_CACHE": str(tmp_path / "c")}
    tiny = ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "--steps", "3"]
    for args, stdout, status in ((["cards", "list", "--json"], "full", 1),
                                 ([*tiny, "--json", "--out", str(tmp_path / "a")], "full", 1),
                                 ([*tiny, "--out", str(tmp_path / "b")], "stderr", 0)):
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-m", "cardtool", *args], env=env, text=True, timeout=120,
                                  stdout=full if stdout == "full" else subprocess.PIPE,
                                  stderr=full if stdout == "stderr" else subprocess.PIPE)
        said = done.stderr if stdout == "full" else done.stdout
        assert done.returncode == status and "Traceback" not in said, said
        if stdout == "full":
            assert said.strip().splitlines()[-1] == "error cannot write standard output: No space left on device"
    assert [len(list((tmp_path / d).glob("*.png"))) for d in "ab"] == [1, 1]


def test_a_removed_working_folder_is_said_before_any_work(tmp_path):
    """A shell standing in a folder that was removed: one line saying so, exit 2 (and the JSON error document) —
    not a bare "No such file or directory", nor torch's import dying in MKL's loader."""
    gone = tmp_path / "gone"
    gone.mkdir()
    script = f"cd {gone} && rmdir {gone} && exec {sys.executable} -m cardtool cards list --json"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    message = "the working folder no longer exists (it was removed after the shell entered it); cd to one that does"
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == f"error {message}", done.stderr
    assert json.loads(done.stdout) == {"error": {"kind": "bad_input", "message": message, "problems": []}}


def test_a_closed_stdout_or_stderr_is_not_a_traceback(tmp_path):
    """`>&-` leaves sys.stdout None: the command does its work, says its output was lost and exits 1; `2>&-` costs
    only the messages."""
    tiny = f"{sys.executable} -m cardtool generate {EXAMPLE_CARDS / 'tiny-base'} -p 'a bag' --steps 2"
    env = {**os.environ, "CARDTOOL_CACHE": str(tmp_path / "c")}
    for script, status, said in ((f"{tiny} --out {tmp_path / 'a'} --json >&-", 1,
                                  "error cannot write standard output: it is closed"),
                                 (f"{tiny} --out {tmp_path / 'b'} 2>&-", 0, str(tmp_path / "b")),
                                 (f"{sys.executable} -m cardtool cards show nope >&- 2>&-", 2, "")):
        done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == status and said in done.stdout + done.stderr, done.stderr
        assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert [len(list((tmp_path / d).glob("*.png"))) for d in "ab"] == [1, 1]
    # the closed descriptor is /dev/null while the command runs: left free, the next file opened (a PNG, a
    # checkpoint) would take its number and receive what C code writes to standard error or output
    seen = tmp_path / "fds"
    probe = ("import os, cardtool.cli as cli\n"
             "def command():\n"
             f"    open({str(seen)!r}, 'w').write(os.readlink('/proc/self/fd/1') + ' ' + os.readlink("
             "'/proc/self/fd/2'))\n"
             "    raise SystemExit(0)\n"
             "cli.app = command\n"
             "cli.main()\n")
    for redirect in (">&-", "2>&-", ">&- 2>&-"):
        done = subprocess.run(["bash", "-c", f"{sys.executable} -c {shlex.quote(probe)} {redirect}"], timeout=60,
                              capture_output=True, text=True)
        assert done.returncode == 0, (redirect, done.stderr)
        assert seen.read_text().count("/dev/null") == redirect.count("&-"), (redirect, seen.read_text())
        seen.unlink()
