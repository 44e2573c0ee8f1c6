"""A leading ~ in a path no shell expanded (`--out=~/x`, a quoted CARDTOOL_PATH in a CI file) is the home folder, as
pip takes it: never a folder named ~ made in the working folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer.main
from helpers import EXAMPLE_CARDS
from typer.testing import CliRunner

from cardtool.cli import app, is_path_type
from cardtool.core.data import data_dir
from cardtool.core.sampling.control import parse_control
from cardtool.paths import home_expanded


@pytest.fixture()
def home(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return home


def test_generate_with_every_path_given_after_equals_and_in_the_environment(home, monkeypatch):
    (home / "cards").symlink_to(EXAMPLE_CARDS)
    (home / "prompts.txt").write_text("a bag\n")
    monkeypatch.setenv("CARDTOOL_PATH", "~/cards")
    monkeypatch.setenv("CARDTOOL_CACHE", "~/cache")
    result = CliRunner().invoke(app, ["generate", "tiny-base", "--prompts-file=~/prompts.txt", "--steps", "1",
                                      "--out=~/images", "--json"])
    assert result.exit_code == 0, result.output
    made = [Path(i["path"]) for i in json.loads(result.stdout)["images"]]
    assert len(made) == 1 and made[0].parent == home / "images" and made[0].is_file()
    assert (home / "cache" / "text").is_dir(), "the encoded prompt is kept in ~/cache"
    assert list(Path.cwd().iterdir()) == [], "no folder named ~ in the working folder"
    info = CliRunner().invoke(app, ["cache", "info", "--json"])
    assert json.loads(info.stdout)["path"] == str(home / "cache")


def test_every_path_option_of_every_command_expands_the_home_folder(home):
    (home / "f.png").write_bytes(b"")
    (home / "d").mkdir()
    checked = 0

    def walk(command):
        nonlocal checked
        for param in command.params:
            if is_path_type(param.type):
                name = "d" if param.type.dir_okay and not param.type.file_okay else "f.png"
                assert Path(param.type.convert(f"~/{name}", param, None)) == home / name, (command.name, param.name)
                checked += 1
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    walk(typer.main.get_command(app))
    assert checked >= 25, checked


def test_data_and_control_given_as_text_expand_it_too(home, monkeypatch):
    (home / "data").mkdir()
    assert data_dir("~/data") == home / "data"
    monkeypatch.setenv("CARDTOOL_DATA", "~/data")
    assert data_dir() == home / "data"
    assert parse_control("~/c.png:edges") == (home / "c.png", "edges")
    assert parse_control("~/c.png") == (home / "c.png", None)


def test_what_a_shell_leaves_as_written_stays_as_written(home):
    assert home_expanded("~no-such-user-for-cardtool/x") == "~no-such-user-for-cardtool/x"
    assert home_expanded("./~/x") == "./~/x" and home_expanded("a~b") == "a~b" and home_expanded("-") == "-"
    assert home_expanded("~") == str(home)
