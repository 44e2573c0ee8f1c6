"""The training commands, `generate` and `workflow run` state no default of their own that could drift from the
Python API's: run with no options but the ones they require, each hands its API function that function's own defaults
(eval's: test_evaluate_input)."""

from __future__ import annotations

import importlib
import inspect
import json

import pytest
from helpers import REPO
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.errors import BadInput

CASES = {  # the command line, the module the command imports its function from, the function
    "flywheel": (["flywheel", "{examples}/tiny-base", "--reward", "{examples}/tiny-judge"],
                 "cardtool.core.workflows.flywheel", "flywheel"),
    "distill": (["distill", "{examples}/tiny-base"], "cardtool.core.training.distill", "distill"),
    "rl": (["rl", "{examples}/tiny-base", "--reward", "{examples}/tiny-judge"], "cardtool.core.training.rl", "rl"),
    "train": (["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-vae.yaml")],
              "cardtool.core.training.train", "train"),
}
DERIVED = {"command", "watch_judges"}  # what the command works out from its options, not a default of its own


@pytest.mark.parametrize("name", CASES)
def test_a_command_with_no_options_passes_its_apis_defaults(examples, monkeypatch, name):
    args, module_name, function = CASES[name]
    module = importlib.import_module(module_name)
    signature, passed = inspect.signature(getattr(module, function)), {}

    def capture(*positional, **options):
        passed.update(options)
        raise BadInput("captured")

    monkeypatch.setattr(module, function, capture)
    result = CliRunner().invoke(app, [*(a.format(examples=examples) for a in args), "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["message"] == "captured", result.output
    defaults = {key: p.default for key, p in signature.parameters.items()
                if p.default is not inspect.Parameter.empty and key in passed and key not in DERIVED
                and not key.startswith("on_")}
    assert {"device", "resume", "micro_batches", "data", "run_dir"} <= set(defaults), "what every one of them takes"

    def plain(value):  # the command's [] for the API's ()
        return list(value) if isinstance(value, tuple) else value

    assert {key: plain(passed[key]) for key in defaults} == {key: plain(v) for key, v in defaults.items()}


def test_generate_with_only_a_card_and_a_prompt_passes_the_apis_defaults(examples, monkeypatch):
    from cardtool.core.sampling import generate as module

    api = {**inspect.signature(module.LoadedCard.generate).parameters, **inspect.signature(module.generate).parameters}
    passed = {}

    def capture(card, prompts, **options):
        passed.update(options)
        raise BadInput("captured")

    monkeypatch.setattr(module, "generate", capture)
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "a bag", "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["message"] == "captured", result.output
    defaults = {key: api[key].default for key in passed if not key.startswith("on_")}
    assert {"skip_existing", "max_batch", "out", "seed", "best_of", "fuse", "grid", "strict"} <= set(defaults)
    assert {key: str(v) if key == "out" else v for key, v in passed.items() if key in defaults} == defaults


def test_workflow_run_with_only_a_file_passes_the_apis_defaults(monkeypatch):
    from cardtool.core.workflows import run as module

    api = inspect.signature(module.run_workflow).parameters
    passed = {}

    def capture(workflow, **options):
        passed.update(options)
        raise BadInput("captured")

    monkeypatch.setattr(module, "run_workflow", capture)
    tour = REPO / "examples" / "workflows" / "tiny-tour.yaml"
    result = CliRunner().invoke(app, ["workflow", "run", str(tour), "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout)["error"]["message"] == "captured", result.output
    defaults = {key: api[key].default for key in passed if not key.startswith("on_")}
    assert {"max_batch", "skip_existing", "out", "device"} <= set(defaults)
    assert {key: str(v) if key == "out" else v for key, v in passed.items() if key in defaults} == defaults


def test_no_command_replaces_resumes_records_or_prints_json_unless_asked():
    """Every on/off option is off by default — replacing a folder, resuming, recording into a card, --json … —
    except `--eval` (rl and distill evaluate the card they write unless --no-eval)."""
    import typer.main

    flags = {}

    def walk(command, path):
        for param in command.params:
            if getattr(param, "is_flag", False):
                flags[(path, param.name)] = param.default
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(typer.main.get_command(app), "")
    assert {key for key, on in flags.items() if on} == {("distill", "evaluate"), ("rl", "evaluate")}
    assert len(flags) > 40 and {name for _, name in flags} >= {"json_", "overwrite", "force", "resume", "record"}
