"""Ctrl-C, SIGTERM or SIGHUP during an eval, a generation or a workflow: the unit in flight (a row, a wave, a
step) finishes, the command stops with exit 128 + the signal and kind `interrupted`, and `--json` carries what the
finished units made under `partial`."""

from __future__ import annotations

import json
import os
import signal

import pytest
from helpers import EXAMPLE_CARDS, write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.evaluation import evaluate as evaluate_module


def test_an_interrupted_eval_reports_its_finished_rows(tmp_path, monkeypatch, interactive_signals):
    measure = evaluate_module._measure_row

    def measure_then_sigint(*args, **kwargs):  # the user presses Ctrl-C while the first row is being measured
        measure(*args, **kwargs)
        if len(args[0].rows) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(evaluate_module, "_measure_row", measure_then_sigint)
    before = signal.getsignal(signal.SIGINT)
    result = CliRunner().invoke(app, ["eval", str(EXAMPLE_CARDS / "tiny-base"), "--judge",
                                      str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1", "--steps", "1", "--steps",
                                      "2", "--steps", "3", "--data", str(write_idx_folder(tmp_path / "idx")), "--json"])
    assert result.exit_code == 130, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "interrupted" and error["message"] == "SIGINT after 1 of 3 rows"
    assert [row["steps"] for row in error["partial"]["rows"]] == [1]
    assert 0 <= error["partial"]["rows"][0]["class_accuracy"] <= 1 and error["partial"]["floors"]
    assert signal.getsignal(signal.SIGINT) is before, "the handler in place before is back"


def test_an_interrupted_eval_with_out_resumes_measuring_only_the_rest(tmp_path, monkeypatch, interactive_signals):
    """--out holds every finished row; --resume keeps them (the same numbers, not measured again) and measures the
    others; a report of another evaluation is refused, not mixed in."""
    measure = evaluate_module._measure_row
    measured = []

    def measure_then_sigint(*args, **kwargs):
        measure(*args, **kwargs)
        measured.append(args[0].rows[-1].steps)
        if len(measured) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(evaluate_module, "_measure_row", measure_then_sigint)
    report = tmp_path / "eval.json"
    args = ["eval", str(EXAMPLE_CARDS / "tiny-base"), "--judge", str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1",
            "--steps", "1", "--steps", "2", "--steps", "3", "--data", str(write_idx_folder(tmp_path / "idx")),
            "--out", str(report), "--json"]
    stopped = CliRunner().invoke(app, args)
    assert stopped.exit_code == 130 and "--resume measures the rest" in json.loads(stopped.stdout)["error"]["message"]
    on_disk = json.loads(report.read_text())
    assert [row["steps"] for row in on_disk["rows"]] == [1] and on_disk["identity"]["per_class"] == 1
    resumed = CliRunner().invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    document = json.loads(resumed.stdout)
    assert measured == [1, 2, 3] and document["kept_rows"] == 1
    assert [row["steps"] for row in document["rows"]] == [1, 2, 3] and document["rows"][0] == on_disk["rows"][0]
    assert json.loads(report.read_text())["rows"] == document["rows"]
    again = CliRunner().invoke(app, [*args, "--resume"])
    assert measured == [1, 2, 3] and json.loads(again.stdout)["kept_rows"] == 3, "nothing left to measure"
    other = CliRunner().invoke(app, [*args[:5], "2", *args[6:], "--resume"])  # --per-class 2
    assert other.exit_code == 2 and "measured with other per_class" in json.loads(other.stdout)["error"]["message"]
    report.write_text("[1, 2]")
    broken = CliRunner().invoke(app, [*args, "--resume"])
    assert broken.exit_code == 2 and "not an eval report" in json.loads(broken.stdout)["error"]["message"]
    no_out = CliRunner().invoke(app, [*args[:-3], "--resume", "--json"])
    assert no_out.exit_code == 2 and "give --out" in json.loads(no_out.stdout)["error"]["message"]


def test_a_resume_stopped_before_its_kept_rows_keeps_them_in_out(tmp_path, monkeypatch, interactive_signals):
    """A resumed eval whose first row is new and the next ones kept, stopped after that first row: --out holds the
    new row and every kept one, so the next --resume measures none of them again."""
    report = tmp_path / "eval.json"
    args = ["eval", str(EXAMPLE_CARDS / "tiny-base"), "--judge", str(EXAMPLE_CARDS / "tiny-judge"), "--per-class", "1",
            "--data", str(write_idx_folder(tmp_path / "idx")), "--out", str(report), "--json"]
    assert CliRunner().invoke(app, [*args, "--steps", "2", "--steps", "3"]).exit_code == 0
    kept = json.loads(report.read_text())["rows"]
    measure = evaluate_module._measure_row

    def measure_then_sigint(*args, **kwargs):
        measure(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(evaluate_module, "_measure_row", measure_then_sigint)
    stopped = CliRunner().invoke(app, [*args, "--steps", "1", "--steps", "2", "--steps", "3", "--resume"])
    assert stopped.exit_code == 130, stopped.output
    rows = json.loads(report.read_text())["rows"]
    assert [row["steps"] for row in rows] == [1, 2, 3] and rows[1:] == kept


# a scheduler's preemption, a closed terminal, Slurm's warning a job asked for
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1])
def test_an_interrupted_generate_lists_the_images_it_wrote(tmp_path, monkeypatch, interactive_signals, signum):
    from cardtool.core.sampling import generate as generate_module

    save = generate_module.save_image

    def save_then_sigterm(path, *args):  # the signal comes as the first wave's last image is written
        save(path, *args)
        if path.name.startswith("tiny-base-001-"):
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(generate_module, "save_image", save_then_sigterm)
    result = CliRunner().invoke(app, ["generate", str(EXAMPLE_CARDS / "tiny-base"), "-p", "a bag", "-n", "5",
                                      "--steps", "1", "--max-batch", "2", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 128 + signum, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "interrupted" and error["message"].startswith(signum.name)
    assert error["message"].split(" after ")[1].startswith("2 of 5 images"), error["message"]
    written = [image["path"] for image in error["partial"]["images"]]
    assert written == sorted(str(p) for p in tmp_path.glob("*.png")) and len(written) == 2


def test_an_interrupted_workflow_keeps_its_finished_steps(tmp_path, monkeypatch, interactive_signals):
    from helpers import REPO

    from cardtool.core.workflows import run as run_module

    step = run_module._run_step

    def sigterm_after(last: str):
        def run_step(runner, workflow, name, *args):  # SIGTERM as step `last` finishes
            step(runner, workflow, name, *args)
            if name == last:
                os.kill(os.getpid(), signal.SIGTERM)
        return run_step

    monkeypatch.setattr(run_module, "_run_step", sigterm_after("draft"))  # preempted during the first step
    result = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                      "--out", str(tmp_path / "out"), "--json"])
    assert result.exit_code == 143, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "interrupted" and error["message"].startswith("SIGTERM after 1 of 4 steps")
    assert [s["step"] for s in error["partial"]["steps"]] == ["draft"]
    assert sorted(p.parent.name for p in (tmp_path / "out" / "tiny-tour").glob("*/*.png")) == ["draft", "draft"]
    assert "the same command with --skip-existing makes the rest" in error["message"]

    # resumed, it keeps the draft and makes the rest: the images an uninterrupted run makes, under the same names
    monkeypatch.setattr(run_module, "_run_step", step)
    resumed = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                       "--out", str(tmp_path / "out"), "--json", "--skip-existing"])
    assert resumed.exit_code == 0, resumed.output
    assert [s["kept"] for s in json.loads(resumed.stdout)["steps"]] == [2, 0, 0, 0]
    whole = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                     "--out", str(tmp_path / "whole")])
    assert whole.exit_code == 0, whole.output
    made = sorted((tmp_path / "out" / "tiny-tour").glob("*/*.png"))
    assert [p.relative_to(tmp_path / "out") for p in made] == \
        [p.relative_to(tmp_path / "whole") for p in sorted((tmp_path / "whole" / "tiny-tour").glob("*/*.png"))]
    for path in made:
        assert path.read_bytes() == (tmp_path / "whole" / path.relative_to(tmp_path / "out")).read_bytes(), path

    monkeypatch.setattr(run_module, "_run_step", sigterm_after("compare"))  # as the last step but one finishes
    stopped = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                       "--out", str(tmp_path / "late"), "--json"])
    assert stopped.exit_code == 143 and json.loads(stopped.stdout)["error"]["message"].startswith(
        "SIGTERM after 3 of 4 steps"), stopped.output
    monkeypatch.setattr(run_module, "_run_step", sigterm_after("pick"))  # the signal comes as the last step finishes
    finished = CliRunner().invoke(app, ["workflow", "run", str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
                                        "--out", str(tmp_path / "last"), "--json"])
    assert finished.exit_code == 0, "nothing was left to stop: the run is done, not interrupted"
    assert [s["step"] for s in json.loads(finished.stdout)["steps"]] == ["draft", "refine", "compare", "pick"]


def test_a_signal_the_process_was_told_to_ignore_stays_ignored(interactive_signals):
    """A shell starts a background job with SIGINT ignored: a stray Ctrl-C must not stop it through our handler; nor
    does a closed terminal's SIGHUP stop a run started under nohup, which ignores it."""
    from cardtool.core.interrupt import stop_requests

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with stop_requests() as caught:
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)
    assert caught == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_first_signal_asks_and_a_second_acts_at_once(interactive_signals):
    """A user who pressed Ctrl-C and will not wait for the unit in flight presses it again: that one is Python's
    KeyboardInterrupt, at once."""
    from cardtool.core.interrupt import stop_requests

    with pytest.raises(KeyboardInterrupt), stop_requests() as caught:
        os.kill(os.getpid(), signal.SIGINT)
        assert caught == [signal.SIGINT]
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second Ctrl-C did not stop the block")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_cpu_time_limits_repeated_warnings_ask_once_and_a_ctrl_c_still_acts_at_once(interactive_signals):
    """Past `ulimit -t`'s soft limit the kernel sends SIGXCPU every CPU second until the hard limit's SIGKILL: the
    repeats must not end the step in flight as a second Ctrl-C would (SIGXCPU's default dumps core), and a user's
    Ctrl-C after them still does."""
    from cardtool.core.interrupt import Interrupted, stop_requests

    with pytest.raises(KeyboardInterrupt), stop_requests() as caught:
        for _ in range(3):
            os.kill(os.getpid(), signal.SIGXCPU)
        assert caught == [signal.SIGXCPU] * 3
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("a Ctrl-C after the warnings did not stop the block")
    assert signal.getsignal(signal.SIGXCPU) is signal.SIG_IGN  # past the soft limit: the next would end the process
    stopped = Interrupted.after(signal.SIGXCPU, "step 3 of 9")
    assert (str(stopped), stopped.exit_code) == ("SIGXCPU (the CPU-time limit, ulimit -t) after step 3 of 9", 152)


def test_disabled_or_off_the_main_thread_the_handlers_stay_as_they_were(interactive_signals):
    """Under torchrun (disabled: the ranks must stop together) and in a worker thread (Python installs handlers only
    on the main thread) nothing is caught."""
    import threading

    from cardtool.core.interrupt import SIGNALS, stop_requests

    before = {s: signal.getsignal(s) for s in SIGNALS}
    with stop_requests(enabled=False) as caught:
        assert {s: signal.getsignal(s) for s in SIGNALS} == before and caught == []
    seen = []

    def worker():
        with stop_requests() as caught:
            seen.append(({s: signal.getsignal(s) for s in SIGNALS}, caught))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(before, [])]


def test_a_workflow_stopped_inside_a_step_keeps_its_finished_waves_and_resumes_from_them(tmp_path, monkeypatch,
                                                                                         interactive_signals):
    """A long step is not all-or-nothing: the wave in flight finishes, is written, and is kept on --skip-existing."""
    from cardtool.core.workflows import run as run_module

    workflow = tmp_path / "w.yaml"
    workflow.write_text(f"""schema: cardtool/v1
kind: workflow
id: w
steps:
  draft:
    generate: {{card: {EXAMPLE_CARDS / 'tiny-base'}, prompts: ["a bag"], num: 3, steps: 1}}
  refine:
    chain: {{input: draft, card: {EXAMPLE_CARDS / 'tiny-base'}, steps: 2}}
""")
    save = run_module.save_image

    def save_then_sigterm(path, *args):  # preempted as the first wave (one image at --max-batch 1) is written
        save(path, *args)
        if path.name.startswith("000-"):
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_module, "save_image", save_then_sigterm)
    command = ["workflow", "run", str(workflow), "--out", str(tmp_path / "out"), "--max-batch", "1", "--json"]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 143, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"].startswith("SIGTERM after 0 of 2 steps and 1 of 3 images of step 'draft'")
    [draft] = error["partial"]["steps"]
    assert [image["seed"] for image in draft["images"]] == ["0"] and len(list(tmp_path.glob("out/w/*/*.png"))) == 1

    monkeypatch.setattr(run_module, "save_image", save)
    resumed = CliRunner().invoke(app, [*command, "--skip-existing"])
    assert resumed.exit_code == 0, resumed.output
    assert [(s["step"], s["kept"], len(s["images"])) for s in json.loads(resumed.stdout)["steps"]] == [
        ("draft", 1, 3), ("refine", 0, 3)]
    assert "step draft: 2 of 3 images\n" in resumed.stderr and "step refine: 1 of 3 images\n" in resumed.stderr


# A Ctrl-C that lands while Python imports a module, made certain: a finder ahead of the others raises
# KeyboardInterrupt the first time the named module is looked for.
_CTRL_C_IN_IMPORT = """
import sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} and not getattr(self, "done", False):
            self.done = True
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
sys.argv = ["cardtool", *{argv!r}]
if {script!r}:  # as the console script runs: its entry point, called
    from importlib.metadata import entry_points
    entry_points(group="console_scripts")["cardtool"].load()()
else:
    import runpy
    runpy.run_module("cardtool", run_name="__main__")
"""


@pytest.mark.parametrize("module, argv, script", [
    ("cardtool.cli", ["--help"], False),  # before the CLI is loaded: `python -m cardtool`
    ("cardtool.cli", ["--help"], True),  # the console script
    ("torch._prims", ["generate", "tiny-base", "-p", "a bag", "--steps", "1"], False),  # in a command's torch import
])
def test_a_ctrl_c_inside_an_import_exits_130_without_a_traceback(tmp_path, module, argv, script):
    """Once a Ctrl-C halts torch's import, importing torch again raises (its operators are registered twice): the
    CLI's exit must not import it again to leave a process group it never joined."""
    import subprocess
    import sys

    env = {**os.environ, "CARDTOOL_PATH": str(EXAMPLE_CARDS)}
    code = _CTRL_C_IN_IMPORT.format(module=module, argv=argv, script=script)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir()), done.stderr[-2000:]


def test_an_error_a_ctrl_c_caused_exits_130_and_any_other_still_raises(monkeypatch):
    """Python 3.11 wraps a KeyboardInterrupt raised while a class is made in a RuntimeError ("Error calling
    __set_name__"): that is the user's Ctrl-C, not a bug to show a traceback for."""
    import sys

    import cardtool.cli as cli

    for name in ("stdout", "stderr", "meta_path"):  # main wraps the streams and adds a finder: the test's come back
        monkeypatch.setattr(sys, name, getattr(sys, name) if name != "meta_path" else list(sys.meta_path))

    def wrapped():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as stop:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'name' in 'Platform'") from stop

    monkeypatch.setattr(cli, "app", wrapped)
    with pytest.raises(SystemExit) as stopped:
        cli.main()
    assert stopped.value.code == 130

    def bug():
        raise RuntimeError("a bug")

    monkeypatch.setattr(cli, "app", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main()


def test_a_ctrl_c_during_torchs_import_is_raised_once_its_code_has_run(tmp_path):
    """torch's import calls back into Python from C++, where a KeyboardInterrupt can abort the process: the CLI holds
    a Ctrl-C back until torch's own code has run (here: until after `torch._refs`, which torch imports after
    `torch._prims`, where the signal comes)."""
    import subprocess
    import sys

    script = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal: pytest-xdist's workers ignore it
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == "torch._prims" and not getattr(self, "done", False):
            self.done = True
            os.kill(os.getpid(), signal.SIGINT)
from cardtool.core.interrupt import hold_ctrl_c_in_imports
hold_ctrl_c_in_imports("torch")
hold_ctrl_c_in_imports("torch")  # once is enough: a second call adds nothing
assert sum(type(f).__name__ == "_HoldingFinder" for f in sys.meta_path) == 1
sys.meta_path.insert(1, CtrlC())
try:
    import torch
except KeyboardInterrupt:
    print("torch._refs" in sys.modules)
sys.path.insert(0, sys.argv[1])
try:
    import other  # a module not named: a Ctrl-C inside it is raised at once
except KeyboardInterrupt:
    print("OTHER_RAN_ON" in os.environ)
"""
    (tmp_path / "other.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\n"
                                       "os.environ['OTHER_RAN_ON'] = '1'\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.stdout == "True\nFalse\n", done.stderr[-2000:]


def test_a_run_past_its_cpu_time_limit_checkpoints_and_exits_152_not_with_a_core_dump(tmp_path):
    """Under `ulimit -t` (a login node's, SGE's s_cpu) the kernel warns with SIGXCPU, whose default ends the process
    and dumps core, every CPU second until the hard limit: training stopped there lost every step since its last
    checkpoint. It checkpoints the finished step and exits 152 (128 + SIGXCPU); test_train's signal test resumes
    such a run."""
    import resource
    import subprocess
    import sys

    from helpers import REPO
    from safetensors import safe_open

    def children_cpu() -> float:  # every child's this process has waited for, so far
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return used.ru_utime + used.ru_stime

    recipe = REPO / "examples" / "recipes" / "fashion-bold.yaml"
    env = {**os.environ, "CARDTOOL_CACHE": str(tmp_path / "cache")}

    def train(steps: int, name: str) -> list[str]:
        return [sys.executable, "-m", "cardtool", "train", "--recipe", str(recipe), "--data",
                str(REPO / "examples" / "images"), "--set", f"parents=[{EXAMPLE_CARDS / 'tiny-base'}]", "--set",
                "data.transform=none", "--set", "model.adapter=mine", "--set", "card.id=tiny-mine", "--set",
                f"optim.steps={steps}", "--set", "optim.batch_size=2", "--set", "train.checkpoint_every=1000000",
                "--set", "train.precision=float32", "--out", str(tmp_path / name), "--run-dir",
                str(tmp_path / f"run-{name}"), "--json"]

    # what everything but the steps costs on this machine (imports, modules transformers loads on first use, the
    # encoder, the data, the card at the end), then a few CPU seconds of steps: the limit is met inside the loop
    before = children_cpu()
    subprocess.run(train(1, "one"), check=True, capture_output=True, timeout=300, env=env)
    soft = int(children_cpu() - before) + 4

    def limited():
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 120 if hard == resource.RLIM_INFINITY else hard))

    done = subprocess.run(train(1000000, "mine"), capture_output=True, text=True, timeout=300, preexec_fn=limited,
                          env=env)
    assert done.returncode == 152 and done.stdout, done.stderr[-2000:]  # no document: stopped outside the loop
    error = json.loads(done.stdout)["error"]
    assert error["kind"] == "interrupted" and error["message"].startswith("SIGXCPU (the CPU-time limit, ulimit -t) "
                                                                          "after step "), error
    with safe_open(str(tmp_path / "run-mine" / "checkpoint.safetensors"), framework="pt") as f:
        assert int(f.metadata()["step"]) == error["partial"]["step"] > 0


@pytest.mark.parametrize("name", ["SIGXCPU", "SIGUSR1"])
def test_a_batch_systems_warning_outside_long_work_ends_the_command_in_one_line(tmp_path, name):
    """Before (or between) the units a stop can keep, SIGXCPU and SIGUSR1 end the command as their defaults would —
    but with one line saying so and exit 128 + the signal, and no core dump (SIGXCPU's default writes one, gigabytes
    for a torch process where `ulimit -c` allows)."""
    import resource
    import subprocess
    import sys

    script = (
        "import os, signal, sys, time\n"
        "import cardtool.cli as cli\n"
        f"def warned(): os.kill(os.getpid(), signal.{name}); time.sleep(30)\n"
        "cli._working_folder_exists = warned\n"
        "sys.argv = ['cardtool', 'cards', 'list']\n"
        "cli.main()\n")

    def cores_allowed():  # as far as this machine lets a process raise its own
        hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
        resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          preexec_fn=cores_allowed)
    signum = getattr(signal, name)
    assert done.returncode == 128 + signum, (done.returncode, done.stderr[-2000:])
    meaning = {"SIGXCPU": "the CPU-time limit, ulimit -t", "SIGUSR1": "the batch system's warning"}[name]
    assert done.stderr.splitlines() == [f"error {name} ({meaning}) before the work reached a point it could stop at; "
                                        "what was saved is kept"]
    assert not list(tmp_path.iterdir())  # no core file (where the kernel writes them into the working folder)
