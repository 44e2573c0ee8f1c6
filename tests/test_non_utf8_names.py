"""A Linux file name may hold any byte; the command line hands a byte that is not UTF-8 over as U+DC80–U+DCFF.
Cards in such folders load, and every command that writes a card or a checkpoint there writes it (safetensors
itself takes UTF-8 paths only), recording a command line a shell runs again to the same bytes."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLE_CARDS
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.training.trainer import checkpoint_metadata
from cardtool.shell_words import shell_join

torch.set_num_threads(1)


def named(folder, name: bytes) -> str:
    return os.fsdecode(os.fsencode(folder) + b"/" + name)


def run(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("word", ["plain", "a b", "it's", "", "café", "caf\udce9", "a\x1b[31mb", "two\nlines",
                                  "back\\slash 'q' \udcff\udc80", "tab\there", "zero\u200bwidth", "-", "$HOME"])
def test_a_recorded_command_reads_back_in_a_shell_as_the_same_bytes(word):
    joined = shell_join(["printf", "%s\\0", word, "x"])
    if word.isprintable() and "\udce9" not in word:
        assert joined == shlex.join(["printf", "%s\\0", word, "x"]), "as shlex writes it where it can"
    assert joined.isprintable(), "what a manifest can hold: no control character, no lone surrogate"
    out = subprocess.run(["bash", "-c", joined], capture_output=True, check=True, timeout=30).stdout
    assert out == os.fsencode(word) + b"\0x\0"


def test_cards_in_a_folder_whose_name_is_not_utf8(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    tuned = named(tmp_path, b"rl-caf\xe9")
    shutil.copytree(EXAMPLE_CARDS / "tiny-rl", tuned)
    assert run("cards", "validate", tuned, "--checksums")["ok"]
    image = run("generate", tuned, "-p", "a bag", "--steps", "1", "--out", named(tmp_path, b"out\xff"))["images"][0]
    assert "out\\udcff" in image["path"]
    merged = run("cards", "merge", "tiny-base", tuned, "--id", "soup", "--out", named(tmp_path, b"soup\xe9"))
    assert merged["merged"] == ["transformer"]
    assert load_card(named(tmp_path, b"soup\xe9")).manifest.recipe.command == \
        f"cardtool cards merge tiny-base $'{tmp_path}/rl-caf\\xe9' --id soup"
    run("cards", "extract-lora", "tiny-base", tuned, "--rank", "2", "--id", "lora", "--out", named(tmp_path, b"l\xe9"))
    run("cards", "export", tuned, "--out", named(tmp_path, b"hf\xe9"))
    back = named(tmp_path, b"back\xe9")
    run("cards", "import", named(tmp_path, b"hf\xe9"), "--base", "tiny-base", "--id", "back", "--out", back)
    for card in (named(tmp_path, b"soup\xe9"), named(tmp_path, b"l\xe9"), back):
        assert run("generate", card, "-p", "a bag", "--steps", "1", "--out", "o")["images"], card


def test_a_run_in_a_folder_whose_name_is_not_utf8_writes_its_checkpoint_and_card(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    (tmp_path / "prompts.txt").write_text("a bag\n")
    run_dir, out = named(tmp_path, b"run\xe9"), named(tmp_path, b"card\xe9")
    args = ["rl", "tiny-base", "--reward", "tiny-judge", "--prompts-file", "prompts.txt", "--set", "optim.steps=1",
            "--no-eval", "--run-dir", run_dir]
    monkeypatch.setattr("sys.argv", ["cardtool", *args, "--out", out])  # the command as typed: what a card records
    run(*args, "--out", out)
    assert checkpoint_metadata(Path(run_dir) / "checkpoint.safetensors")["step"] == "1"
    card = load_card(out)
    assert card.manifest.recipe.command.endswith("--run-dir $'" + f"{tmp_path}/run\\xe9' --out $'{tmp_path}/card\\xe9'")


def test_a_card_extending_one_whose_folder_name_is_not_utf8_is_refused_before_the_work(tmp_path, monkeypatch):
    """A manifest names the card it extends by id where it can, else by a relative path — which, through a folder
    named with bytes that are not UTF-8, no manifest (UTF-8 text) holds: the card was refused at its write, after
    the training. Now each command refuses before its work and writes nothing; a card written beside its parent
    names it by id, and is made."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(EXAMPLE_CARDS))
    folder = named(tmp_path, b"caf\xe9")
    base, tuned = f"{folder}/tiny-base", f"{folder}/tiny-rl"
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", base)
    shutil.copytree(EXAMPLE_CARDS / "tiny-rl", tuned)
    quick = ["--set", "optim.steps=1", "--set", "optim.batch_size=4", "--set", "train.precision=float32"]
    commands = {
        "distill": ["distill", base, "--steps", "2", *quick, "--no-eval", "--run-dir", "runs"],
        "rl": ["rl", base, "--reward", "tiny-judge", *quick, "--no-eval", "--run-dir", "runs"],
        "flywheel": ["flywheel", base, "--reward", "tiny-judge", "--judge", "tiny-judge", "--held-out-judge", "",
                     "--stop-after", "distill", "--run-dir", "runs", "--out-dir", "cards"],
        "extract-lora": ["cards", "extract-lora", base, tuned, "--rank", "2", "--id", "lora"],
        "merge": ["cards", "merge", base, tuned, "--id", "soup"],
    }
    for name, args in commands.items():
        result = CliRunner().invoke(app, [*args, *(["--out", "new"] if name != "flywheel" else []), "--json"])
        assert result.exit_code == 2, (name, result.output)
        said = json.loads(result.stdout)["error"]["message"]
        assert said.startswith("the new card extends 'tiny-base', which its manifest names by the path '../") and \
            "caf\\udce9/tiny-base', and a manifest (UTF-8 text) cannot hold it" in said, (name, said)
        assert sorted(os.listdir(tmp_path)) == [os.fsdecode(b"caf\xe9")], (name, "nothing written")
    student = run("distill", base, "--steps", "2", *quick, "--no-eval", "--run-dir", "runs", "--out",
                  f"{folder}/student")
    assert student["extends"] == "tiny-base", "beside its parent: named by id"
    assert run("generate", f"{folder}/student", "-p", "a bag", "--out", "o.png")["images"]


def test_a_card_whose_parent_is_found_by_id_in_a_folder_whose_name_is_not_utf8_loads_and_runs(tmp_path, monkeypatch):
    """The parent on CARDTOOL_PATH in such a folder, the new card beside the working folder: `extends` names it by id,
    and the inherited weights' paths, rebased from the parent's folder, hold the byte — refused by the manifest's
    text fields, so the student trained and then failed to load. Taken as the file names they are."""
    monkeypatch.chdir(tmp_path)
    folder = named(tmp_path, b"caf\xe9")
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", f"{folder}/tiny-base")
    monkeypatch.setenv("CARDTOOL_PATH", f"{folder}{os.pathsep}{EXAMPLE_CARDS / 'tiny-judge'}")
    made = run("distill", "tiny-base", "--steps", "2", "--set", "optim.steps=1", "--set", "optim.batch_size=4",
               "--set", "train.precision=float32", "--no-eval", "--run-dir", "runs", "--out", "student")
    assert made["extends"] == "tiny-base"
    student = load_card("student")
    assert student.manifest.components["vae"].weights == os.fsdecode(b"../caf\xe9/tiny-base/vae.safetensors")
    assert run("cards", "validate", "student", "--checksums")["ok"]
    assert run("generate", "student", "-p", "a bag", "--out", "o.png")["images"]
    shown = run("cards", "show", "student")
    assert shown["card"]["components"]["vae"]["weights"] == "../caf\\udce9/tiny-base/vae.safetensors"
    assert run("cards", "export", "student", "--out", "hf")["files"]
