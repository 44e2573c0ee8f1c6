"""The command a card records (recipe.command): as typed at the shell, or rebuilt with every option that shaped its
recipe when the command line was not cardtool's own (a caller of the CLI from Python)."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from helpers import EXAMPLE_CARDS, TINY_RUNS
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card


@pytest.mark.parametrize("resumed", [False, True])
@pytest.mark.parametrize("name", TINY_RUNS)
def test_a_card_records_the_command_as_it_was_typed(tmp_path, monkeypatch, name, resumed):
    """Less `--resume`: a resumed run makes the card an uninterrupted one makes, and the command it records must run
    again where no run has started (`--resume` there is refused)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    args = [*TINY_RUNS[name], "--json"]
    if resumed:
        args += ["--run-dir", "run"]
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / ".lock").write_text("")  # a run started here, stopped before its first checkpoint
    given = [*args, "--resume"] if resumed else args
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/cardtool", *given])  # what the console script sees
    result = CliRunner().invoke(app, given)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    folder = document["path"] if name != "flywheel" else f"cards/{document['stages'][0]['card']}"
    typed = shlex.join(["cardtool", *args]) + ("  # stage rl" if name == "flywheel" else "")
    assert load_card(tmp_path / folder).manifest.recipe.command == typed
