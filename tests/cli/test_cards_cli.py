"""`cardtool cards …` for people and scripts: output, JSON shapes and exit codes (0 ok, 1 invalid, 2 bad input)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import REPO
from typer.testing import CliRunner

from cardtool import __version__
from cardtool.cli import app


def run(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def on_path(examples, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return examples


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and result.stdout.strip() == f"cardtool {__version__}"


def test_no_arguments_show_the_commands():
    result = run()
    assert "Usage: cardtool" in result.output and all(c in result.output for c in ("generate", "distill", "cards"))
    assert "--install-completion" not in result.output, "no shell-completion options: the tool stays light"


def test_list_json_shape(on_path):
    result = run("cards", "list", "--json")
    assert result.exit_code == 0
    cards = json.loads(result.stdout)["cards"]
    assert [c["id"] for c in cards] == ["tiny-base", "tiny-distilled", "tiny-judge", "tiny-rl"]
    assert set(cards[0]) == {"id", "path", "origin", "method", "description", "valid", "problems"}
    assert cards[1]["method"] == "dmd2" and cards[1]["origin"] == "CARDTOOL_PATH" and cards[1]["valid"]


def test_list_table(on_path):
    result = run("cards", "list")
    assert result.exit_code == 0
    assert "tiny-distilled" in result.stdout and "dmd2" in result.stdout


@pytest.mark.parametrize("args", [["list"], ["show", "tiny-rl"], ["diff", "tiny-base", "tiny-rl"]])
def test_piped_tables_end_their_lines_where_their_text_ends(on_path, args):
    """Off a terminal the console is 160 columns wide; Rich pads a table's lines to its width, which a pipe or a
    log must not get."""
    result = run("cards", *args)
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and len(lines) > 3 and "tiny-rl" in result.stdout
    assert [line for line in lines if line.endswith(" ")] == [], result.stdout


@pytest.mark.parametrize("args", [["list"], ["show", "tiny-rl"], ["validate", "tiny-rl"], ["lineage", "tiny-rl"],
                                  ["diff", "tiny-base", "tiny-rl"]])
def test_without_json_a_cards_command_writes_for_people(on_path, args):
    result = run("cards", *args)
    assert result.exit_code == 0 and "tiny-rl" in result.stdout, result.output
    with pytest.raises(json.JSONDecodeError):
        json.loads(result.stdout)


@pytest.mark.parametrize("columns", ["0", "-3", "wide", "7"])
def test_a_columns_that_is_no_width_still_shows_the_table(on_path, columns):
    result = CliRunner().invoke(app, ["cards", "list"], env={"COLUMNS": columns})  # Rich drew nothing at 0
    assert result.exit_code == 0 and "tiny-distilled" in result.stdout


def test_what_a_card_records_is_shown_as_written_brackets_and_all(on_path):
    """A recorded command such as `--set parents=[tiny-base]` lost its brackets' text to Rich's markup."""
    folder = on_path / "tiny-mine"
    folder.mkdir()
    command = "cardtool train --recipe r.yaml --set parents=[tiny-base] --set model.adapter=[bold]"
    (folder / "card.yaml").write_text(
        "schema: cardtool/v1\nid: tiny-mine\nextends: tiny-base\nrecipe:\n  method: finetune\n"
        f"  parents: [tiny-base]\n  command: {json.dumps(command)}\n  metrics: {{note: '[red]x'}}\n")
    shown = CliRunner().invoke(app, ["cards", "show", "tiny-mine"], env={"COLUMNS": "1000"})
    assert shown.exit_code == 0, shown.output
    assert f"made by: {command}" in shown.stdout and "note=[red]x" in shown.stdout, shown.stdout
    lineage = CliRunner().invoke(app, ["cards", "lineage", "tiny-mine"], env={"COLUMNS": "1000"})
    assert lineage.stdout.splitlines()[-1] == "tiny-base (pretrain) → tiny-mine (finetune)", lineage.output
    odd = on_path.parent / "[bold]runs" / "tiny-mine"  # a folder named with brackets: `cards validate` printed "runs/…"
    shutil.copytree(folder, odd)
    (odd.parent / "bad").mkdir()
    (odd.parent / "bad" / "card.yaml").write_text("schema: cardtool/v1\nid: bad\n")
    checked = CliRunner().invoke(app, ["cards", "validate", str(odd), str(odd.parent / "bad")], env={"COLUMNS": "1000"})
    assert "[bold]runs/tiny-mine)" in checked.stdout and "invalid [bold]runs/bad" in checked.stdout, checked.output


def test_the_summaries_for_people_name_the_base_an_adapter_card_is_made_on(on_path, tmp_path):
    wide = {"COLUMNS": "1000"}
    extracted = CliRunner().invoke(app, ["cards", "extract-lora", "tiny-base", "tiny-rl", "--rank", "2", "--id",
                                         "tiny-e", "--out", str(tmp_path / "tiny-e")], env=wide)
    assert extracted.exit_code == 0 and "LoRA 'tiny-rl' (rank 2, " in extracted.stdout, extracted.output
    assert " layers) on tiny-base; it keeps " in extracted.stdout
    composed = CliRunner().invoke(app, ["cards", "compose", "tiny-base", str(tmp_path / "tiny-e"), "--id", "tiny-c",
                                        "--out", str(tmp_path / "tiny-c")], env=wide)
    assert composed.exit_code == 0, composed.output
    assert composed.stdout.rstrip().endswith(": invert, tiny-rl on tiny-base"), composed.stdout


def test_show_json_has_the_resolved_manifest(on_path):
    result = run("cards", "show", "tiny-distilled", "--json")
    assert result.exit_code == 0
    shown = json.loads(result.stdout)
    assert shown["id"] == "tiny-distilled" and shown["manifest"].endswith("tiny-distilled/card.yaml")
    assert shown["card"]["components"]["vae"]["weights"] == "../tiny-base/vae.safetensors"
    assert shown["card"]["recipe"]["assumes"]["steps"] == 4


def test_show_for_people_escapes_brackets(on_path):
    result = run("cards", "show", "tiny-rl")
    assert result.exit_code == 0
    assert "parents=[tiny-base]" in result.stdout and "diffusion_nft" in result.stdout


def test_show_for_people_lists_loops_adapters_and_what_made_the_card(on_path):
    wide = {"COLUMNS": "250"}  # each table row on one line
    base = CliRunner().invoke(app, ["cards", "show", "tiny-base"], env=wide)
    assert base.exit_code == 0 and "\nloops" in base.stdout and "\nadapters" in base.stdout
    assert "steps=30, guidance=4.0, shift=1.0, solver=euler" in base.stdout and "rank 4, alpha 4" in base.stdout
    assert "made by:" not in base.stdout and "metrics:" not in base.stdout
    manifest = on_path / "tiny-judge" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("recipe:\n", "recipe:\n  command: cardtool train --recipe j.yaml"
                                                     "\n  metrics: {test_accuracy: 0.5}\n"))
    judge = CliRunner().invoke(app, ["cards", "show", "tiny-judge"], env=wide)
    assert judge.exit_code == 0 and "\nloops" not in judge.stdout and "\nadapters" not in judge.stdout
    assert "made by: cardtool train --recipe j.yaml\nmetrics: test_accuracy=0.5\n" in judge.stdout


def test_show_unknown_card_is_bad_input():
    result = run("cards", "show", "nope")
    assert result.exit_code == 2
    assert "no card with id 'nope'" in result.stderr and "Traceback" not in result.output


def test_show_unknown_card_json_error_document():
    result = run("cards", "show", "nope", "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["kind"] == "bad_input"


@pytest.mark.parametrize(("args", "message"), [
    (("generate", "tiny-base", "--steps", "x", "--json"), "'x' is not a valid integer"),
    (("cards", "show", "--json"), "Missing argument 'CARD'"),
    (("cards", "list", "--json", "--bogus"), "No such option: --bogus"),
    (("bogus", "--json"), "No such command 'bogus'"),
    (("workflow", "validate", "a\x00b", "--json"), "an argument holds a NUL byte"),  # as only a caller passes one
])
def test_usage_errors_under_json_print_the_error_document(args, message):
    """Click's own usage errors (a value of the wrong type, a missing argument) happen before any command code
    runs; a script reading stdout under --json still gets one document, and people the usual message."""
    result = run(*args)
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "bad_input" and message in error["message"]
    assert message in result.stderr


def test_usage_error_without_json_prints_no_document():
    result = run("cards", "show")
    assert result.exit_code == 2 and result.stdout == "" and "Missing argument 'CARD'" in result.stderr


def test_show_invalid_card_exits_1_with_located_problems(examples):
    bad = examples / "tiny-base" / "card.yaml"
    bad.write_text(bad.read_text().replace("frozen: true", "frozen: yes please"))
    result = run("cards", "show", str(examples / "tiny-base"))
    assert result.exit_code == 1
    assert "card.yaml:13:13: components.text_encoder.frozen: Input should be a valid boolean" in result.stderr


def test_validate_ok_and_with_checksums(examples):
    result = run("cards", "validate", "--checksums", str(examples), "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["ok"] and report["checksums"] and len(report["results"]) == 4


def test_validate_catches_a_changed_weight_file_only_with_checksums(examples):
    (examples / "tiny-rl" / "transformer.safetensors").write_bytes(
        (examples / "tiny-distilled" / "transformer.safetensors").read_bytes())
    plain = run("cards", "validate", str(examples / "tiny-rl"))
    assert plain.exit_code == 0 and plain.stdout.startswith("ok      tiny-rl  (") and "invalid" not in plain.stdout
    checked = CliRunner().invoke(app, ["cards", "validate", "--checksums", str(examples / "tiny-rl")],
                                 env={"COLUMNS": "1000"})  # the path on one line
    assert checked.exit_code == 1 and checked.stdout.startswith("invalid ") and "tiny-rl" in checked.stdout
    assert "components.transformer.sha256" in checked.stderr
    result = run("cards", "validate", "--checksums", str(examples / "tiny-rl"), "--json")
    assert result.exit_code == 1
    [found] = json.loads(result.stdout)["results"]
    [problem] = found["problems"]
    assert (problem["line"], problem["field"]) == (10, "components.transformer.sha256")
    assert (found["id"], found["valid"]) == ("tiny-rl", False), "the invalid card is named by the id it declares"


def test_validating_a_folder_of_cards_skips_a_killed_runs_hidden_staging_copy(examples):
    """`.ID.tmp-PID` (a card being written when its run was killed) is no card on the search roots; validating the
    folder holding it failed for its missing weights, or found the card's id twice. Named itself, it is validated."""
    staging = examples / ".tiny-base.tmp-1234"
    shutil.copytree(examples / "tiny-base", staging)
    (staging / "vae.safetensors").unlink()
    result = run("cards", "validate", str(examples), "--json")
    assert result.exit_code == 0 and len(json.loads(result.stdout)["results"]) == 4, result.stdout
    assert run("cards", "validate", str(staging)).exit_code == 1


def test_validate_missing_path_is_bad_input():
    result = run("cards", "validate", "nowhere")
    assert result.exit_code == 2 and "no card with id 'nowhere'" in result.stderr


def test_validate_without_paths_is_a_usage_error():
    assert run("cards", "validate").exit_code == 2


def test_lineage_prints_the_chain(on_path):
    result = run("cards", "lineage", "tiny-distilled")
    assert result.exit_code == 0
    assert "tiny-base (pretrain) → tiny-rl (diffusion_nft) → tiny-distilled (dmd2)" in result.stdout
    root = run("cards", "lineage", "tiny-base")
    assert root.exit_code == 0 and root.stdout == "tiny-base (pretrain)\n", "a root alone: no chain to print"


def test_lineage_json_and_missing_parent_exit_1(on_path):
    rl = on_path / "tiny-rl" / "card.toml"
    rl.write_text(rl.read_text().replace('parents = ["tiny-base"]', 'parents = ["lost-base"]'))
    tree = run("cards", "lineage", "tiny-distilled")
    assert tree.exit_code == 1 and "lost-base (missing)" in tree.stdout and "lost-base (None" not in tree.stdout
    result = run("cards", "lineage", "tiny-distilled", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["complete"] is False
    assert report["lineage"]["parents"][0]["parents"][0] == {"id": "lost-base", "method": None, "path": None,
                                                             "missing": True, "recorded": False, "repeated": False,
                                                             "parents": []}


def test_an_ascii_only_stdout_gets_escapes_not_a_traceback(examples, tmp_path):
    """PYTHONIOENCODING=ascii: the lineage's arrows and a prompt's é are escaped for people and JSON stays valid."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONIOENCODING": "ascii", "CARDTOOL_PATH": str(examples)}

    def cardtool(*args):
        return subprocess.run([sys.executable, "-m", "cardtool", *args], capture_output=True, text=True, env=env,
                              timeout=120, encoding="ascii", errors="strict")

    lineage = cardtool("cards", "lineage", "tiny-distilled")
    assert lineage.returncode == 0 and "tiny-base (pretrain) \\u2192 tiny-rl" in lineage.stdout, lineage.stderr
    made = cardtool("generate", "tiny-base", "-p", "café ☕", "--steps", "1", "--out", str(tmp_path), "--json")
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["images"][0]["prompt"] == "café ☕"
    missing = cardtool("cards", "show", "no-such-é")
    assert missing.returncode == 2 and "no-such-\\xe9" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("out", ["-", "./-"])
def test_out_dash_is_no_folder_of_any_command_and_one_named_so_is_given_by_its_whole_path(on_path, tmp_path, out):
    """`--out -` made a card folder named '-' (merge, extract-lora, export, train …) while generate, eval and workflow
    refused it, advising './-' — which a path makes '-' again. Every command refuses it and names the whole path."""
    whole = f"{tmp_path / '-'} for one named '-'"
    commands = [["cards", "merge", "tiny-base", "tiny-rl", "--id", "tiny-m"],
                ["cards", "extract-lora", "tiny-base", "tiny-rl", "--rank", "2", "--id", "tiny-e"],
                ["cards", "export", "tiny-base", "--format", "hf"],
                ["distill", "tiny-base", "--no-eval", "--set", "optim.steps=1"],
                ["generate", "tiny-base", "-p", "a bag", "--steps", "1"],
                ["eval", "tiny-base", "--judge", "tiny-judge", "--per-class", "1"],
                ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml")]]
    for command in commands:
        result = run(*command, "--out", out, "--json")
        message = json.loads(result.stdout)["error"]["message"]
        assert result.exit_code == 2 and message.startswith("--out -: ") and whole in message, (command, message)
    assert not (tmp_path / "-").exists() and not (tmp_path / "runs").exists()
    made = run("cards", "merge", "tiny-base", "tiny-rl", "--id", "tiny-m", "--out", str(tmp_path / "-"))
    assert made.exit_code == 0 and (tmp_path / "-" / "card.yaml").is_file(), made.output


@pytest.mark.parametrize("out", ["-", "./-"])
def test_run_dir_dash_and_the_flywheels_out_dir_dash_are_refused_too(on_path, tmp_path, out):
    """`--run-dir -` and flywheel's `--out-dir -` made folders named '-', unlike every `--out -`."""
    whole = f"{tmp_path / '-'} for one named '-'"
    small = ["--set", "optim.steps=1", "--set", "optim.batch_size=2"]
    rl = ["--reward", "tiny-judge", "--set", "loss.group_size=4"]
    flywheel = ["flywheel", "tiny-base", *rl[:2], "--judge", "tiny-judge", "--held-out-judge", "", "--stop-after", "rl",
                "--set", "rl.optim.steps=1"]
    commands = [(["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-vae.yaml"), "--set", "card.id=v",
                  "--out", str(tmp_path / "v"), *small], "--run-dir"),
                (["distill", "tiny-base", "--no-eval", *small], "--run-dir"),
                (["rl", "tiny-base", "--no-eval", *rl, *small], "--run-dir"),
                (flywheel, "--run-dir"), (flywheel, "--out-dir")]
    for command, option in commands:
        result = run(*command, option, out, "--json")
        message = json.loads(result.stdout)["error"]["message"]
        assert result.exit_code == 2 and message.startswith(f"{option} -: ") and whole in message, (command, message)
    assert not (tmp_path / "-").exists() and not (tmp_path / "runs").exists()


def test_an_image_or_weights_given_where_a_manifest_is_read_is_named_as_such(on_path, tmp_path):
    """A PNG given as the card (meant for --like?) said "not UTF-8 text … save it as UTF-8"."""
    made = run("generate", "tiny-base", "-p", "a bag", "--steps", "1", "--out", str(tmp_path / "bag.png"))
    assert made.exit_code == 0, made.output
    for command in (["generate", str(tmp_path / "bag.png"), "-p", "x"], ["workflow", "run", str(tmp_path / "bag.png")],
                    ["cards", "validate", str(tmp_path / "bag.png")]):
        result = run(*command)
        assert result.exit_code in (1, 2) and "not a YAML or TOML file: it is a PNG image" in result.output and \
            "generate --like IMAGE" in result.output, (command, result.output)
    result = run("cards", "show", str(on_path / "tiny-base" / "transformer.safetensors"))
    assert result.exit_code in (1, 2) and "it is safetensors weights" in result.output, result.output
    (tmp_path / "latin1.yaml").write_bytes("id: caf\xe9\n".encode("latin-1"))
    result = run("cards", "validate", str(tmp_path / "latin1.yaml"))
    assert result.exit_code == 1 and "not UTF-8 text" in result.output and "save it as UTF-8" in result.output


def test_cards_list_says_which_roots_it_could_not_search(tmp_path, monkeypatch):
    """A mistyped CARDTOOL_PATH entry, or another user's folder, listed nothing in silence: the cards expected from it
    were simply missing."""
    import errno
    import os

    closed = tmp_path / "closed"
    closed.mkdir()
    monkeypatch.setenv("CARDTOOL_PATH", os.pathsep.join([str(tmp_path / "typo"), str(closed)]))
    listing = os.scandir

    def private(path, *args):
        if str(path) == str(closed):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return listing(path, *args)

    monkeypatch.setattr(os, "scandir", private)
    result = CliRunner().invoke(app, ["cards", "list", "--json"])
    assert result.exit_code == 0 and "cards" in json.loads(result.stdout)
    assert "warning searched nothing in typo (CARDTOOL_PATH: no such folder)\n" in result.stderr, result.stderr
    assert "warning searched nothing in closed (CARDTOOL_PATH: cannot be read, Permission denied)\n" in result.stderr
    monkeypatch.delenv("CARDTOOL_PATH")
    assert "searched nothing" not in CliRunner().invoke(app, ["cards", "list"]).stderr  # no ./cards here: no warning
