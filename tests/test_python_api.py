"""The Python API at the package's top level: the names resolve to the modules' own objects, importing cardtool
stays light, and examples/python_api.py runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO
from PIL import Image

import cardtool


def test_the_api_names_are_the_modules_own_objects():
    from cardtool.core.cards.loader import load_card
    from cardtool.core.evaluation.evaluate import evaluate
    from cardtool.core.evaluation.versus import compare
    from cardtool.core.sampling.generate import LoadedCard, generate
    from cardtool.core.training import calls
    from cardtool.core.workflows.run import run_workflow
    from cardtool.errors import BadInput, CardtoolError, CardValidationError, RunFailed

    assert (cardtool.LoadedCard, cardtool.generate, cardtool.evaluate, cardtool.compare, cardtool.load_card,
            cardtool.run_workflow) == (LoadedCard, generate, evaluate, compare, load_card, run_workflow)
    assert (cardtool.train, cardtool.distill, cardtool.rl, cardtool.flywheel) == (
        calls.train, calls.distill, calls.rl, calls.flywheel)
    from cardtool.core.cards import calls as card_calls

    names = card_calls.__all__
    assert [getattr(cardtool, name) for name in names] == [getattr(card_calls, name) for name in names]
    assert all(issubclass(e, CardtoolError) for e in (BadInput, CardValidationError, RunFailed))
    assert cardtool.BadInput is BadInput and set(cardtool.__all__) <= set(dir(cardtool))
    from cardtool.core.evaluation.parity_report import parity

    assert cardtool.parity is parity
    with pytest.raises(AttributeError, match="no attribute 'generator'"):
        cardtool.generator  # noqa: B018


def test_importing_cardtool_and_loading_a_card_import_no_torch():
    probe = ("import sys, cardtool; cardtool.load_card(sys.argv[1]); "
             "print([m for m in ('torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe, str(REPO / "examples" / "cards" / "tiny-base")],
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_the_python_api_example_runs(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "examples" / "python_api.py"), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    records = [json.loads(line) for line in lines[:-4]]
    assert json.loads(lines[-4]) == {"from_image": "0.6", "shape": [28, 28]}
    assert [(r["prompt"], r["seed"]) for r in records] == [("a sneaker", "0"), ("a sneaker", "1"), ("a bag", "0"),
                                                           ("a bag", "1"), ("a sneaker", "0"), ("a sneaker", "1")]
    assert [a["scale"] for a in records[4]["adapters"]] == [0.5] and records[0]["adapters"] == []
    plain, inverted = (np.asarray(Image.open(records[i]["path"]), dtype=int) for i in (0, 4))
    assert np.abs(plain - inverted).max() > 0, "the adapter changed the same seed's image"
    assert lines[-3].startswith("refused: card 'tiny-base' declares no adapter 'no-such-adapter'")
    student = json.loads(lines[-2])
    assert (student["student"], student["steps"], student["logged"]) == ("tiny-base-1step", "1", 1)
    assert student["command"].startswith("cardtool distill ") and "--steps 1 --set=optim.steps=1" in student["command"]
    assert json.loads(lines[-1]) == {"parity": True, "checked": [
        "cfg_combine", "contract:C1", "generate:denoise", "text_encoder:hf-encoder", "transformer:wan-dit",
        "vae:conv-vae"]}
    assert not (tmp_path / "out" / "never").exists()
    assert len(list((tmp_path / "out" / "plain").iterdir())) == 4, "its four images, and no grid unless asked"


def test_a_workflow_runs_from_its_file_with_overrides_and_resumes(tmp_path):
    tour = REPO / "examples" / "workflows" / "tiny-tour.yaml"
    waves, started, nums = [], time.perf_counter(), ["steps.draft.generate.num=2", "steps.pick.best_of_n.num=2"]
    report = cardtool.run_workflow(tour, overrides=nums, out=tmp_path, max_batch=np.int64(2),
                                   on_wave=lambda *args: waves.append(args))  # as generate's
    elapsed = time.perf_counter() - started
    assert 0 < sum(s["seconds"] for s in report.steps) <= report.seconds + 0.0005 * len(report.steps) \
        and report.seconds <= elapsed  # step seconds rounded to 1 ms
    assert [(s["step"], len(s["images"])) for s in report.steps] == [("draft", 4), ("refine", 4), ("compare", 2),
                                                                     ("pick", 2)]
    # best-of-4 at --max-batch 2: each request's 4 candidates a wave of their own
    assert waves == [("draft", 2, 4), ("refine", 2, 4), ("compare", 1, 2), ("pick", 1, 2)], "after all but the last"
    again = cardtool.run_workflow(str(tour), overrides=tuple(nums), out=tmp_path, skip_existing=True)
    assert [s["kept"] for s in again.steps] == [4, 4, 2, 2]
    for bad, message in (({"max_batch": 0}, "--max-batch must be at least 1"), ({"out": 3}, "out must be a path"),
                         ({"overrides": "a=1"}, "overrides are a list"),
                         ({"overrides": 3}, "overrides are a list"), ({"on_step": 1}, "on_step must be a"),
                         ({"skip_existing": "no"}, "skip_existing must be True or False"),
                         ({"out": "-"}, "--out -: images are written as PNG files .*; give a folder .[^ ]*/- for one "
                                        "named '-'")):
        with pytest.raises(cardtool.BadInput, match=message):
            cardtool.run_workflow(tour, **bad)
    with pytest.raises(cardtool.BadInput, match="a workflow is a manifest file"):
        cardtool.run_workflow(None)
    from cardtool.core.workflows.manifest import load_workflow

    with pytest.raises(cardtool.BadInput, match="overrides apply when the workflow is loaded: give its file, or load"):
        cardtool.run_workflow(load_workflow(tour), overrides=nums, out=tmp_path)
    with pytest.raises(cardtool.CardValidationError):
        cardtool.run_workflow(tour, overrides=["steps.draft.generate.num=0"])


def test_parity_is_a_call_whose_report_is_the_commands(monkeypatch, kernels):
    """`cardtool.parity(card, device=, op=)`: the rows `cardtool parity` prints, `.to_json()` its `--json` document;
    a failed row is a finding in the report (`ok` False), a bad argument a BadInput before any work."""
    from typer.testing import CliRunner

    from cardtool.cli import app

    monkeypatch.setenv("CARDTOOL_PATH", str(REPO / "examples" / "cards"))
    report = cardtool.parity("tiny-base", device="cpu", op="cfg_combine")
    assert report.ok and report.failed == [] and report.platform.device == "cpu"
    cells = {(row.cell.split("/")[0], row.dtype) for row in report.rows}
    assert {("cfg_combine", "float64"), ("vae:conv-vae", "float32"), ("transformer:wan-dit", "float64"),
            ("text_encoder:hf-encoder", "float32"),
            ("generate:denoise", "float32"), ("adapters.invert:lora", "float64"), ("adapters.invert:lora", "float32"),
            ("contract:C1", "float32")} <= cells
    shown = CliRunner().invoke(app, ["parity", "--card", "tiny-base", "--device", "cpu", "--op", "cfg_combine",
                                     "--json"])
    assert shown.exit_code == 0 and json.loads(shown.stdout) == report.to_json()
    assert report.unchecked == []  # what no row compared, said so that a passing report is not read as covering it
    printed = CliRunner().invoke(app, ["parity", "--card", "tiny-base", "--device", "numpy", "--op", "cfg_combine"],
                                 env={"COLUMNS": "1000"})
    assert printed.exit_code == 0, printed.output
    assert "  not compared with numpy:\n    text_encoder: numpy is the reference: nothing to compare it with" in \
        printed.stdout and "    adapters.invert: numpy is the reference" in printed.stdout
    kernels.register("cfg_combine", "cpu", "generic", "default", target="wrong_kernels:cfg_combine_sign_flipped")
    wrong = cardtool.parity(device="cpu", op="cfg_combine")
    assert not wrong.ok and {row.dtype for row in wrong.failed} >= {"float64", "float32"} and wrong.unchecked == []
    assert all(row.cell == "cfg_combine/cpu/generic/default" and not row.error for row in wrong.rows)
    for call, said in [(lambda: cardtool.parity(device=3), "device must be text"),
                       (lambda: cardtool.parity(op=["rms_norm"]), "op must be text"),
                       (lambda: cardtool.parity(op="rms_nrom"), "unknown op 'rms_nrom'; ops: attention, "),
                       (lambda: cardtool.parity(device="tpu"), "unknown device 'tpu'"),
                       (lambda: cardtool.parity(7), "card must be a card id or path, got 7"),
                       (lambda: cardtool.parity("no-such-card", op="rms_norm"), "no-such-card")]:
        with pytest.raises(cardtool.BadInput, match=said):
            call()


@pytest.mark.parametrize(("bad", "shown", "held"), [("\0", r"\\x00", "a NUL byte"),
                                                   ("\ud800", r"\\ud800", r"'\\ud800', a lone surrogate")])
def test_a_path_no_file_name_can_be_is_bad_input_in_every_call(tmp_path, monkeypatch, bad, shown, held):
    """No file name holds a NUL byte or a lone surrogate (other than the command line's undecoded bytes), and
    Python's file calls raise a bare ValueError for them; a caller of the API (the command line cannot pass these)
    gets BadInput or a located CardValidationError, and nothing is written."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("CARDTOOL_PATH", str(REPO / "examples" / "cards"))
    tour = REPO / "examples" / "workflows" / "tiny-tour.yaml"
    calls = {
        "generate out": lambda: cardtool.generate("tiny-base", "a bag", steps=1, out=f"o{bad}"),
        "LoadedCard out": lambda: cardtool.LoadedCard("tiny-base").generate("a bag", steps=1, out=Path(f"o{bad}")),
        "evaluate out": lambda: cardtool.evaluate("tiny-base", judge="tiny-judge", steps=[1], per_class=1,
                                                  out=f"o{bad}.json"),
        "workflow out": lambda: cardtool.run_workflow(tour, out=f"o{bad}"),
    }
    for call in calls.values():
        with pytest.raises(cardtool.BadInput, match=rf"^--out 'o{shown}(\.json)?' holds {held}, which no file"):
            call()
    with pytest.raises(cardtool.CardValidationError, match=rf"^a{shown}\.yaml:1:1: a path holding {held}"):
        cardtool.run_workflow(f"a{bad}.yaml")
    with pytest.raises(cardtool.BadInput, match=f"out holds {held}"):
        cardtool.export(REPO / "examples" / "cards" / "tiny-base", f"e{bad}")
    assert list((tmp_path / "work").iterdir()) == []


def test_an_errors_message_is_text_any_stream_writes_whatever_the_caller_passed(monkeypatch):
    """A message quoting a caller's lone surrogate (a card id, an adapter's name) made `print(error)` raise
    UnicodeEncodeError on a UTF-8 stdout; it says each as the text \\udXXX, as the command line prints an undecoded
    byte, and `args` keeps the value as given."""
    monkeypatch.setenv("CARDTOOL_PATH", str(REPO / "examples" / "cards"))
    with pytest.raises(cardtool.BadInput) as found:
        cardtool.LoadedCard("tiny-\ud800")
    with pytest.raises(cardtool.BadInput) as named:
        cardtool.generate("tiny-base", "a bag", steps=1, out=None, adapters=[("x\udce9", 1.0)])
    assert str(found.value).startswith("no card with id 'tiny-\\ud800'; searched ")
    assert str(named.value) == "card 'tiny-base' declares no adapter 'x\\udce9'; its adapters: invert"
    for error in (found.value, named.value):
        str(error).encode("utf-8")
    assert "\ud800" in found.value.args[0]


def test_the_machines_errors_in_a_call_are_cardtools(tmp_path, monkeypatch):
    """A disk's error where a call reads is RunFailed, as its command says it; a NUL byte that reaches a file call
    is BadInput; any other error as it is."""
    import errno

    from cardtool.core.sampling import generate
    from cardtool.errors import as_cardtool_error

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path / "card.yaml"))

    monkeypatch.setattr(generate, "load_card", failing)
    for call in (lambda: cardtool.generate("tiny-base", "a bag", out=None), lambda: cardtool.LoadedCard("tiny-base")):
        with pytest.raises(cardtool.RunFailed, match=r"card.yaml: Input/output error$"):
            call()
    with pytest.raises(cardtool.BadInput, match="a path holds a NUL byte"), as_cardtool_error():
        open("a\0")  # noqa: SIM115
    with pytest.raises(cardtool.BadInput, match=r"'a\\ud800' holds '\\ud800', a lone surrogate"), as_cardtool_error():
        open("a\ud800")  # noqa: SIM115
    with pytest.raises(ValueError, match="^other$"), as_cardtool_error():
        raise ValueError("other")
    for surrogate in ("\udfff", "\udbff"):  # U+DC80–U+DCFF are a name's bytes that are not UTF-8, and open
        with pytest.raises(cardtool.BadInput, match="a lone surrogate"), as_cardtool_error():
            open("a" + surrogate)  # noqa: SIM115
    with pytest.raises(cardtool.BadInput, match=r"^'a{200}' holds '\\ud800', a lone"), as_cardtool_error():
        open("a" * 300 + "\ud800")  # noqa: SIM115 - a long path is quoted as far as 200 characters
    for text in ("é", "\ud7ff", "\ue000"):  # not surrogates: an encoding that cannot write them is not a bad path
        with pytest.raises(UnicodeEncodeError), as_cardtool_error():
            text.encode("ascii")
    with pytest.raises(ValueError, match="at least one problem"):
        cardtool.errors.CardValidationError([])
