"""`--negative-prompt`: CFG's unconditional branch takes it instead of the empty prompt; recorded, tagged, checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.sampling.generate import LoadedCard
from cardtool.core.sampling.images import read_png
from cardtool.errors import BadInput

torch.set_num_threads(1)


@pytest.fixture
def card(examples):
    return LoadedCard(str(examples / "tiny-base"), device="cpu")


def test_a_negative_prompt_steers_the_guided_branch_and_is_recorded(card, tmp_path):
    plain = card.generate("a bag", steps=3, out=tmp_path / "plain").images[0]
    steered = card.generate("a bag", steps=3, negative_prompt="a coat", out=tmp_path / "steered")
    image = steered.images[0]
    assert image.metadata["negative_prompt"] == "a coat" and plain.metadata["negative_prompt"] == ""
    assert image.path.name != plain.path.name, "its own settings tag: never overwrites the plain image"
    assert (read_png(image.path)[0] != read_png(plain.path)[0]).any()
    assert steered.warnings == []


def test_without_cfg_a_negative_prompt_changes_nothing_and_says_so(card, tmp_path):
    plain = card.generate("a bag", steps=3, guidance=1.0, out=tmp_path / "plain").images[0]
    report = card.generate("a bag", steps=3, guidance=1.0, negative_prompt="a coat", out=tmp_path / "steered")
    assert (read_png(report.images[0].path)[0] == read_png(plain.path)[0]).all()
    assert any("with guidance 1 (no CFG) it changes nothing" in w for w in report.warnings)


def test_an_empty_prompt_under_cfg_is_said_to_gain_nothing_from_it_unless_a_negative_prompt_steers_it(card, tmp_path):
    """`-p "$UNSET"`: an unconditional image, CFG's two rows a step spent on the null condition against itself."""
    guided = card.generate(["", "a bag"], steps=3, out=tmp_path / "guided")
    unguided = card.generate("", steps=3, guidance=1.0, out=tmp_path / "unguided")
    said = [w for w in guided.warnings if w.startswith("an empty prompt samples unconditionally")]
    assert len(said) == 1 and "guidance 4 changes nothing for it" in said[0], guided.warnings
    assert abs(read_png(guided.images[0].path)[0].astype(int) - read_png(unguided.images[0].path)[0]).max() <= 1
    for quiet in (card.generate("  ", steps=3, negative_prompt="a coat", out=None),
                  card.generate("", steps=3, guidance=1.0, out=None), card.generate("a bag", steps=3, out=None)):
        assert not [w for w in quiet.warnings if "empty prompt" in w], quiet.warnings


def test_the_command_takes_it_and_like_makes_it_again(examples, tmp_path):
    args = ["generate", str(examples / "tiny-base"), "-p", "a bag", "--steps", "2", "--json"]
    result = CliRunner().invoke(app, [*args, "--negative-prompt", "a coat", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    made = Path(json.loads(result.stdout)["images"][0]["path"])
    result = CliRunner().invoke(app, [*args, "--like", str(made), "--out", str(tmp_path / "b")])
    again = json.loads(result.stdout)["images"][0]
    assert again["negative_prompt"] == "a coat" and Path(again["path"]).read_bytes() == made.read_bytes()


@pytest.mark.parametrize(("value", "message"), [(3, "negative_prompt must be a name"),
                                                ("\ud800", "the negative prompt holds"),
                                                ("x" * 70_000, "the negative prompt is 70,000 characters")])
def test_a_bad_negative_prompt_is_refused(card, tmp_path, value, message):
    with pytest.raises(BadInput, match=message):
        card.generate("a bag", steps=1, negative_prompt=value, out=tmp_path / "x")
    assert not (tmp_path / "x").exists()
