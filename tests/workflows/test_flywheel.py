"""`cardtool flywheel` on the tiny example cards: the chain base → rl → distilled, stages skipped by fingerprint on a
re-run, a run stopped after the rl stage going on at distill, and bad input."""

from __future__ import annotations

import json
import re
import time

import pytest
from helpers import EXAMPLE_CARDS, tiny_referee, write_idx_folder
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.training.derived import recipe_fingerprint
from cardtool.core.workflows.flywheel import flywheel, flywheel_recipe
from cardtool.errors import BadInput

TINY = ["rl.optim.steps=2", "rl.optim.batch_size=2", "rl.loss.group_size=4", "rl.loss.rollout_steps=3",
        "rl.train.precision=float32", "distill.optim.steps=3", "distill.optim.batch_size=4",
        "distill.train.precision=float32"]


def run(examples, tmp_path, *extra, overrides=TINY, json_=True):
    data = write_idx_folder(tmp_path / "idx")
    return CliRunner().invoke(app, ["flywheel", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                    "--steps", "1", *[f"--set={o}" for o in overrides], "--out-dir",
                                    str(tmp_path / "cards"), "--run-dir", str(tmp_path / "run"), "--judge",
                                    str(examples / "tiny-judge"), "--held-out-judge", str(tiny_referee(examples)),
                                    "--per-class", "2", "--data", str(data), *(["--json"] if json_ else []), *extra],
                              env={"COLUMNS": "250"})  # the tables for people, unelided


def test_the_flywheel_chains_base_rl_and_student_and_reports_the_three(examples, tmp_path):
    started = time.perf_counter()
    result = run(examples, tmp_path)
    elapsed = time.perf_counter() - started
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [s["stage"] for s in report["stages"]] == ["rl", "distill", "eval"]
    assert not any(s["skipped"] for s in report["stages"])
    said = [line.split(": done in")[0] for line in result.stderr.splitlines() if line.startswith("stage ")]
    assert said == ["stage rl → tiny-base-nft", "stage distill → tiny-base-nft-1step", "stage eval"]
    assert 0 < sum(s["seconds"] for s in report["stages"]) <= elapsed + 0.15  # each rounded to 0.1 s
    tuned = load_card(tmp_path / "cards" / "tiny-base-nft")
    student = load_card(tmp_path / "cards" / "tiny-base-nft-1step")
    assert tuned.manifest.recipe.method == "diffusion_nft"
    assert tuned.manifest.recipe.parents == ["tiny-base", "tiny-judge"]
    assert student.manifest.recipe.method == "dmd2" and student.manifest.recipe.parents == ["tiny-base-nft"]
    assert student.manifest.recipe.assumes.steps == 1
    assert "--steps 1 --set=rl.optim.steps=2" in student.manifest.recipe.command, "the command that made it, whole"
    # the student's teacher is the RL'd card, not the base
    assert student.manifest.extends == "tiny-base-nft" and tuned.manifest.extends.endswith("tiny-base")
    rows = {row["card"]: row for row in report["cards"]}
    assert list(rows) == ["tiny-base", "tiny-base-nft", "tiny-base-nft-1step"]
    assert [rows[c]["model_evaluations"] for c in rows] == [60, 30, 1]  # tiny-base: CFG on all 30 steps
    for row in rows.values():
        assert 0 <= row["class_accuracy"] <= 1 and row["fid_fmnist"] > 0 and row["images_per_second"] > 0
    assert json.loads((tmp_path / "run" / "flywheel.json").read_text()) == report
    [paired] = report["paired"]  # the student against the base, pair by pair (no --compare card here)
    assert (paired["a"], paired["b"]) == ("tiny-base", "tiny-base-nft-1step")
    assert paired["accuracy"] == pytest.approx(rows["tiny-base-nft-1step"]["class_accuracy"]
                                               - rows["tiny-base"]["class_accuracy"], abs=1e-4)
    assert paired["fid_fmnist"] == pytest.approx(rows["tiny-base-nft-1step"]["fid_fmnist"]
                                                 - rows["tiny-base"]["fid_fmnist"], abs=1e-3)
    assert 0 <= paired["mcnemar_p"] <= 1 and paired["only_a"] + paired["only_b"] <= 20
    for card in (tuned, student):  # the cards this run made keep their eval, and the held-out judge's accuracy
        metrics = load_card(card.folder).manifest.recipe.metrics
        assert metrics["eval"]["rows"][0]["images"] == 20
        assert metrics["held_out_judge"] == {"card": "tiny-referee", "images": 20,
                                             "class_accuracy": rows[card.id]["held_out_accuracy"]}
    recorded = (tmp_path / "cards" / "tiny-base-nft" / "card.yaml").read_bytes()
    again = run(examples, tmp_path, "--compare", str(examples / "tiny-distilled"))
    assert again.exit_code == 0 and [s["skipped"] for s in json.loads(again.stdout)["stages"]] == [True, True, False]
    assert [s["seconds"] for s in json.loads(again.stdout)["stages"][:2]] == [0.0, 0.0], "nothing ran"
    assert [(d["a"], d["b"]) for d in json.loads(again.stdout)["paired"]] == [
        ("tiny-base", "tiny-base-nft-1step"), ("tiny-distilled", "tiny-base-nft-1step")], "and each --compare card"
    assert (tmp_path / "cards" / "tiny-base-nft" / "card.yaml").read_bytes() == recorded, "a skipped card is left be"
    shown = run(examples, tmp_path, json_=False)  # for people: the three cards and the pairs as tables
    assert shown.exit_code == 0, shown.output
    table = " ".join(shown.stdout.split())
    for row in report["cards"]:  # measured again: the same prompts and seeds
        assert f"{row['card']} {row['method']} {row['steps']} {row['model_evaluations']} " in table
        assert f"{row['class_accuracy']:.4f} {row['held_out_accuracy']:.4f} {row['fid_fmnist']:.3f}" in table
    assert "accuracy (tiny-referee)" in table and "McNemar p" in table and "stage rl: skipped" in table


def test_watching_the_flywheel_watches_both_training_stages(examples, tmp_path):
    result = run(examples, tmp_path, "--stop-after", "distill", "--watch-every", "2")
    assert result.exit_code == 0, result.output
    watched = [line.split()[0] for line in result.stderr.splitlines() if "watch_fid" in line]
    assert watched == ["rl", "distill"], result.stderr
    bad = run(examples, tmp_path, "--watch-every", "-3")
    assert bad.exit_code == 2 and "--watch-every must be 0 (off)" in json.loads(bad.stdout)["error"]["message"]


def test_a_report_the_disk_cannot_take_is_not_lost(examples, tmp_path, monkeypatch):
    import errno

    from cardtool.core.workflows import flywheel

    assert run(examples, tmp_path, "--stop-after", "distill").exit_code == 0

    def full(path, data, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(flywheel, "write_atomic", full)
    result = run(examples, tmp_path)
    assert result.exit_code == 1, result.output
    error = json.loads(result.stdout)["error"]
    report = tmp_path / "run" / "flywheel.json"
    assert error["message"] == f"the flywheel ran, but its report could not be written to {report}: No space left on " \
                               "device — free space on its disk; the report is under 'partial' (--json)", \
        "the system's words, once, and what to do"
    assert [row["card"] for row in error["partial"]["cards"]] == ["tiny-base", "tiny-base-nft", "tiny-base-nft-1step"]


def test_a_rerun_skips_finished_stages_and_a_changed_recipe_is_refused(examples, tmp_path):
    assert run(examples, tmp_path, "--stop-after", "distill").exit_code == 0
    weights = (tmp_path / "cards" / "tiny-base-nft-1step" / "transformer.safetensors").read_bytes()
    again = run(examples, tmp_path, "--stop-after", "distill")
    assert again.exit_code == 0, again.output
    assert all(s["skipped"] for s in json.loads(again.stdout)["stages"])
    assert (tmp_path / "cards" / "tiny-base-nft-1step" / "transformer.safetensors").read_bytes() == weights
    student = run(examples, tmp_path, "--compare", str(tmp_path / "cards" / "tiny-base-nft-1step"))  # a row already
    assert student.exit_code == 2
    assert "is the card the flywheel writes (tiny-base-nft-1step)" in json.loads(student.stdout)["error"]["message"]
    changed = run(examples, tmp_path, "--stop-after", "distill", overrides=[*TINY, "distill.optim.lr=1e-3"])
    assert changed.exit_code == 2
    assert "not made by this stage's recipe" in json.loads(changed.stdout)["error"]["message"]
    forced = run(examples, tmp_path, "--stop-after", "distill", "--force", overrides=[*TINY, "distill.optim.lr=1e-3"])
    assert [s["skipped"] for s in json.loads(forced.stdout).get("stages", [])] == [True, False], forced.stdout
    assert load_card(tmp_path / "cards" / "tiny-base-nft-1step").manifest.recipe.hyperparameters["optim"]["lr"] == 1e-3
    recipe = flywheel_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), steps=1,
                             overrides=[*TINY, "rl.optim.lr=1e-3"], out_dir=tmp_path / "cards")
    with pytest.raises(BadInput, match="not made by this stage's recipe"):  # the API too: replacing takes force=True
        flywheel(recipe, command="c", out_dir=tmp_path / "cards", run_dir=tmp_path / "run", stop_after="rl",
                 judge=str(examples / "tiny-judge"), held_out_judge=None, data=str(tmp_path / "idx"))
    manifest = tmp_path / "cards" / "tiny-base-nft" / "card.yaml"
    manifest.write_text(manifest.read_text() + "broken: [\n")  # a stage card a hand or a disk damaged: said so
    damaged = run(examples, tmp_path, "--stop-after", "distill")
    assert damaged.exit_code == 2
    assert "exists but is not a card that loads (" in json.loads(damaged.stdout)["error"]["message"]
    assert "card.yaml:" in json.loads(damaged.stdout)["error"]["message"], "located"


def test_a_gan_student_trained_on_other_images_is_no_stage_to_skip(examples, tmp_path):
    gan = [*TINY, "distill.loss.gan=true"]
    assert run(examples, tmp_path, "--stop-after", "distill", overrides=gan).exit_code == 0
    first = load_card(tmp_path / "cards" / "tiny-base-nft-1step").manifest.recipe.fingerprint
    same = run(examples, tmp_path, "--stop-after", "distill", overrides=gan)
    assert [s["skipped"] for s in json.loads(same.stdout)["stages"]] == [True, True], same.output
    other = write_idx_folder(tmp_path / "other", seed=1)  # --data is no part of the recipe: its images are
    changed = run(examples, tmp_path, "--stop-after", "distill", "--data", str(other), overrides=gan)
    assert changed.exit_code == 2, changed.output
    message = json.loads(changed.stdout)["error"]["message"]
    assert "tiny-base-nft-1step exists but was not made by this stage's recipe and training images" in message
    replaced = run(examples, tmp_path, "--stop-after", "distill", "--data", str(other), "--force", overrides=gan)
    assert [s["skipped"] for s in json.loads(replaced.stdout).get("stages", [])] == [True, False], replaced.stdout
    assert load_card(tmp_path / "cards" / "tiny-base-nft-1step").manifest.recipe.fingerprint != first


def test_a_run_stopped_after_the_rl_stage_goes_on_at_distill(examples, tmp_path):
    first = run(examples, tmp_path, "--stop-after", "rl")
    assert first.exit_code == 0, first.output
    assert [s["stage"] for s in json.loads(first.stdout)["stages"]] == ["rl"]
    named = {k: json.loads(first.stdout)[k] for k in ("judge", "held_out_judge", "platform")}  # as the eval stage's
    assert named == {"judge": "tiny-judge", "held_out_judge": "tiny-referee", "platform": named["platform"]}
    assert re.fullmatch(r"cpu/\w+", named["platform"]), named
    assert not (tmp_path / "cards" / "tiny-base-nft-1step").exists()
    tuned = (tmp_path / "cards" / "tiny-base-nft" / "transformer.safetensors").read_bytes()
    second = run(examples, tmp_path, "--stop-after", "distill", "--resume")
    assert second.exit_code == 0, second.output
    stages = json.loads(second.stdout)["stages"]
    assert [(s["stage"], s["skipped"]) for s in stages] == [("rl", True), ("distill", False)]
    assert (tmp_path / "cards" / "tiny-base-nft" / "transformer.safetensors").read_bytes() == tuned
    for stop in ("rl", "distill"):  # for people: where it stopped, and how to go on
        said = run(examples, tmp_path, "--stop-after", stop, json_=False)
        assert said.stdout == f"stopped after {stop}; the same command without --stop-after goes on from there\n"


def test_a_distill_checkpoint_of_a_replaced_rl_card_is_not_resumed(examples, tmp_path):
    """--force --resume after the rl stage's recipe changed: the rl card is made again, and the distill stage's
    checkpoint, trained from the old one, is a run of other parents — removed, not continued (its recipe alone is
    unchanged)."""
    import shutil

    from cardtool.core.cards.weight_files import sha256_file

    assert run(examples, tmp_path, "--stop-after", "distill").exit_code == 0
    student = tmp_path / "cards" / "tiny-base-nft-1step" / "transformer.safetensors"
    old = sha256_file(student)
    assert (tmp_path / "run" / "distill" / "checkpoint.safetensors").is_file()
    shutil.rmtree(student.parent)
    again = run(examples, tmp_path, "--stop-after", "distill", "--force", "--resume",
                overrides=[*TINY, "rl.optim.lr=2e-4"])
    assert again.exit_code == 0, again.output
    assert [s["skipped"] for s in json.loads(again.stdout)["stages"]] == [False, False]
    assert sha256_file(student) != old, "the student of the new rl card, not the old one's resumed"


def test_a_run_stopped_after_rl_asks_nothing_of_the_distill_stage_it_does_not_run(examples, tmp_path):
    result = run(examples, tmp_path, "--stop-after", "rl", "--micro-batches", "2",
                 "--set", "distill.optim.batch_size=3")
    assert result.exit_code == 0, result.output


def test_without_run_dir_the_stages_run_under_runs_named_for_the_rl_card(examples, tmp_path, monkeypatch):
    data = write_idx_folder(tmp_path / "idx")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["flywheel", str(examples / "tiny-base"), "--reward", str(examples / "tiny-judge"),
                                      "--steps", "1", *[f"--set={o}" for o in TINY], "--out-dir", "cards",
                                      "--stop-after", "rl", "--judge", str(examples / "tiny-judge"), "--held-out-judge",
                                      str(tiny_referee(examples)), "--data", str(data), "--json"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "runs" / "tiny-base-nft-flywheel" / "rl").is_dir()


def test_a_killed_stage_resumes_from_its_checkpoint(examples, tmp_path):
    recipe = flywheel_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), steps=1,
                             overrides=[*TINY, "rl.optim.steps=4", "rl.train.checkpoint_every=2",
                                        "rl.train.log_every=1"],
                             out_dir=tmp_path / "cards")
    kwargs = dict(command="test", out_dir=tmp_path / "cards", run_dir=tmp_path / "run", held_out_judge=None,
                  judge=str(examples / "tiny-judge"), stop_after="rl")
    seen = []

    def killed_at_three(stage, entry):  # a kill after the checkpoint at update 2, before the card is written
        seen.append(entry["step"])
        if entry["step"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        flywheel(recipe, on_log=killed_at_three, **kwargs)
    assert (tmp_path / "run" / "rl" / "checkpoint.safetensors").is_file()
    assert not (tmp_path / "cards" / "tiny-base-nft").exists()
    seen.clear()
    flywheel(recipe, on_log=lambda stage, entry: seen.append(entry["step"]), resume=True, **kwargs)
    assert seen == [3, 4], "the resumed stage continues after its last checkpoint"
    card = load_card(tmp_path / "cards" / "tiny-base-nft")
    assert card.manifest.recipe.fingerprint == recipe_fingerprint(recipe.rl)


@pytest.mark.parametrize("args, message", [
    (["--set", "optim.steps=3"], "names its stage"),
    (["--stop-after", "train"], "--stop-after must be one of"),
    (["--per-class", "0"], "--per-class"),
    (["--per-class", "10001"], "at most 100,000 (--per-class 10,000)"),  # before the two training stages
    # the distill stage's recipe is checked before the rl stage runs, not after its hours
    (["--set", "distill.loss.gan_t_range=[0.5, 0.1]"], "gan_t_range must be [LO, HI]"),
    (["--set", "distill.data.bogus=1"], "unknown data.bogus"),
    (["--set", "rl.loss.beta=0"], "loss.beta: Input should be greater than 0"),
    (["--held-out-judge", str(EXAMPLE_CARDS / "tiny-base")], "card 'tiny-base' is not a reward"),  # not at the end
    # the reward card measures the reward again, not what the policy was not trained on
    (["--held-out-judge", str(EXAMPLE_CARDS / "tiny-judge")], "is the reward card 'tiny-judge': a held-out judge"),
    (["--compare", str(EXAMPLE_CARDS / "tiny-judge")], "card 'tiny-judge' has no 'denoise' loop"),  # nor this
    # a card the table holds already would be evaluated again and shown twice: by its manifest, or repeated
    (["--compare", str(EXAMPLE_CARDS / "tiny-base" / "card.yaml")], "card.yaml is the base ("),
    (["--compare", str(EXAMPLE_CARDS / "tiny-rl"), "--compare", str(EXAMPLE_CARDS / "tiny-rl" / "card.toml")],
     "card.toml is given twice (--compare " + str(EXAMPLE_CARDS / "tiny-rl") + ")"),
    # a bfloat16 stage on numpy: said to lack a torch device, not bf16 compute (TINY's stages are float32)
    (["--device", "numpy", "--set", "rl.train.precision=bfloat16"], "the numpy platform has no torch device"),
    # the rl stage's batch of 2 splits into 2 micro-batches; the distill stage's of 3 does not: found before either
    (["--micro-batches", "2", "--set", "distill.optim.batch_size=3"], "distill.optim.batch_size 3 must split into 1 "
                                                                      "process(es) × 2 micro-batch(es)"),
    # named as the option, not as a recipe's card.id
    (["--out-prefix", "../x"], "--out-prefix '../x' cannot begin the new cards' ids (PREFIX-nft-Nstep)"),
    (["--out-prefix", ""], "--out-prefix '' cannot begin"),
    (["--out-prefix", "a" * 101], "give --out-prefix of at most 100 such characters"),
    (["--set", "distill.card.id=tiny-base-nft"], "the rl and distill stages would both write card 'tiny-base-nft'"),
])
def test_bad_input_is_a_clear_error(examples, tmp_path, args, message):
    result = run(examples, tmp_path, *args)
    assert result.exit_code == 2 and message in json.loads(result.stdout)["error"]["message"]
    assert not (tmp_path / "cards").exists() or not any((tmp_path / "cards").iterdir()), "no stage ran"


def test_the_eval_judge_as_the_held_out_judge_is_refused_before_any_stage(examples, tmp_path):
    referee = tiny_referee(examples)  # not the reward: but each card would be evaluated twice by it, as two judges
    result = run(examples, tmp_path, "--judge", str(referee), "--held-out-judge", str(referee))
    assert result.exit_code == 2
    assert "is the --judge card 'tiny-referee': its accuracy would be the eval's again" in \
        json.loads(result.stdout)["error"]["message"]
    assert not (tmp_path / "cards").exists() and not (tmp_path / "run").exists()


def test_the_new_cards_are_named_by_the_bases_id_and_one_too_long_to_begin_them_asks_for_an_out_prefix(examples,
                                                                                                       tmp_path):
    import shutil

    copy = shutil.copytree(examples / "tiny-base", tmp_path / "my base")  # its folder's name is no id; its own is
    assert flywheel_recipe(str(copy), str(examples / "tiny-judge")).rl.card.id == "tiny-base-nft"
    manifest = copy / "card.yaml"
    manifest.write_text(manifest.read_text().replace("id: tiny-base", "id: " + "b" * 101))
    with pytest.raises(BadInput, match=r"the base's name 'bbb.*' cannot begin the new cards' ids .* --out-prefix"):
        flywheel_recipe(str(copy), str(examples / "tiny-judge"))
    assert flywheel_recipe(str(copy), str(examples / "tiny-judge"), prefix="mine").rl.card.id == "mine-nft"
    longest = flywheel_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), prefix="a" * 100)
    assert longest.distill.card.id == "a" * 100 + "-nft-2step", "an id of 128 characters at most"


def test_a_flywheel_recipe_with_a_stray_key_is_a_located_error(examples, tmp_path):
    bad = tmp_path / "flywheel.yaml"
    bad.write_text("method: flywheel\nrl:\n  optim: {steps: 2}\ndistil:\n  optim: {steps: 3}\n")
    result = run(examples, tmp_path, "--recipe", str(bad))
    assert result.exit_code == 1
    problem = json.loads(result.stdout)["error"]["problems"][0]
    assert problem["line"] == 4 and problem["field"] == "distil"


@pytest.mark.parametrize("text, message", [  # each was a traceback (AttributeError, TypeError)
    ("rl:\n  method: [nft]\n", "flywheel rl.method: unknown rl method ['nft']; choose one of: diffusion_nft"),
    ("distill:\n  loss: 3\n", "loss: Input should be a valid dictionary"),
    ("distill:\n  loss: {student_steps: [2]}\n", "dmd2 recipe: loss.student_steps: Input should be a valid integer"),
    ("rl: [unclosed\n", "cannot read recipe: "),  # not YAML at all
    # a card: that is no mapping was dropped for the flywheel's own id, and the stage trained on without a word
    ("rl:\n  card: foo\n", "{path}'s rl section: card: Input should be a valid dictionary"),
    ("distill:\n  card: [1]\n", "{path}'s distill section: card: Input should be a valid dictionary"),
    ("rl:\n  optim: {lr: x}\n", "{path}'s rl section: optim.lr: Input should be a valid number"),
])
def test_a_flywheel_recipe_of_the_wrong_types_is_a_clear_error(examples, tmp_path, text, message):
    path = tmp_path / "flywheel.yaml"
    path.write_text(text)
    with pytest.raises(BadInput, match=re.escape(message.format(path=path))):
        flywheel_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), path=path)


def test_a_bad_stage_override_is_named_as_typed_and_a_bad_section_by_the_file(examples, tmp_path):
    base, judge = str(examples / "tiny-base"), str(examples / "tiny-judge")
    with pytest.raises(BadInput, match=re.escape("--set 'distill.optim.lr=x': optim.lr: Input")):
        flywheel_recipe(base, judge, overrides=["distill.optim.lr=x"])
    with pytest.raises(BadInput, match=re.escape("--set 'rl.optim.lr=-1': optim.lr: Input should be greater")):
        flywheel_recipe(base, judge, overrides=["rl.optim.lr=-1"])
    path = tmp_path / "flywheel.yaml"
    path.write_text("rl:\n  optim: {lr: x}\n")  # the file's mistake, beside a --set of another value
    with pytest.raises(BadInput, match=re.escape(f"recipe {path}'s rl section with --set rl.…: optim.lr: Input")):
        flywheel_recipe(base, judge, path=path, overrides=["rl.optim.steps=2"])


def test_the_students_steps_are_steps_or_set_then_the_files_then_two_and_name_it(examples, tmp_path):
    from cardtool.core.training.methods.dmd2 import DMD2Settings

    path = tmp_path / "flywheel.yaml"
    path.write_text("distill:\n  loss: {student_steps: 6}\n")

    def student(**options):
        recipe = flywheel_recipe(str(examples / "tiny-base"), str(examples / "tiny-judge"), **options).distill
        return recipe.card.id, DMD2Settings.from_recipe(recipe.loss).student_steps

    assert student() == ("tiny-base-nft-2step", 2)
    assert student(path=path) == ("tiny-base-nft-6step", 6)
    three = ["distill.loss.student_steps=3"]
    assert student(path=path, overrides=three) == ("tiny-base-nft-3step", 3)  # was 2: the flywheel's default won
    assert student(path=path, overrides=three, steps=3) == ("tiny-base-nft-3step", 3)
    with pytest.raises(BadInput, match=r"--steps 5 and a --set of loss.student_steps \(3\) give it two values"):
        student(path=path, overrides=three, steps=5)  # two values on one command line: a mistake, not a precedence
    assert student(path=path, steps=5) == ("tiny-base-nft-5step", 5), "over the file's"
    assert student(overrides=["distill.card.id=mine"]) == ("mine", 2)


def test_the_example_flywheel_recipe_spells_out_the_commands_defaults(examples):
    from helpers import REPO

    from cardtool.core.training.distill import distill_recipe
    from cardtool.core.training.rl import rl_recipe

    base, reward = str(examples / "tiny-base"), str(examples / "tiny-judge")
    example = flywheel_recipe(base, reward, steps=2, path=REPO / "examples" / "recipes" / "fashion-flywheel.yaml")
    assert example.rl == rl_recipe(base, reward, overrides=["card.id=tiny-base-nft"])
    assert example.distill == distill_recipe(example.distill.parents[0], steps=2,
                                             overrides=["card.id=tiny-base-nft-2step"])
    assert example.distill.parents == ["cards/tiny-base-nft"]


def test_a_fingerprint_names_parents_by_content_not_by_where_they_lie(examples, tmp_path):
    import os
    import shutil

    from cardtool.core.training.distill import distill_recipe

    teacher = tmp_path / "a" / "tiny-rl"
    shutil.copytree(examples / "tiny-rl", teacher)
    moved = tmp_path / "b" / "c" / "d" / "tiny-rl"
    shutil.copytree(examples / "tiny-rl", moved)
    for folder in (teacher, moved):  # the same card, extending tiny-base by a path that differs with its place
        where = os.path.relpath(examples / "tiny-base", folder)
        text = (folder / "card.toml").read_text().replace('extends = "tiny-base"', f'extends = "{where}"')
        (folder / "card.toml").write_text(text)
    assert load_card(teacher).weights_file("vae").resolve() == load_card(moved).weights_file("vae").resolve()
    assert load_card(teacher).manifest.components["vae"].weights != load_card(moved).manifest.components["vae"].weights

    def fingerprint(folder, lr="2e-5"):
        return recipe_fingerprint(distill_recipe(str(folder), steps=1, overrides=["card.id=s", f"optim.lr={lr}"]))

    assert fingerprint(teacher) == fingerprint(moved) != fingerprint(teacher, lr="3e-5")
