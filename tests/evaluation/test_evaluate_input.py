"""`cardtool eval`'s settings are checked before the data, the floors or any model load."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cardtool.core.evaluation import evaluate as evaluate_module
from cardtool.errors import BadInput


@pytest.mark.parametrize(("settings", "message"), [
    ({"seed": -1}, r"seed must be in \[0, 2⁶³\), got -1"),
    ({"seed": 2**63 - 1, "per_class": 2}, "numbers the 2 images of a prompt up to seed 9,223,372,036,854,775,808"),
    ({"guidance": [2.0, float("nan")]}, "guidance must be a finite number"),
    ({"steps": [2, 1001]}, "steps"),
    ({"adapters": [("nope", 1.0)]}, "nope"),
    ({"per_class": 2.5}, "--per-class must be a whole number"),
    ({"per_class": 0}, "--per-class must be a whole number, at least 1"),
    ({"per_class": None}, "--per-class must be a whole number"),
    # numpy's OverflowError (a traceback) past 2⁶³, an out-of-memory error for the labels' array below it
    ({"per_class": 10**30}, r"asks for 10,000,000,000,000,000,000,000,000,000,000 images a row; at most 100,000"),
    ({"per_class": 10**9}, r"--per-class 1000000000 asks for 10,000,000,000 images a row"),
    ({"judge": 3}, "judge must be a reward card's id or folder"),
    ({"steps": {2}}, "steps must be a list of values"),
    ({"steps": np.ones((1, 2))}, "steps must be a list of values"),  # a matrix is no list
    ({"steps": 1001}, "steps"),  # one value alone is a list of one, checked alike
    ({"steps": [[2], 4]}, r"steps must be a whole number, got \[2\]"),  # unhashable: refused, not taken as none
    ({"guidance": [{"a": 1}]}, "guidance must be a number, got {.a.: 1}"),
    ({"precision": "float8"}, "unknown precision 'float8'"),  # one name, not its characters
    ({"solver": "nope"}, "unknown solver 'nope'"),
    ({"solver": ""}, "unknown solver ''"),
    ({"precision": [""]}, "unknown precision ''"),
    ({"data": ""}, "--data '' names no folder"),
    ({"shift": 0}, "shift must be in 0.01…100"),
    ({"data": ["/usr/share/datasets"]}, "data must be a folder"),
    ({"on_row": "print"}, "on_row must be a function"),
    ({"on_step": 3}, "on_step must be a function"),  # else found only after the first row's sampling
    ({"stop": 3}, "stop must be the list a stop_requests block yields, got 3"),
    ({"max_batch": 0}, "--max-batch must be a whole number, at least 1, got 0"),
    ({"per_class": 10_001}, r"--per-class 10001 asks for 100,010 images a row; at most 100,000 \(--per-class 10,000\)"),
    ({"resume": True}, "give --out"),
    ({"resume": "no", "out": "report.json"}, "resume must be True or False"),  # a non-empty string is truthy
    ({"out": "/"}, "--out / is a folder"),
    ({"out": "/dev/null"}, "--out /dev/null is not a regular file"),  # a rename would swap the device for a file
    ({"out": 3}, "out must be the report's file name"),
    ({"out": "-"}, "--out -: the report is written to a file that --resume continues"),  # was a file named '-'
    ({"out": "-", "resume": True}, "--out -: the report is written to a file"),
    ({"out": "/proc/nope/eval.json"}, "cannot write to the report's folder /proc/nope"),
    # the report would replace the card's manifest, a weights file, the judge's
    ({"out": "tiny-base/card.yaml"}, "tiny-base/card.yaml is a file of card 'tiny-base' .its manifest or weights."),
    ({"out": "tiny-base/adapters/invert.safetensors"}, "is a file of card 'tiny-base'"),
    ({"out": "tiny-judge/classifier.safetensors"}, "is a file of card 'tiny-judge'"),
])
def test_bad_settings_are_refused_before_anything_loads(examples, monkeypatch, settings, message):
    def never(*args, **kwargs):
        raise AssertionError("loaded before the settings were checked")

    monkeypatch.setattr(evaluate_module, "load_split", never)
    monkeypatch.setattr(evaluate_module, "ModelInstance", never)
    monkeypatch.chdir(examples)
    with pytest.raises(BadInput, match=message):
        evaluate_module.evaluate(str(examples / "tiny-base"),
                                 **{"judge": str(examples / "tiny-judge"), "per_class": 1, **settings})


def test_per_class_is_checked_as_a_whole_number_up_to_a_rows_most_images():
    assert evaluate_module.checked_per_class(10_000) == 10_000 and evaluate_module.checked_per_class(1) == 1
    assert type(evaluate_module.checked_per_class(np.int64(3))) is int


def test_more_images_a_row_than_the_floors_training_images_is_refused(examples, tmp_path):
    from helpers import write_idx_folder

    data = str(write_idx_folder(tmp_path / "idx", train=64, test=32))
    with pytest.raises(BadInput, match="--per-class 7 asks for 70 images, more than the 64 training images the floors"):
        evaluate_module.evaluate(str(examples / "tiny-base"), judge=str(examples / "tiny-judge"), per_class=7,
                                 steps=1, data=data)


@pytest.mark.parametrize(("value", "listed"), [
    (20, [20]), ("float32", ["float32"]), ((4, 2, 4), [4, 2]), (range(1, 4), [1, 2, 3]),
    (np.arange(1, 4), [1, 2, 3]), (np.array(20), [20]),
    (np.array([1.5, 4.0]), [1.5, 4.0]), (np.float32(2.5), [2.5]),
])
def test_a_list_setting_takes_one_value_a_tuple_a_range_or_a_numpy_vector_as_plain_python_values(value, listed):
    got = evaluate_module._listed("steps", value)
    assert got == listed and all(type(v) in (int, float, str) for v in got), got


def test_eval_samples_with_the_shift_and_solver_asked_for_and_its_rows_say_so(examples, tmp_path):
    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app

    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "1",
            "--steps", "3", "--data", str(write_idx_folder(tmp_path / "idx")), "--json"]
    folder = sorted((p.name, p.read_bytes()) for p in (examples / "tiny-base").rglob("*") if p.is_file())
    rows = {}
    for name, extra in (("default", []), ("asked", ["--shift", "3", "--solver", "sde"])):
        result = CliRunner().invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        [rows[name]] = json.loads(result.stdout)["rows"]
    assert sorted((p.name, p.read_bytes()) for p in (examples / "tiny-base").rglob("*") if p.is_file()) == folder, \
        "without --record the card is left as it was"
    assert (rows["default"]["shift"], rows["default"]["solver"]) == (1.0, "euler")
    assert (rows["asked"]["shift"], rows["asked"]["solver"]) == (3.0, "sde")
    assert rows["asked"]["kid"] != rows["default"]["kid"], "other images were sampled"
    refused = CliRunner().invoke(app, [*args, "--shift", "3", "--record"])
    assert refused.exit_code == 2 and "drop --adapter, --shift and --solver to record" in refused.stdout
    shown = CliRunner().invoke(app, args[:-1], env={"COLUMNS": "1000"})  # for people: the table's title
    assert shown.exit_code == 0 and ", 1 image per class" in shown.stdout, shown.output


def test_a_row_whose_guidance_interval_guides_no_step_is_warned_of(examples, tmp_path):
    """σ 0.6–0.7 holds the start of no step at 2 steps (σ 1, 0.5) and of one at 3 (σ 1, 0.67, 0.33): the 2-step
    row's guidance 4 applies to none — its numbers are guidance 1's — and the report says so for that row alone."""
    from helpers import write_idx_folder

    report = evaluate_module.evaluate(str(examples / "tiny-base"), judge=str(examples / "tiny-judge"), per_class=1,
                                      steps=[2, 3], guidance=[4.0], guidance_interval=(0.6, 0.7),
                                      data=str(write_idx_folder(tmp_path / "idx")))
    assert [w for w in report.warnings if "applies to none" in w] == [
        "no step's σ lies in the guidance interval 0.6,0.7 (2 steps on shift 1): guidance 4 applies to none, and the "
        "images are those of guidance 1; widen the interval"]


def test_a_record_that_cannot_be_made_is_refused_before_the_eval_or_keeps_its_rows(examples, tmp_path, monkeypatch):
    import errno
    import tempfile

    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.core.cards import record

    toml = examples / "tiny-rl"  # a TOML manifest: nothing can be recorded in it
    monkeypatch.setattr(evaluate_module, "ModelInstance", lambda *a, **k: pytest.fail("evaluated before refusing"))
    refused = CliRunner().invoke(app, ["eval", str(toml), "--per-class", "1", "--record"])
    assert refused.exit_code == 2 and "--record writes YAML manifests" in refused.output

    def read_only(*args, **kwargs):  # a card installed on a read-only file system, as the built-in ones may be
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    refused = CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--per-class", "1", "--record"])
    assert refused.exit_code == 2, refused.output
    assert "cannot write to the card folder --record writes into" in refused.output
    monkeypatch.undo()

    def full(path, data, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(record, "write_atomic", full)
    result = CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"),
                                      "--per-class", "1", "--steps", "2", "--data",
                                      str(write_idx_folder(tmp_path / "idx")), "--record", "--json"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert "recording it failed" in error["message"] and "No space left on device" in error["message"]
    assert [row["steps"] for row in error["partial"]["rows"]] == [2], "the measured rows are not lost"


def _two_rows(examples, tmp_path, out):
    """`eval` of tiny-base's rows at 1 and 2 steps (one image a class) with --out and --json, through the CLI."""
    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app

    data = tmp_path / "idx" if (tmp_path / "idx").is_dir() else write_idx_folder(tmp_path / "idx")
    return CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"),
                                    "--per-class", "1", "--steps", "1", "--steps", "2", "--data", str(data),
                                    "--out", str(out), "--json"])


def test_a_report_the_disk_stops_taking_keeps_the_rows_measured(examples, tmp_path, monkeypatch):
    """The report is rewritten after each row; the disk filling after the first leaves that row in the file, and the
    second, measured but not written, under 'partial' — not lost behind a bare 'No space left on device'."""
    import errno

    from cardtool.core.evaluation import resume

    writes, real = [], resume.write_atomic

    def full_after_two(path, data, **kwargs):  # the report before any row, then after the first
        if len(writes) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        writes.append(path)
        return real(path, data, **kwargs)

    monkeypatch.setattr(resume, "write_atomic", full_after_two)
    out = tmp_path / "report.json"
    result = _two_rows(examples, tmp_path, out)
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"] == f"cannot write the report to {out}: No space left on device — free space on its disk; " \
        f"the 2 rows so far are under 'partial' (--json), and the same command with --resume measures those {out} " \
        "does not hold"
    assert [row["steps"] for row in error["partial"]["rows"]] == [1, 2]
    assert [row["steps"] for row in json.loads(out.read_text())["rows"]] == [1], "the file holds the first row"


@pytest.mark.parametrize("during", [1, 2])  # another eval's write while this one measures its first row, or its second
def test_a_report_another_process_writes_meanwhile_is_left_as_it_wrote_it(examples, tmp_path, monkeypatch, during):
    """Two evals given one --out (a CI matrix's, say) each rewrote the report after its own rows, the last write
    winning: one run's results were silently gone. The run that finds the file changed since its last write stops,
    leaving the other's report as it is and its own rows under 'partial'."""
    out, measured = tmp_path / "report.json", []
    theirs = b'{"rows": [], "identity": {"card": "another"}}\n'
    real = evaluate_module._measure_row

    def another_process_writes(*args, **kwargs):
        measured.append(True)
        if len(measured) == during:
            out.write_bytes(theirs)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "_measure_row", another_process_writes)
    result = _two_rows(examples, tmp_path, out)
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["message"].startswith(f"{out} was written by another process while this eval ran") and \
        error["message"].endswith("give this eval another --out"), error["message"]
    assert [row["steps"] for row in error["partial"]["rows"]] == [1, 2][:during]
    assert out.read_bytes() == theirs
    # and an eval whose report no one else writes is not stopped by its own writes
    monkeypatch.setattr(evaluate_module, "_measure_row", real)
    alone = _two_rows(examples, tmp_path, tmp_path / "alone.json")
    assert alone.exit_code == 0 and len(json.loads((tmp_path / "alone.json").read_text())["rows"]) == 2


def test_off_a_terminal_each_row_logs_progress_lines(examples, tmp_path, monkeypatch):
    """A log gets lines inside a row (a 10,000-image row takes minutes), each with the row's own count and the time left
    at the row's pace; a new row starts its count again."""
    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.cli.output import LateProgress

    monkeypatch.setattr(LateProgress, "LINE_EVERY", 0.0)
    result = CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"),
                                      "--per-class", "1", "--steps", "3", "--steps", "4",
                                      "--data", str(write_idx_folder(tmp_path / "idx")), "--json"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("this row: ")]
    assert any("of 30 request-steps" in line for line in lines) and any("of 40 request-steps" in line for line in lines)
    assert all("elapsed" in line and "left" in line for line in lines)


def test_a_lower_max_batch_measures_the_same_images(examples, tmp_path):
    """--max-batch is a memory knob: forwards of fewer rows, the same images and so the same measurements (within
    float32 rounding where a CPU's products round by batch size: tiny-base promises C1, not batch invariance)."""

    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app

    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "2",
            "--steps", "2", "--data", str(write_idx_folder(tmp_path / "idx")), "--json"]
    rows = []
    for extra in ([], ["--max-batch", "1"]):  # the least: one request a forward
        result = CliRunner().invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        [row] = json.loads(result.stdout)["rows"]
        rows.append({k: row[k] for k in ("class_accuracy", "fid_fmnist", "kid", "mean_reward")})
    assert rows[0]["class_accuracy"] == pytest.approx(rows[1]["class_accuracy"], abs=0.051)  # one image of 20
    for key in ("fid_fmnist", "kid", "mean_reward"):
        assert rows[0][key] == pytest.approx(rows[1][key], rel=1e-3, abs=1e-6), key
    refused = CliRunner().invoke(app, [*args, "--max-batch", "0"])
    assert refused.exit_code == 2 and "--max-batch must be" in json.loads(refused.stdout)["error"]["message"]


def test_memory_running_out_in_a_row_keeps_the_rows_measured(examples, tmp_path, monkeypatch):
    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.core.evaluation import evaluate as module

    real = module.sample

    def sample_then_fail(*args, **kwargs):
        if args[1][0].steps == 2:  # the second row
            raise MemoryError()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "sample", sample_then_fail)
    report = tmp_path / "report.json"
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "1",
            "--steps", "1", "--steps", "2", "--data", str(write_idx_folder(tmp_path / "idx")), "--out", str(report)]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    assert error["kind"] == "failed" and "out of memory" in error["message"]
    assert "--resume keeps them" in error["message"]
    assert [row["steps"] for row in error["partial"]["rows"]] == [1]
    monkeypatch.setattr(module, "sample", real)
    # the same command again without --resume would write the report from the start over the row it holds: refused
    again = CliRunner().invoke(app, [*args, "--json"])
    assert again.exit_code == 2 and "holds 1 row of this evaluation already (a stopped sweep's?): --resume keeps it" \
        in json.loads(again.stdout)["error"]["message"]
    assert [row["steps"] for row in json.loads(report.read_text())["rows"]] == [1], "the report as it was"
    resumed = CliRunner().invoke(app, [*args, "--resume", "--json"])
    assert resumed.exit_code == 0 and json.loads(resumed.stdout)["kept_rows"] == 1, resumed.output
    # another evaluation's report (other rows, or another judge) is replaced, as --out says
    other = CliRunner().invoke(app, [*args[:6], "--steps", "3", *args[-4:], "--json"])
    assert other.exit_code == 0 and [row["steps"] for row in json.loads(report.read_text())["rows"]] == [3]


def test_a_kept_row_or_floor_missing_a_field_or_of_another_type_is_measured_again(examples, tmp_path):
    """--resume keeps the rows and floors of the report as measured: one edited or damaged by hand — a field gone, a
    count written as text — is measured again, not a traceback or a report carrying the damage."""

    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app

    report = tmp_path / "report.json"
    args = ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"), "--per-class", "1",
            "--steps", "1", "--steps", "2", "--data", str(write_idx_folder(tmp_path / "idx")), "--out", str(report),
            "--json"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    written = json.loads(report.read_text())
    # (None: the field dropped) the last three well typed, yet printed with a traceback: one of a pair, or one alone
    for damage in ({"images": None}, {"model_evaluations": "4"}, {"accuracy_by_class": 5}, {"steps": 1.0},
                   {"class_accuracy_ci95": "x"}, {"manifold_recall": None}, {"class_accuracy_ci95": [0.5]},
                   {"guidance_interval": [0.0, 0.4, 1.0]}, {"fid_fmnist": True}):  # JSON's true is no number
        document = json.loads(json.dumps(written))
        document["rows"][0] = {k: v for k, v in {**document["rows"][0], **damage}.items() if v is not None}
        report.write_text(json.dumps(document))
        again = CliRunner().invoke(app, [*args, "--resume"])
        assert again.exit_code == 0, (damage, again.output)
        resumed = json.loads(again.stdout)
        assert resumed["kept_rows"] == 1, damage

        def measured(rows):
            return [{k: v for k, v in row.items() if k != "images_per_second"} for row in rows]

        assert measured(resumed["rows"]) == measured(written["rows"]), "the damaged row measured again, as before"
    for key, name, value in (("floors", "train_vs_test", "x"), ("kid_floors", "vae_reconstruction", [1.0]),
                             ("manifold_floors", "train_vs_test", [0.5]), ("floors", "train_vs_test", float("nan"))):
        document = json.loads(json.dumps(written))
        document[key][name] = value
        report.write_text(json.dumps(document))
        again = CliRunner().invoke(app, [*args, "--resume"])
        assert again.exit_code == 0, (key, value, again.output)
        resumed = json.loads(again.stdout)
        assert all(resumed[k] == written[k] for k in ("floors", "kid_floors", "manifold_floors")), (key, value)
    document = json.loads(json.dumps(written))  # well formed, each kind of floor: kept as the report holds it
    document["floors"]["train_vs_test"], document["kid_floors"]["vae_reconstruction"] = 123.5, 7
    document["manifold_floors"]["train_vs_test"] = [0.25, 1]
    report.write_text(json.dumps(document))
    again = CliRunner().invoke(app, [*args, "--resume"])
    assert again.exit_code == 0, again.output
    resumed = json.loads(again.stdout)
    assert resumed["floors"]["train_vs_test"] == 123.5 and resumed["kid_floors"]["vae_reconstruction"] == 7
    assert resumed["manifold_floors"]["train_vs_test"] == [0.25, 1]


def test_resume_starts_afresh_where_no_report_is_yet_and_refuses_one_past_64_mib(tmp_path):
    from cardtool.core.evaluation.resume import previous_rows

    assert previous_rows(tmp_path / "new.json", {}) == ({}, [])
    (tmp_path / "link.json").symlink_to(tmp_path / "nowhere.json")  # a report was meant to be there: said so
    with pytest.raises(BadInput, match="cannot resume from .*link.json: .*link.json is a link to .*nowhere.json, "
                                       "which does not exist"):
        previous_rows(tmp_path / "link.json", {})
    (tmp_path / "big.json").write_bytes(b" " * ((64 << 20) + 1))
    with pytest.raises(BadInput, match=f"cannot resume from .*big.json: .*is larger than {64 << 20} bytes"):
        previous_rows(tmp_path / "big.json", {})


def test_resume_keeps_a_captions_row_without_accuracy_and_no_classes_row_without_it(tmp_path):
    """A report on your own captioned images has no accuracy or reward (null); one on the classes must have both."""

    from cardtool.core.evaluation.resume import ROW_SETTINGS, previous_rows

    row = {**dict.fromkeys(ROW_SETTINGS, 1), "fid_fmnist": 20.0, "kid": 0.01, "kid_std": 0.001,
           "images_per_second": 3.0}
    for prompts, judged, kept in (("captions", None, 1), ("captions", 0.5, 1), ("classes", None, 0),
                                  ("classes", 0.5, 1)):
        judged_row = {**row, "class_accuracy": judged, "mean_reward": judged}
        report = {"identity": {}, "prompts": prompts, "rows": [judged_row]}
        (tmp_path / "r.json").write_text(json.dumps(report))
        assert len(previous_rows(tmp_path / "r.json", {})[1]) == kept, (prompts, judged)


def test_resume_refuses_a_report_of_the_same_card_id_with_other_weights(examples, tmp_path):
    """A card retrained in place (or a judge) keeps its id; its rows measured the old weights."""
    import hashlib

    from helpers import write_idx_folder
    from safetensors.torch import load_file, save_file

    from cardtool.core.evaluation.evaluate import evaluate

    data, out = write_idx_folder(tmp_path / "idx"), tmp_path / "eval.json"
    options = {"judge": str(examples / "tiny-judge"), "per_class": 1, "steps": [1], "data": str(data), "out": out}
    evaluate(str(examples / "tiny-base"), **options)
    assert evaluate(str(examples / "tiny-base"), **options, resume=True).kept_rows == 1
    for card, differs in (("tiny-base", "card_weights"), ("tiny-judge", "judge_weights")):
        file = next((examples / card).glob("*.safetensors"))
        tensors = load_file(file)
        name = sorted(tensors)[0]
        before = hashlib.sha256(file.read_bytes()).hexdigest()
        save_file({**tensors, name: tensors[name] + 1}, str(file))
        manifest = examples / card / "card.yaml"  # the new weights intended: their sha256 declared
        manifest.write_text(manifest.read_text().replace(before, hashlib.sha256(file.read_bytes()).hexdigest()))
        with pytest.raises(BadInput, match=f"measured with other {differs}; drop --resume"):
            evaluate(str(examples / "tiny-base"), **options, resume=True)
        evaluate(str(examples / "tiny-base"), **options)  # measured afresh: the next card's change is its alone


def test_a_resumed_run_stopped_before_it_reaches_a_kept_row_keeps_it_in_the_file(examples, tmp_path):
    """The report on disk always holds every finished row: `--steps 2,4,3 --resume` over a report of steps 3 wrote
    the file without that row until its cell came, and a run killed in a new row before it lost it."""
    from helpers import write_idx_folder

    from cardtool.core.evaluation.evaluate import evaluate

    out = tmp_path / "eval.json"
    options = {"judge": str(examples / "tiny-judge"), "per_class": 1, "data": str(write_idx_folder(tmp_path / "idx")),
               "out": out}
    evaluate(str(examples / "tiny-base"), steps=[3], **options)
    measured = json.loads(out.read_text())["rows"]

    def killed(done, total):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        evaluate(str(examples / "tiny-base"), steps=[2, 4, 3], resume=True, on_step=killed, **options)
    assert json.loads(out.read_text())["rows"] == measured
    report = evaluate(str(examples / "tiny-base"), steps=[2, 4, 3], resume=True, **options)
    assert [r.steps for r in report.rows] == [2, 4, 3] and report.kept_rows == 1
    assert [r["steps"] for r in json.loads(out.read_text())["rows"]] == [2, 4, 3]
    assert json.loads(out.read_text())["rows"][2] == measured[0]


def test_resume_refuses_a_report_measured_on_other_images_of_the_same_file_sizes(examples, tmp_path):
    """Uncompressed IDX files rewritten with other images keep their sizes: the rows are known by the images."""
    import gzip

    from helpers import write_idx_folder

    from cardtool.core.evaluation.evaluate import evaluate

    data, out = write_idx_folder(tmp_path / "idx"), tmp_path / "eval.json"
    for packed in list(data.glob("*.gz")):
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    options = {"judge": str(examples / "tiny-judge"), "per_class": 1, "steps": [1], "data": str(data), "out": out}
    evaluate(str(examples / "tiny-base"), **options)
    images = data / "t10k-images-idx3-ubyte"
    changed = bytearray(images.read_bytes())
    changed[-1] ^= 0x80
    images.write_bytes(bytes(changed))
    with pytest.raises(BadInput, match="measured with other data; drop --resume"):
        evaluate(str(examples / "tiny-base"), **options, resume=True)


@pytest.mark.parametrize("versus", [False, True])
def test_eval_with_no_options_passes_the_apis_defaults(monkeypatch, versus):
    """The README's eval (a row of 1,000 images from seed 0, 256 rows a forward, the default judge) is the API's:
    the command line states no default of its own that could drift from `evaluate`'s (nor from `compare`'s, which
    hands its options to `evaluate`)."""
    import inspect

    from typer.testing import CliRunner

    from cardtool.cli import app
    from cardtool.core.evaluation import versus as versus_module

    passed, signature = {}, inspect.signature(evaluate_module.evaluate)

    def capture(*args, **options):
        passed.update(options)
        raise BadInput("captured")

    monkeypatch.setattr(versus_module if versus else evaluate_module, "compare" if versus else "evaluate", capture)
    result = CliRunner().invoke(app, ["eval", "some-card", *(["--versus", "other-card"] if versus else []), "--json"])
    assert result.exit_code == 2 and "captured" in result.stdout, result.output
    defaults = {name: p.default for name, p in signature.parameters.items()
                if p.default is not inspect.Parameter.empty and name in passed and not name.startswith("on_")}
    assert {"per_class", "seed", "max_batch", "judge", "steps", "guidance", "precision", "adapters"} <= set(defaults)
    assert {name: passed[name] for name in defaults} == defaults
    assert (defaults["per_class"], defaults["seed"], defaults["max_batch"]) == (100, 0, 256)


def test_each_rows_progress_line_states_the_rows_measurements(examples, tmp_path):
    """The line on stderr as each row is measured (the only output of a long sweep until the end) says what the
    report says of that row, KID scaled by 1,000 as in the table."""
    import re

    from helpers import write_idx_folder
    from typer.testing import CliRunner

    from cardtool.cli import app

    result = CliRunner().invoke(app, ["eval", str(examples / "tiny-base"), "--judge", str(examples / "tiny-judge"),
                                      "--per-class", "2", "--steps", "2", "--guidance", "2", "--guidance-interval",
                                      "0,0.5", "--data", str(write_idx_folder(tmp_path / "idx")), "--json"],
                           env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)["rows"][0]
    line = next(line for line in result.stderr.splitlines() if line.startswith("float32 steps 2"))
    found = re.fullmatch(r"float32 steps 2 guidance 2 on σ ≤ 0.5: accuracy (\S+) \((\S+)–(\S+)\)  FID (\S+) ± (\S+)  "
                         r"KID×1000 (\S+) ± (\S+)  precision (\S+) recall (\S+)  reward (\S+)  (\d+) img/s", line)
    assert found, line
    *shown, per_second = [float(v) for v in found.groups()]
    assert shown == pytest.approx([row["class_accuracy"], *row["class_accuracy_ci95"], row["fid_fmnist"],
                                   row["fid_fmnist_std"], 1000 * row["kid"], 1000 * row["kid_std"],
                                   row["manifold_precision"], row["manifold_recall"], row["mean_reward"]],
                                  rel=0, abs=0.0051)  # as rounded to two to four decimals
    assert per_second == pytest.approx(row["images_per_second"], rel=0, abs=0.51)


def test_a_report_removed_while_the_eval_runs_is_written_again(examples, tmp_path, monkeypatch):
    """A report removed mid-run (someone clearing a stale one) holds no other eval's rows: the run writes it again."""
    out, real = tmp_path / "report.json", evaluate_module._measure_row

    def removed(*args, **kwargs):
        out.unlink(missing_ok=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "_measure_row", removed)
    result = _two_rows(examples, tmp_path, out)
    assert result.exit_code == 0, result.output
    assert [row["steps"] for row in json.loads(out.read_text())["rows"]] == [1, 2]
