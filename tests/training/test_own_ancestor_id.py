"""A new card may not take the id of a card in its own lineage (its parent's, or one its parent descends from): the
card would descend from itself and a lookup of the id beside it would find two cards. Every command that makes a
card refuses such an id before its work (exit 2), not with an invalid card after hours of training."""

from __future__ import annotations

import json

import pytest
from helpers import REPO
from typer.testing import CliRunner

from cardtool.cli import app


def commands(ex, out):
    return {
        "train": ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-base.yaml"), "--set",
                  f"parents=[{ex / 'tiny-base'}]", "--set", "method=finetune", "--set", "card.id=tiny-base",
                  "--out", str(out)],
        "distill": ["distill", str(ex / "tiny-rl"), "--steps", "1", "--set", "card.id=tiny-base", "--out", str(out)],
        "rl": ["rl", str(ex / "tiny-base"), "--reward", str(ex / "tiny-judge"), "--set", "card.id=tiny-judge",
               "--out", str(out)],
        "flywheel": ["flywheel", str(ex / "tiny-rl"), "--reward", str(ex / "tiny-judge"), "--set",
                     "distill.card.id=tiny-base", "--judge", str(ex / "tiny-judge"), "--held-out-judge", "",
                     "--out-dir", str(out)],
        "import": ["cards", "import", str(out.parent / "hf" / "transformer"), "--base", str(ex / "tiny-base"),
                   "--id", "tiny-base", "--out", str(out)],
    }


@pytest.mark.parametrize("command", ["train", "distill", "rl", "flywheel", "import"])
def test_a_card_id_from_its_own_lineage_is_refused_before_the_work(examples, tmp_path, command):
    from cardtool.core.cards.export import export_card

    if command == "import":
        export_card(str(examples / "tiny-base"), tmp_path / "hf")
    out = tmp_path / "out"
    run_dir = ["--run-dir", str(tmp_path / "run")] if command != "import" else []
    result = CliRunner().invoke(app, [*commands(examples, out)[command], *run_dir, "--json"])
    assert result.exit_code == 2, result.output
    message = json.loads(result.stdout)["error"]["message"]
    assert "the new card would descend from itself" in message, message
    assert not out.exists() and not (tmp_path / "run").exists(), "refused before any work"


def test_compose_refuses_the_id_of_the_base_it_extends(tmp_path):
    result = CliRunner().invoke(app, ["cards", "compose", str(REPO / "cards" / "fashion-base"),
                                      str(REPO / "cards" / "fashion-mirror"), "--id", "fashion-base", "--out",
                                      str(tmp_path / "served"), "--json"])
    assert result.exit_code == 2 and "is its parent's" in json.loads(result.stdout)["error"]["message"]
    assert not (tmp_path / "served").exists()
