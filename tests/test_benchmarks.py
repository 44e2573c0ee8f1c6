"""The benchmark scripts run and write their JSON (their numbers are reported, never asserted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from cardtool.core.cards.discovery import builtin_dir as BUILTIN_DIR  # before the tests hide the built-in cards


def run_script(monkeypatch, name: str, *args: str) -> None:
    """`python benchmarks/NAME ARGS`, run in this process as Python runs the script (argv, its folder on sys.path,
    `__main__`, the built-in cards found): the worker has torch and transformers imported already, where a fresh
    process spends ~6 s of CPU on them. The thread count a script sets is put back."""
    import runpy

    import torch

    from cardtool.core.cards import discovery

    script = REPO / "benchmarks" / name
    threads = torch.get_num_threads()
    monkeypatch.setattr(discovery, "builtin_dir", BUILTIN_DIR)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as e:
        assert e.code in (None, 0), f"{name} exited with {e.code}"
    finally:
        torch.set_num_threads(threads)


def test_cli_startup_benchmark_writes_medians(tmp_path):
    out = tmp_path / "cli_startup.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "cli_startup.py"), "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    medians = json.loads(out.read_text())["median_s"]
    assert set(medians) == {"cardtool --help", "cardtool cards list --json",
                            "cardtool cards validate --checksums examples/cards cards"}
    assert all(t > 0 for t in medians.values())


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # diffusers' own bfloat16 RMSNorm
def test_peer_benchmark_times_every_method_and_writes_ratios(tmp_path, examples, monkeypatch):
    pytest.importorskip("diffusers")
    out = tmp_path / "peer.json"
    run_script(monkeypatch, "peer_diffusers.py", "--card", str(examples / "tiny-base"), "--steps", "2",
               "--batch-sizes", "1", "2", "--repeats", "1", "--startup-repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert {(r["method"], r["batch"], r["precision"]) for r in report["rows"]} == {
        (m, b, p) for m in ("generate warm", "generate cold", "command", "loop", "bare forward", "diffusers loop",
                            "WanPipeline") for b in (1, 2) for p in ("float32", "bfloat16")}
    assert all(r["median_s"] > 0 for r in report["rows"])
    assert report["ratios"]["float32 B=2"]["generate warm / diffusers loop"] > 0
    assert report["startup"]["ratio"] > 0


def test_cpu_tiers_benchmark_times_each_tier_and_precision(tmp_path, examples):
    out = tmp_path / "tiers.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_tiers.py"), "--card", str(examples / "tiny-base"),
                    "--tiers", "avx2", "zen4", "--batch-sizes", "1", "2", "--precisions", "float32", "--steps", "2",
                    "--rounds", "1", "--runs", "2", "--out", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert {(r["batch"], r["tier"], r["precision"]) for r in report["rows"]} == {
        (b, t, "float32") for b in (1, 2) for t in ("avx2", "zen4")}
    assert all(r["median_s"] > 0 and len(r["runs_s"]) == 2 for r in report["rows"])
    assert set(report["ratios"]) == {"zen4 / avx2, float32, B=1", "zen4 / avx2, float32, B=2"}


def test_distill_quality_counts_model_evaluations_and_reads_recorded_evals(tmp_path, examples, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from distill_quality import evaluations_per_image

    assert evaluations_per_image(20, 4.0, [0.0, 0.4]) == 28, "σ = 0.4, 0.35, …, 0.05 are guided"
    assert evaluations_per_image(4, 1.0, [0.0, 1.0]) == 4 and evaluations_per_image(4, 2.0, [0.0, 1.0]) == 8
    row = {"steps": 20, "guidance": 4.0, "guidance_interval": [0.0, 0.4], "precision": "float32",
           "class_accuracy": 0.9, "fid_fmnist": 15.0, "images_per_second": 80.0}
    for name, rows in (("tiny-base", [row, {**row, "precision": "bfloat16"}]),
                       ("tiny-distilled", [{**row, "steps": 4, "guidance": 1.0}])):
        (examples / name / "eval.json").write_text(json.dumps({"rows": rows}))
    out, plot = tmp_path / "quality.json", importlib.util.find_spec("matplotlib") is not None  # the bench extra
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "distill_quality.py", "--teacher", "tiny-base",
               "--students", "tiny-distilled", "--out", str(out), *(["--plot", str(tmp_path / "q.png")] * plot))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["card"], r["role"], r["evaluations_per_image"]) for r in rows] == [
        ("tiny-base", "teacher", 28), ("tiny-distilled", "student", 4)], "float32 rows only"
    assert not plot or (tmp_path / "q.png").stat().st_size > 0


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_distill_checkpoint_evaluates_a_runs_generator(tmp_path, examples, ema, monkeypatch):
    """The generator the card would get: its moving average when the run keeps one."""
    from helpers import write_idx_folder

    from cardtool.core.training.distill import distill, distill_recipe

    sets = ["optim.steps=2", "optim.batch_size=2", "train.precision=float32", "train.checkpoint_every=2",
            f"train.ema={ema}"]
    distill(distill_recipe(str(examples / "tiny-base"), None, sets, 2), command="c", out=tmp_path / "s",
            run_dir=tmp_path / "run", evaluate=False)
    out = tmp_path / "curve.json"
    run_script(monkeypatch, "distill_checkpoint.py", str(tmp_path / "run"),
               "--teacher", str(examples / "tiny-base"), "--steps", "2", "--per-class", "1", "--out", str(out),
               "--data", str(write_idx_folder(tmp_path / "idx")))
    [entry] = json.loads(out.read_text())
    assert entry["iteration"] == 2 and entry["steps"] == 2 and entry["images"] == 10
    assert entry["weights"] == ("ema" if ema else "model")
    assert 0 <= entry["class_accuracy"] <= 1


def test_rl_efficiency_runs_both_methods_to_the_budget_and_writes_their_curves(tmp_path, examples, monkeypatch):
    from helpers import tiny_referee, write_idx_folder

    out = tmp_path / "rl.json"
    tiny = ["optim.batch_size=2", "loss.group_size=2", "loss.rollout_steps=2", "train.precision=float32"]
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    tiny_referee(examples)
    run_script(monkeypatch, "rl_efficiency.py", "--base", "tiny-base",
               "--reward", "tiny-judge", "--held-out-judge", "tiny-referee", "--budget", "0", "--watch-every", "1",
               "--per-class", "1", "--data", str(write_idx_folder(tmp_path / "idx")), "--out", str(out),
               *(f"--set={o}" for o in tiny))
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == ["diffusion_nft", "flow_grpo"]
    for result in report["results"]:
        assert [p["update"] for p in result["points"]] == [0, 1], "a start point, then stop at the budget"
        assert result["points"][1]["samples"] == 4 and 0 <= result["points"][1]["held_out_accuracy"] <= 1


def test_best_of_n_benchmark_measures_plain_and_best_of_n_per_card(tmp_path, examples, monkeypatch):
    from helpers import write_idx_folder

    out = tmp_path / "best.json"
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "best_of_n.py", "--card", "tiny-base", "--card",
               "tiny-distilled", "--reward", "tiny-judge", "--held-out-judge", "tiny-judge", "--n", "3",
               "--per-class", "1", "--data", str(write_idx_folder(tmp_path / "idx")), "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["card"], r["mode"]) for r in rows] == [("tiny-base", "plain"), ("tiny-base", "best-of-3"),
                                                      ("tiny-distilled", "plain"), ("tiny-distilled", "best-of-3")]
    assert [r["model_evaluations_per_image"] for r in rows] == [60, 180, 4, 12]
    for plain, best in (rows[:2], rows[2:]):
        # candidate 0 is the plain image, so the best of three never scores lower on the reward
        assert best["mean_reward"] >= plain["mean_reward"] and best["images"] == plain["images"] == 10


def test_adapter_throughput_benchmark_times_every_serving_mode(tmp_path, examples, monkeypatch):
    out = tmp_path / "adapters.json"
    run_script(monkeypatch, "adapters.py", "--card", str(examples / "tiny-base"),
               "--batch", "4", "--adapters", "2", "--steps", "2", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == [
        "no adapter", "mixed 2 LoRAs, one batch", "2 groups one after another, unfused",
        "2 groups one after another, each fused", "one shared LoRA, unfused", "one shared LoRA, fused",
        "no adapter, 2 groups one after another"]
    assert all(r["images_per_second"] > 0 for r in report["rows"]) and report["ratios"]["mixed / no adapter"] > 0
    assert report["ratios"]["no adapter: one batch / its groups one after another"] > 0
    round_ratios = report["spread"]["mixed / no adapter, per round"]
    assert 0 < round_ratios["min"] <= round_ratios["median"] <= round_ratios["max"]


def test_adapter_forward_benchmark_times_the_transformer_in_every_serving_mode(tmp_path, examples, monkeypatch):
    out = tmp_path / "adapters_forward.json"
    run_script(monkeypatch, "adapters_forward.py", "--card", str(examples / "tiny-base"), "--batch", "4",
               "--adapters", "2", "--rank", "2", "--forwards", "2", "--repeats", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == [
        "no adapter", "mixed 2 LoRAs, one batch", "2 groups one after another, unfused",
        "2 groups one after another, each fused", "one shared LoRA, unfused", "one shared LoRA, fused"]
    assert (report["batch"], report["adapters"], report["rank"], report["forwards"]) == (4, 2, 2, 2)
    assert set(report["ratios"]) == {"mixed / no adapter", "mixed / groups unfused", "mixed / groups fused",
                                     "fused / unfused (one shared LoRA)"}
    assert all(value > 0 for value in report["ratios"].values())
    assert all(r["median_s"] > 0 and r["images_per_second"] > 0 for r in report["rows"])


def test_adapter_effects_benchmark_measures_the_built_in_adapters(tmp_path, fashion_mnist, monkeypatch):
    out = tmp_path / "effects.json"
    run_script(monkeypatch, "adapter_effects.py", "--per-class", "1", "--control-images", "4", "--out", str(out))
    report = json.loads(out.read_text())
    assert [r["stack"] for r in report["lora"]][:3] == ["none", {"mirror": 0.5}, {"mirror": 1.0}]
    assert all(r["images"] == 10 for r in report["lora"]) and len(report["data"]) == 14
    mirrored = {r["data"]: r["shoes_pointing_right"] for r in report["data"]}
    # mirroring an image reverses which of the class mean and its mirror it is nearer
    assert mirrored["test images, mirror, real"] == pytest.approx(1 - mirrored["test images, none, real"], abs=1e-3)
    assert [r["control_scale"] for r in report["controlnet"]] == ["no control (base)", 0.5, 1.0]
    assert all(0 <= r["silhouette_iou"] <= 1 for r in report["controlnet"])


def test_image_to_image_benchmark_measures_each_strength(tmp_path, examples, monkeypatch):
    from helpers import write_idx_folder

    out = tmp_path / "i2i.json"
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "image_to_image.py", "--card", "tiny-base", "--judge",
               "tiny-judge", "--strengths", "0.2", "0.9", "--per-class", "1", "--data",
               str(write_idx_folder(tmp_path / "idx")), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["images"] == 10 and [r["strength"] for r in report["rows"]] == [0.2, 0.9]
    for row in report["rows"]:
        assert 0 <= row["prompt_class_accuracy"] <= 1 and 0 <= row["start_class_accuracy"] <= 1
        assert row["prompt_class_accuracy"] + row["start_class_accuracy"] <= 1, "one class a judgement"
        assert 0 < row["mean_abs_difference"] <= 255
    inpainted = report["inpainting"]
    assert (inpainted["masked_rows"], inpainted["kept_rows"]) == ("16-27", "0-13")
    assert 0 <= inpainted["prompt_class_accuracy"] <= 1 and inpainted["masked_rows_mean_abs_difference"] > 0


def test_model_soup_benchmark_measures_each_mix_at_each_guidance(tmp_path, examples, monkeypatch):
    from helpers import write_idx_folder

    out = tmp_path / "soup.json"
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "model_soup.py", "--base", "tiny-base", "--tuned",
               "tiny-rl", "--alpha", "0", "--alpha", "1.5", "--guidance", "1", "--guidance", "3", "--reward",
               "tiny-judge", "--held-out-judge", "tiny-judge", "--per-class", "1", "--data",
               str(write_idx_folder(tmp_path / "idx")), "--out", str(out))
    report = json.loads(out.read_text())
    assert [(r["alpha"], r["guidance"]) for r in report["rows"]] == [(0, 1), (0, 3), (1.5, 1), (1.5, 3)]
    for row in report["rows"]:
        assert row["images"] == 10 and row["class_accuracy"] == row["held_out_accuracy"], "one judge twice"
        assert 0 <= row["mean_reward"] <= 1 and row["fid_fmnist"] >= 0
    assert report["rows"][0]["fid_fmnist"] != report["rows"][2]["fid_fmnist"], "another α, other weights"


def test_lora_extract_benchmark_measures_each_tuned_card_and_its_loras(tmp_path, examples, monkeypatch):
    from helpers import write_idx_folder

    out = tmp_path / "lora.json"
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "lora_extract.py", "--base", "tiny-base", "--tuned",
               "tiny-rl", "--rank", "2", "--rank", "32", "--reward", "tiny-judge", "--held-out-judge",
               "tiny-judge", "--per-class", "1", "--data", str(write_idx_folder(tmp_path / "idx")), "--out",
               str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tuned"], r["rank"]) for r in rows] == [("tiny-rl", None), ("tiny-rl", 2), ("tiny-rl", 32)]
    assert 0 < rows[1]["kept"] < rows[2]["kept"] == 1.0 and 0 < rows[1]["linear_share"] <= 1
    assert all(r["images"] == 10 and 0 <= r["class_accuracy"] <= 1 for r in rows)


def test_caption_concept_benchmark_makes_the_folder_and_measures_base_and_lora(tmp_path, examples, monkeypatch):
    from helpers import write_idx_folder

    folder, out = tmp_path / "negative", tmp_path / "concept.json"
    env = {**os.environ, "CARDTOOL_PATH": str(examples)}
    run_script(monkeypatch, "caption_concept.py", "--make-folder", str(folder), "--images", "20", "--data",
               str(write_idx_folder(tmp_path / "idx")))
    rows = [json.loads(line) for line in (folder / "metadata.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[1]["text"].endswith(" in negative") and not rows[0]["text"].endswith("negative")
    subprocess.run([sys.executable, "-m", "cardtool", "train", "--recipe",
                    str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data", str(folder), "--set",
                    "data.transform=none", "--set", "model.adapter=negative", "--set", "card.id=tiny-negative",
                    "--set", "parents=[tiny-base]", "--set", "optim.steps=2", "--set", "optim.batch_size=4",
                    "--out", str(tmp_path / "tiny-negative"), "--run-dir", str(tmp_path / "run")],
                   check=True, capture_output=True, timeout=300, env=env)
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    run_script(monkeypatch, "caption_concept.py", "--card", str(tmp_path / "tiny-negative"), "--base", "tiny-base",
               "--judge", "tiny-judge", "--per-class", "1", "--out", str(out))
    cards = json.loads(out.read_text())["cards"]
    assert list(cards) == ["tiny-base", str(tmp_path / "tiny-negative")]
    for measured in cards.values():
        assert set(measured) == {"plain", "negative"}
        assert all(0 <= m["mean_intensity"] <= 255 and 0 <= m["class_accuracy"] <= 1 for m in measured.values())


def test_text_encoding_benchmark_times_both_ways_and_finds_the_same_features(tmp_path, examples, monkeypatch):
    out = tmp_path / "text.json"
    run_script(monkeypatch, "text_encoding.py", "--card", str(examples / "tiny-base"), "--prompts", "70",
               "--repeats", "1", "--threads", "1", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["same_features"] is True and report["prompts"] == 70
    assert all(len(report["seconds"][way][what]) == 1 and report["median_s"][way][what] > 0
               for way in ("alone", "grouped") for what in ("encode", "generate"))
    assert report["speedup"]["encode"] == pytest.approx(report["median_s"]["alone"]["encode"]
                                                        / report["median_s"]["grouped"]["encode"])


def test_free_text_benchmark_judges_each_phrasing_as_its_images_made_alone(tmp_path, examples, monkeypatch):
    import numpy as np

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from free_text import HELD_OUT, prompts
    from helpers import reading_judge

    from cardtool.backends.platform import Platform
    from cardtool.core.cards.loader import load_card
    from cardtool.core.evaluation.reward import FashionJudge
    from cardtool.core.prompts import training_prompts
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.core.sampling.instance import ModelInstance

    reader = reading_judge(examples)
    out = tmp_path / "free.json"
    run_script(monkeypatch, "free_text.py", "--card", str(examples / "tiny-base"), "--reward", str(reader),
               "--held-out-judge", str(examples / "tiny-judge"), "--per-prompt", "3", "--best-of", "2", "--out",
               str(out))
    report = json.loads(out.read_text())
    assert report["reward_reading"]["prompt_class_accuracy"] == 0.8833, "53 of the 60 phrasings read right"
    assert ["a warm parka", "sandal"] in report["reward_reading"]["misread"]
    plain, best = report["cards"]
    assert (plain["mode"], best["mode"]) == ("plain", "best-of-2")
    rows = plain["rows"]
    trained = {p.lower() for group in training_prompts() for p in group}
    assert len(rows) == len(best["rows"]) == 70 and [r["kind"] for r in rows].count("canonical") == 10
    assert not {r["prompt"].lower() for r in rows if r["kind"] == "held_out"} & trained
    assert plain["held_out"]["class_accuracy"] == pytest.approx(
        np.mean([r["class_accuracy"] for r in rows if r["kind"] == "held_out"]), abs=1e-4)
    # a row's accuracy is that of its own prompt's images: made alone and judged, they give the same number
    row = next(r for r in rows if r["prompt"] == "a wool jumper")
    judge = FashionJudge(ModelInstance(load_card(examples / "tiny-judge"), Platform.detect(), "float32"))
    images = np.stack([i.pixels for i in LoadedCard(examples / "tiny-base").generate(row["prompt"], num=3,
                                                                                     out=None).images])
    assert row["held_out_accuracy"] == round(float((judge.probabilities(images).argmax(1) == 2).mean()), 4)
    monkeypatch.setattr("free_text.HELD_OUT", (("a T-shirt", 0), *HELD_OUT))
    assert ("a T-shirt", 0, "held_out") not in prompts(), "a phrasing training holds is not held out"


def test_kill_fuzzer_stops_a_command_finishes_it_and_compares_every_file(tmp_path, monkeypatch):
    import signal

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from fuzz_kills import _files, fuzz

    report = fuzz(["merge"], 2, 0, [signal.SIGKILL, signal.SIGTERM], tmp_path / "scratch")
    assert report["counts"] == {"ok": 2} and [c["command"] for c in report["cases"]] == ["merge", "merge"]
    assert all(c["stopped_exit"] in (0, -9, -15, 143) for c in report["cases"])
    # a fuzzer started in the background passes SIGINT and SIGHUP on ignored: the command it stops must heed them
    import subprocess
    import sys

    from fuzz_kills import _heeding

    for signum in (signal.SIGINT, signal.SIGHUP):
        previous = signal.signal(signum, signal.SIG_IGN)
        try:
            ignored = f"import signal; print(signal.getsignal({int(signum)}) == signal.SIG_IGN)"
            shown = subprocess.run([sys.executable, "-c", ignored], capture_output=True, text=True,
                                   preexec_fn=_heeding).stdout
        finally:
            signal.signal(signum, previous)
        assert shown == "False\n", f"{signum.name} ignored in the command"
    # a finishing run that left a temporary, or other bytes, is told from one that did not
    import fuzz_kills

    finish = fuzz_kills._run

    def leaving(args, where, env):
        done = finish(args, where, env)
        if where.name == "0":
            (where / "soup" / ".card.yaml.1.tmp").write_text("")
        elif where.name == "1":
            (where / "soup" / "transformer.safetensors").write_bytes(b"other")
        return done

    monkeypatch.setattr(fuzz_kills, "_run", leaving)
    report = fuzz(["merge"], 2, 0, [signal.SIGKILL], tmp_path / "scratch-2")
    assert [c["outcome"] for c in report["cases"]] == ["stray", "differs"]
    assert [c["detail"] for c in report["cases"]] == ["soup/.card.yaml.1.tmp", "soup/transformer.safetensors"]
    # what the comparison sees: every file by its bytes, a card's recorded training time set aside, temporaries too
    for folder, seconds in (("a", "0.7"), ("b", "0.6")):
        (tmp_path / folder / "card").mkdir(parents=True)
        (tmp_path / folder / "card" / "card.yaml").write_text(
            f"id: x\nmetrics:\n  train_seconds: {seconds}\n  text_cache_hit_rate: {seconds}\n")
        (tmp_path / folder / "run").mkdir()
        (tmp_path / folder / "run" / "checkpoint.safetensors").write_text(folder)  # the run folder is not output
    assert _files(tmp_path / "a") == _files(tmp_path / "b") and list(_files(tmp_path / "a")) == ["card/card.yaml"]
    (tmp_path / "b" / "card" / "card.yaml").write_text("id: y\nmetrics:\n  train_seconds: 0.6\n")
    (tmp_path / "b" / ".card.123.tmp").mkdir()
    (tmp_path / "b" / ".card.123.tmp" / "w.safetensors").write_text("")
    assert _files(tmp_path / "a")["card/card.yaml"] != _files(tmp_path / "b")["card/card.yaml"]
    assert ".card.123.tmp/w.safetensors" in _files(tmp_path / "b")


def test_disk_fuzzer_fails_a_write_and_judges_what_the_failed_run_left(tmp_path, monkeypatch):
    """The kernel refuses writes past a file-size limit; a failed run that left half a file, a temporary or a
    traceback, or that said it succeeded without its files, is told from one that left only what the run without a
    limit writes and was finished by a rerun."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import fuzz_disk

    failing = fuzz_disk._failed

    def leaving(args, where, env, preexec):
        done = failing(args, where, env, preexec)
        if where.name == "0":
            (where / "soup").mkdir(exist_ok=True)
            (where / "soup" / "transformer.safetensors").write_bytes(b"half")
        elif where.name == "1":
            (where / "soup").mkdir(exist_ok=True)
            (where / "soup" / ".card.yaml.1-0.tmp").write_text("")
        elif where.name == "2":
            done.stderr += "Traceback (most recent call last):\n"
        elif where.name == "3":
            done.returncode, done.stderr = 0, ""
        return done

    monkeypatch.setattr(fuzz_disk, "_failed", leaving)
    report = fuzz_disk.fuzz(["merge"], 5, 1, ["fsize"], tmp_path / "scratch")
    cases = report["cases"]
    assert [c["outcome"] for c in cases] == ["partial", "stray", "traceback", "silent", "ok"], cases
    assert cases[0]["detail"] == "soup/transformer.safetensors" and "soup/card.yaml" in cases[3]["detail"]
    # the last run, left as it was: the write refused, said with what to do, then the rerun finished it
    assert cases[4]["failed_exit"] == 1 and cases[4]["said"].startswith(
        "error soup/transformer.safetensors: File too large — raise the file-size limit (ulimit -f)"), cases[4]
    # an eval report is compared by its rows less their timings; one holding some of the rows is what a stopped eval
    # keeps, one holding a row the unlimited run did not measure is not
    for folder, pace in (("a", 100.0), ("b", 7.5)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "report.json").write_text(json.dumps({"rows": [
            {"steps": 1, "fid_fmnist": 1.0, "images_per_second": pace}, {"steps": 2, "fid_fmnist": 0.5}]}))
    want = fuzz_disk._files(tmp_path / "a")
    assert fuzz_disk._files(tmp_path / "b") == want
    first = want["report.json"][5:].split(",")[0]
    assert fuzz_disk._kept("report.json", f"rows:{first}", want) and fuzz_disk._kept("report.json", "rows:", want)
    assert not fuzz_disk._kept("report.json", "rows:0123456789abcdef", want)
    assert not fuzz_disk._kept("one.png", "0123", {"one.png": "4567"})


def test_machine_limits_benchmark_runs_a_command_under_each_limit_and_names_the_outcome(tmp_path, monkeypatch):
    import resource

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from machine_limits import measure, outcome

    for threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):  # a many-core machine's thread stacks alone would
        monkeypatch.setenv(threads, "1")  # fill 300 MiB before torch is reached
    report = measure(["merge"], [300, 65536], 120, tmp_path)  # the second: room for any machine's threads
    low, high = report["runs"]
    assert (low["outcome"], low["exit"], high["outcome"], high["exit"]) == ("said", 1, "ran", 0), report
    assert low["said"].startswith("error out of memory (") and "memory limit of 300 MiB (ulimit -v)" in low["said"]
    assert report["counts"] == {"said": 1, "ran": 1}
    files = measure(["merge"], [resource.getrlimit(resource.RLIMIT_NOFILE)[0]], 120, tmp_path / "files", "files")
    assert (files["resource"], files["counts"], files["runs"][0]["limit_files"]) == \
        ("files", {"ran": 1}, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), files
    try:  # one task, the process alone: every pool fitted to it (as root, where a pids cgroup can be made)
        tasks = measure(["merge"], [1], 120, tmp_path / "tasks", "processes")
    except SystemExit as no_cgroup:
        print(f"processes not measured: {no_cgroup}")
    else:
        assert (tasks["counts"], tasks["runs"][0]["limit_tasks"]) == ({"ran": 1}, 1), tasks
    # how each kind of end is told apart
    assert outcome(1, "error out of memory (x)\n") == "said" and outcome(2, "error cannot load x\n") == "said"
    assert outcome(1, "Traceback (most recent call last):\n  …\nMemoryError\n") == "traceback"
    assert outcome(1, "error out of memory (x)\nException ignored in: <…>\nMemoryError\n") == "noise"
    assert outcome(-6, "terminate called after throwing an instance of 'std::bad_alloc'\n") == "killed"
    assert outcome(1, "libgomp: Thread creation failed: Resource temporarily unavailable\n") == "killed"
    assert outcome(0, "") == "ran"


def test_cpu_quota_benchmark_times_both_pool_settings_under_each_quota(tmp_path):
    out = tmp_path / "quota.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cpu_quota.py"), "--quotas", "1", "--rounds",
                           "1", "--out", str(out), "--", "platform", "detect"], capture_output=True, text=True,
                          timeout=300)
    if done.returncode and "cgroup" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["command"] == ["platform", "detect"] and [r["quota_cores"] for r in report["rows"]] == [None, 1.0]
    for row in report["rows"]:
        assert row["fitted"] > 0 and row["a thread a core"] > 0
        assert row["speedup"] == round(row["a thread a core"] / row["fitted"], 2)


def test_disk_fuzzer_imports_a_card_from_the_diffusers_folder_it_prepared(tmp_path, monkeypatch):
    """compose and import start from files no example card holds: the fuzzer makes them first, without a limit."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import fuzz_disk

    assert fuzz_disk.arguments("import", tmp_path)[2] == f"{tmp_path}/tiny-hf"
    report = fuzz_disk.fuzz(["import"], 1, 3, ["fsize"], tmp_path / "scratch")
    assert (tmp_path / "scratch" / "cards" / "tiny-rl-lora" / "card.yaml").is_file()
    case = report["cases"][0]
    assert case["outcome"] in ("ok", "passed"), case
    assert case["outcome"] == "passed" or case["said"].startswith("error imported/"), case
