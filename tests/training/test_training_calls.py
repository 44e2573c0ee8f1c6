"""`cardtool.train`, `distill`, `rl` and `flywheel`: each command as a Python call. The call makes the card its
command makes, bit for bit, and records the command line it equals — which, run, makes that card again; an argument
of a type the command line could not give is refused by name before any work."""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np
import pytest
from helpers import EXAMPLE_CARDS, REPO
from typer.testing import CliRunner

import cardtool
from cardtool.cli import app
from cardtool.core.cards.loader import load_card

JUDGES = {"judge": EXAMPLE_CARDS / "tiny-judge", "held_out_judge": ""}  # a path, and none as the option says it
CALLS = {
    "train": lambda: cardtool.train(REPO / "examples" / "recipes" / "fashion-bold.yaml",
                                    data=REPO / "examples" / "images",
                                    overrides=["parents=[tiny-base]", "data.transform=none", "model.adapter=mine",
                                               "card.id=tiny-mine", "optim.steps=1", "optim.batch_size=4"]),
    "distill": lambda: cardtool.distill("tiny-base", steps=np.int64(1), overrides="optim.steps=1", evaluate=False),
    "rl": lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["a bag", "a long coat"],
                              overrides=["optim.steps=1"], lora=2, evaluate=False),
    "flywheel": lambda: cardtool.flywheel("tiny-base", reward="tiny-judge", overrides=["rl.optim.steps=1"],
                                          stop_after="rl", **JUDGES),
}
# what the recorded command leaves out, as it does not shape the card: its eval, and the flywheel's later stages
NOT_RECORDED = {"distill": ["--no-eval"], "rl": ["--no-eval"],
                "flywheel": ["--stop-after", "rl", "--judge", "tiny-judge", "--held-out-judge", ""]}


def _weights(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*.safetensors"))}


@pytest.mark.parametrize("name", CALLS)
def test_a_call_makes_the_card_its_recorded_command_makes_again(tmp_path, monkeypatch, name):
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    (tmp_path / "call").mkdir()
    monkeypatch.chdir(tmp_path / "call")
    made = CALLS[name]()
    card = load_card(Path("cards") / made.stages[0]["card"]) if name == "flywheel" else made
    command = card.manifest.recipe.command
    assert command.startswith(f"cardtool {name} ") and "None" not in command, command
    if name == "rl":
        assert "--prompts - " in command and card.manifest.recipe.metrics["prompts"]["count"] == 2
    if name == "train":  # trained on the call's captioned images, not the default Fashion-MNIST
        assert card.manifest.recipe.data["dataset"] == "image-folder" and f"--data {REPO}" in command
    (tmp_path / "command").mkdir()
    monkeypatch.chdir(tmp_path / "command")
    again = CliRunner().invoke(app, [*shlex.split(command, comments=True)[1:], *NOT_RECORDED.get(name, [])],
                               input="a bag\na long coat\n")  # rl: `--prompts -` reads them from standard input
    assert again.exit_code == 0, again.output
    remade = load_card(tmp_path / "command" / "cards" / card.id)
    assert remade.manifest.recipe.command == command, "the command line recorded is the one the call equals"
    assert remade.manifest.recipe.fingerprint == card.manifest.recipe.fingerprint
    assert _weights(remade.folder) == _weights(card.folder) and _weights(card.folder), "the same card, bit for bit"


@pytest.mark.parametrize(("call", "message"), [
    (lambda: cardtool.distill(42), "teacher must be a card id or path, got 42"),
    (lambda: cardtool.distill("tiny-base", steps="2"), "steps must be a whole number (or None), got '2'"),
    (lambda: cardtool.distill("tiny-base", steps=True), "steps must be a whole number"),
    (lambda: cardtool.distill("tiny-base", overrides=[1]), "overrides must be KEY.PATH=VALUE strings, got 1"),
    (lambda: cardtool.distill("tiny-base", overrides={"optim.steps": 1}), "overrides must be a list of strings"),
    (lambda: cardtool.distill("tiny-base", evaluate="no"), "evaluate must be True or False, got 'no'"),
    (lambda: cardtool.distill("tiny-base", out=3), "out must be a path (or None), got 3"),
    (lambda: cardtool.distill("tiny-base", out="a\0b"), "out holds a NUL byte"),
    (lambda: cardtool.distill("tiny\0base"), "teacher holds a NUL byte"),
    (lambda: cardtool.distill("tiny-base", recipe=b"r.yaml"), "recipe must be a path (or None)"),
    (lambda: cardtool.distill("tiny-base", on_log="print"), "on_log must be a function (or None)"),
    (lambda: cardtool.distill("tiny-base", judge=["a"]), "judge must be a card id or path, got ['a']"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", held_out_judge=3), "held_out_judge must be a card id"),
    (lambda: cardtool.distill("tiny-base", command=b"x"), "command must be text"),
    (lambda: cardtool.rl("tiny-base", reward=None), "reward must be a card id or path, got None"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=[]), "prompts is empty"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["a bag\na coat"]), "one line of text"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["  "]), "one line of text"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["a \udcff"]), "lone surrogate"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=[b"a bag"]), "prompts must be strings"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["x" * 600] * 2000), "1 MiB"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", prompts=["a"], prompts_file="p.txt"), "not both"),
    (lambda: cardtool.rl("tiny-base", reward="tiny-judge", lora=1.5), "lora must be a whole number (or None)"),
    (lambda: cardtool.train(None), "recipe must be a path, got None"),
    (lambda: cardtool.train("", overrides=[]), "recipe must be a path, got ''"),
    (lambda: cardtool.train("r.yaml", micro_batches=None), "micro_batches must be a whole number, got None"),
    (lambda: cardtool.flywheel("tiny-base", reward="tiny-judge", compare=[1]), "compare must be a card id or path"),
    (lambda: cardtool.flywheel("tiny-base", reward="tiny-judge", out_dir=None), "out_dir must be a path"),
    (lambda: cardtool.flywheel("tiny-base", reward="tiny-judge", stop_after=1), "stop_after must be text"),
])
def test_an_argument_of_the_wrong_type_is_refused_by_name_before_any_work(tmp_path, monkeypatch, call, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cardtool.BadInput) as refused:
        call()
    assert message in str(refused.value)
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_the_calls_check_values_as_their_commands_do(tmp_path, monkeypatch):
    """Past the types, the values meet the commands' own checks: the same messages, still before any work."""
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    monkeypatch.chdir(tmp_path)
    for call, message in [(lambda: cardtool.distill("tiny-base", steps=0), "--steps"),
                          (lambda: cardtool.rl("tiny-base", reward="tiny-judge", lora=0), "--lora must be"),
                          (lambda: cardtool.rl("tiny-base", reward="tiny-judge", method="ppo"), "unknown rl method"),
                          (lambda: cardtool.distill("no-such-card"), "no-such-card"),
                          (lambda: cardtool.flywheel("tiny-base", reward="tiny-judge", stop_after="eval2"),
                           "--stop-after must be one of"),
                          (lambda: cardtool.distill("tiny-base", out="x" * 5000, evaluate=False),
                           "File name too long")]:
        with pytest.raises(cardtool.BadInput, match=message):
            call()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", CALLS)
def test_a_call_without_an_option_does_what_its_command_without_it_does(name):
    """Each keyword's default is its option's: a call and its command differ only in what they are given."""
    import inspect

    from cardtool.cli import distill, flywheel, rl, train

    command = {"train": train.train_command, "distill": distill.distill_command, "rl": rl.rl_command,
               "flywheel": flywheel.flywheel_command}[name]
    options = inspect.signature(command).parameters
    keywords = inspect.signature(getattr(cardtool, name)).parameters
    shared = set(options) & set(keywords) - {"overrides", "compare", "prompts"}  # lists: None there, () here
    assert len(shared) >= 6, shared
    for option in shared:
        assert keywords[option].default == options[option].default, option
    assert all(keywords[k].default in ((), None) for k in {"overrides", "compare"} & set(keywords))


def test_prompts_given_as_a_list_are_held_to_a_prompts_files_bound(tmp_path, monkeypatch):
    """At most 1 MiB as a file would hold them, a line each: exactly that passes on (to the next check here)."""
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    exactly = ["x" * 1023] * 1024  # 1,024 lines of 1,023 bytes and a newline
    with pytest.raises(cardtool.BadInput, match="unknown rl method"):
        cardtool.rl("tiny-base", reward="tiny-judge", prompts=exactly, method="ppo")
    with pytest.raises(cardtool.BadInput, match="more than 1 MiB"):
        cardtool.rl("tiny-base", reward="tiny-judge", prompts=[*exactly[:-1], "x" * 1024], method="ppo")
