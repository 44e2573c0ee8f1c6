"""`cardtool generate`: PNGs with metadata, JSON, warnings, determinism and clear errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.images import read_png_metadata
from cardtool.core.sampling.planning import plan_requests
from cardtool.errors import CardValidationError


def run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def on_path(examples, monkeypatch):
    monkeypatch.setenv("CARDTOOL_PATH", str(examples))
    return examples


def test_generate_writes_pngs_with_metadata_and_a_grid(on_path, tmp_path):
    result = run("generate", "tiny-base", "-p", "an ankle boot", "-p", "a bag", "-n", "2", "--seed", "5",
                 "--steps", "3", "--out", str(tmp_path / "out"), "--grid", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(i["prompt"], i["seed"]) for i in report["images"]] == [
        ("an ankle boot", "5"), ("an ankle boot", "6"), ("a bag", "5"), ("a bag", "6")]
    first = report["images"][0]
    metadata = read_png_metadata(first["path"])
    assert metadata["card"] == "tiny-base" and metadata["steps"] == "3" and metadata["solver"] == "euler"
    assert metadata["guidance"] == "4.0", "the card's default guidance"
    assert metadata["guidance_interval"] == "0.0,1.0", "guided on every step unless the card says otherwise"
    assert set(json.loads(metadata["weights"])) == {"text_encoder", "vae", "transformer"}
    assert metadata["platform"] == report["platform"]
    assert report["grid"] and read_png_metadata(report["grid"])["card"] == "tiny-base"


def test_a_prompt_that_reads_like_json_is_reported_as_text(on_path, tmp_path):
    """--json decoded any metadata value starting with [ or {: the prompt "[a bag" crashed it after the images were
    written, and '{"x": 1}' came back as an object."""
    result = run("generate", "tiny-base", "-p", "[a bag", "-p", '{"x": 1}', "--negative-prompt", "[1, 2]",
                 "--steps", "2", "--adapter", "invert=0.5", "--out", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    images = json.loads(result.stdout)["images"]
    assert [i["prompt"] for i in images] == ["[a bag", '{"x": 1}']
    assert all(i["negative_prompt"] == "[1, 2]" for i in images)
    assert set(images[0]["weights"]) == {"text_encoder", "vae", "transformer"}, "a JSON field is its value"
    assert [(a["name"], a["scale"]) for a in images[0]["adapters"]] == [("invert", 0.5)]
    again = run("generate", "tiny-base", "-p", "{a coat}", "--steps", "2", "--image", images[0]["path"],
                "--strength", "0.5", "--out", str(tmp_path / "again"), "--json")
    assert again.exit_code == 0, again.output
    [image] = json.loads(again.stdout)["images"]
    assert image["prompt"] == "{a coat}" and image["image"]["source"] == images[0]["path"]


def test_a_paragraph_long_prompt_is_listed_cut_short_and_kept_whole_in_the_png(on_path, tmp_path):
    """The listing printed a 30,000-character prompt whole, once per image."""
    prompt = "a red bag " * 3000
    result = run("generate", "tiny-base", "-p", prompt, "-n", "2", "--steps", "1", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(f"{prompt[:80]}…', seed" in line and len(line) < 250 for line in lines), lines
    assert all(read_png_metadata(path)["prompt"] == prompt for path in tmp_path.glob("*.png"))


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_same_command_twice_gives_bit_identical_pngs(on_path, tmp_path, precision):
    outputs = []
    for attempt in ("a", "b"):
        out = tmp_path / attempt
        subprocess.run([sys.executable, "-m", "cardtool", "generate", "tiny-base", "-p", "a coat", "-n", "2",
                        "--steps", "3", "--solver", "sde", "--precision", precision, "--device", "cpu",
                        "--out", str(out)], check=True, capture_output=True, timeout=300)
        outputs.append({p.name: p.read_bytes() for p in sorted(out.glob("*.png"))})
    assert len(outputs[0]) == 2 and outputs[0] == outputs[1]


def test_guidance_interval_from_the_command_line_or_the_card(on_path, tmp_path):
    result = run("generate", "tiny-base", "-p", "a bag", "--steps", "2", "--guidance-interval", "0,0.5",
                 "--out", str(tmp_path / "one.png"))
    assert result.exit_code == 0, result.output
    assert read_png_metadata(tmp_path / "one.png")["guidance_interval"] == "0.0,0.5"
    card = load_card("tiny-base")
    card.manifest.loops["denoise"].defaults["guidance_interval"] = [0.2, 0.6]
    [request], _ = plan_requests(card, ["a bag"])
    assert request.guidance_interval == (0.2, 0.6)
    [request], _ = plan_requests(card, ["a bag"], guidance_interval=(0.0, 1.0))
    assert request.guidance_interval == (0.0, 1.0), "the command line wins over the card"
    manifest = card.file.read_text().replace("solver: euler}", "solver: euler, guidance_interval: late}")
    card.file.write_text(manifest)
    with pytest.raises(CardValidationError, match="loops.denoise.defaults.guidance_interval: Input should be a "
                                                  "valid tuple, got 'late'"):
        load_card(card.file)


def test_a_single_named_file_and_a_prompts_file(on_path, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# one a line\na sneaker\n\n")
    result = run("generate", "tiny-base", "--prompts-file", str(prompts), "--steps", "2", "--out",
                 str(tmp_path / "one.png"))
    assert result.exit_code == 0, result.output
    assert read_png_metadata(tmp_path / "one.png")["prompt"] == "a sneaker"
    assert str(tmp_path / "one.png") in result.stdout


def test_prompts_piped_on_standard_input_with_a_byte_order_mark(on_path, tmp_path):
    piped = CliRunner().invoke(app, ["generate", "tiny-base", "--prompts-file", "-", "--steps", "1", "--out",
                                     str(tmp_path), "--json"], input="\ufeffa bag\n# not one\na coat\n".encode())
    assert piped.exit_code == 0, piped.output
    assert [i["prompt"] for i in json.loads(piped.stdout)["images"]] == ["a bag", "a coat"]
    latin = CliRunner().invoke(app, ["generate", "tiny-base", "--prompts-file", "-"], input=b"caf\xe9\n")
    assert latin.exit_code == 2 and "standard input is not UTF-8 text" in latin.stderr
    closed = subprocess.run(["bash", "-c", f"{sys.executable} -m cardtool generate tiny-base --prompts-file - <&-"],
                            capture_output=True, text=True, timeout=60)
    assert closed.returncode == 2 and "standard input is closed" in closed.stderr, closed.stderr


def test_a_card_assuming_fixed_steps_warns_and_strict_refuses(on_path, tmp_path):
    result = run("generate", "tiny-distilled", "-p", "a bag", "--steps", "6", "--out", str(tmp_path))
    assert result.exit_code == 0 and "assumes 4 steps; sampling with 6" in result.stderr
    strict = run("generate", "tiny-distilled", "-p", "a bag", "--steps", "6", "--strict", "--out", str(tmp_path))
    assert strict.exit_code == 2 and "--strict" in strict.stderr
    assert run("generate", "tiny-distilled", "-p", "a bag", "--out", str(tmp_path)).stderr.count("warning") == 0


def test_a_prompt_past_the_text_encoders_tokens_is_warned_of_and_a_kept_image_costs_no_encoding(on_path, tmp_path):
    """Words past the encoder's max_length are cut: said (diffusers' pipelines say it too), also under --json, and
    of a negative prompt CFG reads; an image --skip-existing keeps is not encoded again for the warning."""
    long = "a dark grey pullover with long sleeves and a round neck on a white background"
    args = ["generate", "tiny-base", "-p", long, "-p", "a bag", "--steps", "1", "--out", str(tmp_path)]
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["warnings"] == [
        "a prompt fills all 16 tokens the text encoder reads (its max_length): words past them do not reach the model "
        f"— {long[:59] + '…'!r}; shorten it"]
    dress = "a pale blue summer dress with thin straps and a flowing skirt to the knee"
    negative = ["generate", "tiny-base", "-p", "a bag", "--negative-prompt", dress, "--steps", "1", "--json"]
    [said] = json.loads(run(*negative, "--out", str(tmp_path / "n")).stdout)["warnings"]
    assert said.startswith("a prompt fills all 16 tokens") and dress[:40] in said
    unguided = json.loads(run(*negative, "--guidance", "1", "--out", str(tmp_path / "u")).stdout)["warnings"]
    assert not any("fill" in warning for warning in unguided), "an unguided run reads no negative prompt"
    from cardtool.core.sampling import text_cache

    encoded = []
    real = text_cache.encode_prompts
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(text_cache, "encode_prompts", lambda instance, prompts, *a: (encoded.extend(prompts),
                                                                                      real(instance, prompts, *a))[1])
        kept = run(*args, "--skip-existing", "--json")
    assert kept.exit_code == 0 and json.loads(kept.stdout)["warnings"] == [] and encoded == []


@pytest.mark.parametrize(("args", "message"), [
    (["nope", "-p", "x"], "no card with id 'nope'"),
    (["tiny-base"], "no prompts"),
    (["tiny-base", "-p", "x", "--steps", "0"], "steps must be in 1…1000"),
    (["tiny-base", "-p", "x", "--solver", "heun"], "unknown solver"),
    # an empty value ("$UNSET" in a script) is refused, not taken as the card's default
    (["tiny-base", "-p", "x", "--solver", ""], "unknown solver ''"),
    (["tiny-base", "-p", "x", "--precision", ""], "unknown precision ''"),
    (["tiny-base", "-p", "x", "-n", "0"], "--num must be at least 1"),
    (["tiny-base", "-p", "x", "--max-batch", "0"], "--max-batch must be at least 1"),
    (["tiny-base", "-p", "x", "-n", "2", "--seed", str(2**63 - 1)], "seed 9223372036854775807 numbers the 2 images "
                                                                    "of a prompt up to seed 9,223,372,036,854,775,808, "
                                                                    "past 2⁶³ − 1; give a seed of at most "
                                                                    "9,223,372,036,854,775,806"),
    (["tiny-base", "-p", "x", "--seed", str(2**63)], "seed must be in [0, 2⁶³)"),
    (["tiny-base", "-p", "x", "-p", "y", "-n", "60000"], "got 2 prompts × 60,000 images; split the run"),
    (["tiny-base", "-p", "x", "-p", "y", "--out", "one.png"], "names one file"),
    (["tiny-base", "-p", "x", "--out", "/proc/no/such"], "cannot write to the output folder"),
    (["tiny-base", "-p", "x", "--out", "/proc/x.png"], "cannot write to the output folder /proc"),
    (["tiny-base", "-p", "x", "--out", "cat.JPG"], "images are written as PNG, which holds their metadata; name the "
                                                   "file cat.png, or give a folder"),  # was a folder named cat.JPG
    (["tiny-base", "-p", "x", "--out", "-"], "--out -: images are written as PNG files that carry their metadata, "
                                             "not to standard output"),  # was a folder named '-'
    (["tiny-base", "-p", "x", "--guidance", "nan"], "guidance must be a finite number"),
    (["tiny-base", "-p", "x", "--device", "tpu"], "unknown device"),
    (["tiny-base", "-p", "x", "--guidance-interval", "0.5"], "--guidance-interval takes LO,HI"),
    (["tiny-base", "-p", "x", "--guidance-interval", "0.5,0.1"], "0 ≤ LO ≤ HI ≤ 1"),
])
def test_bad_input_is_a_clear_message_and_exit_2(on_path, args, message):
    result = run("generate", *args)
    assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.output


def test_a_pipe_named_as_the_one_image_is_refused_and_kept(on_path, tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.png")
    result = run("generate", "tiny-base", "-p", "x", "--steps", "2", "--out", str(tmp_path / "pipe.png"))
    assert result.exit_code == 2 and "is not a regular file" in result.stderr and (tmp_path / "pipe.png").is_fifo()


def test_numpy_encodes_prompts_with_its_bert_forward_and_keeps_them_off_the_shared_cache(on_path, tmp_path,
                                                                                        monkeypatch):
    """numpy runs the BERT text encoder itself (its reference forward): a prompt no run encoded makes torch's image
    (within a grey level), and its features stay in the process — the cache's key holds no platform, so a torch run
    reading numpy's would make bits that depend on which platform encoded the prompt first."""
    from cardtool.cache import cache_dir

    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))
    args = ["generate", "tiny-base", "-p", "never encoded", "-n", "2", "--steps", "3", "--json"]
    numpy_run = run(*args, "--device", "numpy", "--out", str(tmp_path / "n"))
    assert numpy_run.exit_code == 0, numpy_run.output
    assert json.loads(numpy_run.stdout)["platform"] == "numpy/generic"
    assert not list((cache_dir() / "text").rglob("*.npz")), "numpy's encodings are not shared"
    torch_run = run(*args, "--device", "cpu", "--out", str(tmp_path / "t"))
    assert torch_run.exit_code == 0 and len(list((cache_dir() / "text").rglob("*.npz"))) == 2  # and the empty one
    made = {name: [read_png_pixels(i["path"]).astype(int) for i in json.loads(r.stdout)["images"]]
            for name, r in (("numpy", numpy_run), ("cpu", torch_run))}
    assert all(np.abs(a - b).max() <= 1 for a, b in zip(made["numpy"], made["cpu"], strict=True))


def test_numpy_reads_the_cache_for_a_text_encoder_it_cannot_run(on_path, tmp_path, monkeypatch):
    """numpy's text encoder is BERT's; for another kind (simulated here) it reads what a torch run encoded, and a
    prompt none did is refused, saying how to encode it."""
    from cardtool.backends import numpy_hf_encoder
    from cardtool.backends.registry import NoCellAvailable

    def other_kind(self, folder, max_length, dtype):
        raise NoCellAvailable(f"numpy's text encoder is BERT's; {folder} holds 'roberta'")

    monkeypatch.setattr(numpy_hf_encoder.NumpyBertEncoder, "__init__", other_kind)
    args = ["generate", "tiny-base", "-p", "a bag", "--steps", "2", "--guidance", "1", "--json"]
    torch_run = json.loads(run(*args, "--out", str(tmp_path / "t")).stdout)
    numpy_run = run(*args, "--device", "numpy", "--out", str(tmp_path / "n"))
    assert numpy_run.exit_code == 0, numpy_run.output
    assert json.loads(numpy_run.stdout)["platform"] == "numpy/generic"
    assert torch_run["images"][0]["prompt"] == "a bag"
    uncached = run("generate", "tiny-base", "-p", "never encoded", "--device", "numpy", "--out", str(tmp_path / "u"))
    assert uncached.exit_code == 2 and "encoded prompts from the cache, which holds none of 'never encoded'" \
        in uncached.stderr and "; run the same command once with --device cpu to encode them (at float32), then " \
        "again on numpy" in uncached.stderr
    monkeypatch.setenv("CARDTOOL_CACHE_MAX", "0")  # the CPU's run would keep nothing for numpy's: said, not looped
    uncached = run("generate", "tiny-base", "-p", "never encoded", "--device", "numpy", "--out", str(tmp_path / "u"))
    assert uncached.exit_code == 2 and "; unset CARDTOOL_CACHE_MAX=0, which keeps none on disk; run the same " \
        "command" in uncached.stderr
    monkeypatch.delenv("CARDTOOL_CACHE_MAX")
    many = [f"{k} " + "x" * 70 for k in range(5)]  # the first three named, each cut at 60 characters
    uncached = run("generate", "tiny-base", *(a for p in many for a in ("-p", p)), "--guidance", "1", "--device",
                   "numpy", "--json")
    message = json.loads(uncached.stdout)["error"]["message"]
    assert "which holds none of " + ", ".join(repr(p[:60]) for p in many[:3]) + " …; run" in message, message
    three = run("generate", "tiny-base", *(a for p in many[:3] for a in ("-p", p)), "--guidance", "1", "--device",
                "numpy", "--json")  # unguided: the empty prompt is not needed
    assert ", ".join(repr(p[:60]) for p in many[:3]) + "; run" in json.loads(three.stdout)["error"]["message"]


def test_a_loaded_card_generates_many_times_and_gives_the_one_shot_images(on_path, tmp_path):
    from cardtool.core.sampling.generate import LoadedCard, generate

    loaded = LoadedCard("tiny-base")
    first = loaded.generate(["a bag"], steps=2, out=tmp_path / "a")
    transformer = loaded.instance.component("transformer")
    second = loaded.generate(["a bag", "a coat"], steps=2, out=tmp_path / "b")
    assert loaded.instance.component("transformer") is transformer, "built once, kept across calls"
    assert loaded.cache.hits >= 1, "the second call reads the first call's prompt from the cache"
    once = generate("tiny-base", ["a bag"], steps=2, out=tmp_path / "c")
    pixels = [read_png_pixels(r.images[0].path) for r in (first, second, once)]
    assert all((p == pixels[0]).all() for p in pixels), "the same request gives the same image however it is run"


def test_loading_the_card_is_counted_apart_from_making_the_images(on_path, tmp_path, monkeypatch):
    """A first call builds the components it uses (the text encoder alone takes seconds): that time is
    `load_seconds`, left out of `seconds` and images/s, so the first call reports the rate of the next."""
    import time

    from cardtool.core.sampling import instance
    from cardtool.core.sampling.generate import LoadedCard

    resolve, built = instance.COMPONENTS.resolve, []

    def slow(*args, **kwargs):  # every build takes at least 0.2 s longer
        cell, build = resolve(*args, **kwargs)
        return cell, lambda *a, **k: (built.append(cell.key), time.sleep(0.2), build(*a, **k))[2]

    monkeypatch.setattr(instance.COMPONENTS, "resolve", slow)
    loaded = LoadedCard("tiny-base")
    started, made = time.perf_counter(), len(built)
    first = loaded.generate(["a bag"], steps=2, out=None)
    wall = time.perf_counter() - started
    assert len(built) - made >= 2 and first.load_seconds >= (len(built) - made) * 0.2, "the transformer and the VAE"
    assert 0 < first.seconds <= wall - first.load_seconds, "the builds are not in the making of the images"
    again = loaded.generate(["a coat"], steps=2, out=None)
    assert again.load_seconds == 0 and again.to_json()["load_seconds"] == 0, "nothing left to build"
    assert first.to_json()["images_per_second"] == round(1 / first.seconds, 3)
    result = run("generate", "tiny-base", "-p", "a bag", "--steps", "2", "--out", str(tmp_path / "b.png"))
    assert result.exit_code == 0 and "s loading the card)" in result.stderr, result.output


def test_out_none_writes_nothing_and_returns_the_images_pixels(on_path, tmp_path, monkeypatch):
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.errors import BadInput

    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    loaded = LoadedCard("tiny-base")
    held = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=None)
    assert list((tmp_path / "here").iterdir()) == [], "nothing written, not even the default folder"
    assert [image.path for image in held.images] == [None] * 4
    assert json.loads(json.dumps(held.to_json()))["images"][0]["path"] is None
    written = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=tmp_path / "out")
    for memory, file in zip(held.images, written.images, strict=True):
        assert memory.pixels.dtype == np.uint8 and memory.pixels.shape == (28, 28)
        assert (memory.pixels == read_png_pixels(file.path)).all() and (file.pixels == memory.pixels).all()
        assert memory.metadata == file.metadata, "the same image, settings and tag, written or not"
    kept = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=tmp_path / "out", skip_existing=True)
    assert kept.skipped == 4
    assert all((k.pixels == h.pixels).all() for k, h in zip(kept.images, held.images, strict=True))
    for switch in ("grid", "skip_existing"):
        with pytest.raises(BadInput, match=f"{switch} needs out"):
            loaded.generate("a bag", steps=1, out=None, **{switch: True})


def test_the_python_api_takes_one_prompt_as_a_string_and_refuses_wrong_types(on_path, tmp_path):
    """What the command line's parser guarantees, the API checks: a wrong type is BadInput naming the argument,
    never a TypeError deep in the loop, nor a string sampled as one image per character."""
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.errors import BadInput

    loaded = LoadedCard("tiny-base")
    one = loaded.generate("a bag", steps=1, out=tmp_path / "one")
    assert [image.metadata["prompt"] for image in one.images] == ["a bag"]
    for arguments, message in [({"num": 2.5}, "num must be a whole number"), ({"seed": 1.5}, "seed must be a whole"),
                               ({"steps": "3"}, "steps must be a whole number"), ({"steps": True}, "steps must be"),
                               ({"guidance": "2"}, "guidance must be a number"),
                               ({"best_of": 2.0, "reward": "tiny-judge"}, "best_of must be a whole number"),
                               ({"guidance_interval": "0,1"}, "guidance_interval must be two numbers"),
                               ({"guidance_interval": (0.5,)}, "guidance_interval must be two numbers"),
                               ({"guidance_interval": ("0", "1")}, "guidance_interval must be two numbers"),
                               ({"guidance_interval": (False, True)}, "guidance_interval must be two numbers"),
                               ({"adapters": [("invert", True)]}, r"adapters must be \(name, scale\) pairs"),
                               ({"adapters": [(None, 1.0)]}, r"adapters must be \(name, scale\) pairs"),
                               ({"adapters": {"invert": 1.0}}, r"adapters must be \(name, scale\) pairs"),
                               ({"adapters": [("invert",)]}, r"adapters must be \(name, scale\) pairs"),
                               ({"num": None}, "num must be a whole number"), ({"seed": None}, "seed must be"),
                               ({"out": 3}, "out must be a path"), ({"solver": 3}, "solver must be a name"),
                               ({"best_of": 2, "reward": 3}, "reward must be a name"),
                               ({"on_step": 3}, "on_step must be a function"),
                               ({"on_encode": "print"}, "on_encode must be a function of \\(encoded, prompts\\)"),
                               ({"fuse": np.zeros(2)}, "fuse must be True or False"),
                               ({"grid": "yes"}, "grid must be True or False")]:
        with pytest.raises(BadInput, match=message):
            loaded.generate(["a bag"], **{"out": tmp_path / "bad", **arguments})
    with pytest.raises(BadInput, match="prompts must be a list of strings"):
        loaded.generate(None, out=tmp_path / "bad")
    with pytest.raises(BadInput, match="steps must be a whole number"):  # one prompt as a string: checked alike
        loaded.generate("a bag", steps="3", out=tmp_path / "bad")
    with pytest.raises(BadInput, match="cache must be a TextFeatureCache"):
        LoadedCard("tiny-base", cache={})
    with pytest.raises(BadInput, match="precision must be a name"):
        LoadedCard("tiny-base", precision=["bfloat16"])
    with pytest.raises(BadInput, match="a card is named by its id, folder or manifest file, got None"):
        LoadedCard(None)
    with pytest.raises(BadInput, match="checksums and adapters are True or False, got False and 'no'"):
        load_card("tiny-base", adapters="no")
    with pytest.raises(BadInput, match="a card is named by its id, folder or manifest file, got 5"):
        loaded.reward(5)  # a reward named by something that is not a name: the same message, not a TypeError
    assert not (tmp_path / "bad").exists()
    # numpy's scalars are numbers like Python's
    report = loaded.generate("a bag", num=np.int64(2), seed=np.int64(3), steps=np.int32(1), out=tmp_path / "np")
    assert [image.metadata["seed"] for image in report.images] == ["3", "4"]


def read_png_pixels(path):
    from PIL import Image

    return np.asarray(Image.open(path))


def test_a_long_generation_writes_its_images_wave_by_wave_and_a_signal_keeps_the_finished_ones(on_path, tmp_path,
                                                                                               interactive_signals):
    """Requests are made in waves of --max-batch, each written when done: SIGTERM (a scheduler's preemption) or
    Ctrl-C lets the wave in flight finish and be written, then stops with exit 143 / 130 and kind `interrupted`;
    the waves give the images one batch gives, and progress counts across them."""
    import os
    import signal

    from cardtool.core.interrupt import Interrupted
    from cardtool.core.sampling.generate import LoadedCard

    loaded = LoadedCard("tiny-base")
    prompts = ["a bag", "a coat", "a dress"]
    whole = loaded.generate(prompts, num=2, steps=2, out=tmp_path / "whole")
    seen = []
    waves = loaded.generate(prompts, num=2, steps=2, max_batch=4, out=tmp_path / "waves",
                            on_step=lambda done, total: seen.append((done, total)))
    assert [i.path.name for i in waves.images] == [i.path.name for i in whole.images]
    assert all((read_png_pixels(a.path) == read_png_pixels(b.path)).all()
               for a, b in zip(whole.images, waves.images, strict=True)), "waves give one batch's images"
    assert seen[-1] == (12, 12) and [d for d, _ in seen] == sorted(d for d, _ in seen), "6 requests × 2 steps"

    def stop_after_the_first_wave(done, total):
        if done == 8:  # the first wave of 4 requests has made its 2 steps
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as stopped:
        loaded.generate(prompts, num=2, steps=2, max_batch=4, out=tmp_path / "cut", on_step=stop_after_the_first_wave)
    assert stopped.value.kind == "interrupted" and stopped.value.exit_code == 143
    assert "SIGTERM after 4 of 6 images: those are written in" in str(stopped.value)
    assert sorted(p.name for p in (tmp_path / "cut").glob("*.png")) == sorted(i.path.name for i in whole.images[:4])
    assert signal.getsignal(signal.SIGTERM) is before, "the handler in place before is back"
    with pytest.raises(Interrupted) as stopped:
        loaded.generate(prompts, num=2, steps=2, max_batch=4, out=None, on_step=stop_after_the_first_wave)
    assert "SIGTERM after 4 of 6 images: none is written (out=None)" in str(stopped.value)


def test_file_names_tell_prompts_apart_in_any_script(on_path, tmp_path):
    from cardtool.core.sampling.generate import LoadedCard
    from cardtool.core.sampling.outputs import prompt_slug

    assert prompt_slug("An ankle boot!") == "an-ankle-boot" and prompt_slug(" ") == "unconditional"
    assert prompt_slug("连衣裙") != prompt_slug("运动鞋") and prompt_slug("连衣裙").startswith("prompt-")
    assert prompt_slug("a long prompt " * 5) == "a-long-prompt-" * 2 + "a-long-promp", "its first 40 characters"
    first = LoadedCard("tiny-base").generate("连衣裙", steps=1, out=tmp_path)
    second = LoadedCard("tiny-base").generate("运动鞋", steps=1, out=tmp_path)
    assert first.images[0].path != second.images[0].path, "a second prompt in another script does not overwrite"
    assert len(list(tmp_path.glob("*.png"))) == 2


def test_a_settings_tag_depends_on_the_settings_not_on_their_order_nor_the_version_that_wrote_it():
    """The tag ends each file name: `--skip-existing` and a re-run find an image by it, so it must not change with the
    order metadata is assembled in, nor between versions of cardtool (the value is pinned)."""
    from cardtool.core.sampling.outputs import settings_tag

    settings = {"card": "x", "prompt": "une robe légère", "seed": "0"}
    assert settings_tag(settings) == settings_tag(dict(reversed(settings.items()))) == "294bfb1b"
    assert settings_tag({**settings, "seed": "1"}) != "294bfb1b"


def test_an_existing_folder_named_like_a_png_is_written_into(on_path, tmp_path):
    (tmp_path / "shots.png").mkdir()
    folder = tmp_path / "shots.png"
    result = run("generate", "tiny-base", "-p", "a bag", "-n", "2", "--steps", "1", "--out", str(folder))
    assert result.exit_code == 0, result.output
    assert len(list(folder.glob("tiny-base-*.png"))) == 2


def test_a_run_with_other_settings_never_overwrites_an_earlier_image(on_path, tmp_path):
    from cardtool.core.sampling.generate import LoadedCard

    loaded = LoadedCard("tiny-base")
    runs = [dict(steps=2), dict(steps=3), dict(steps=2, guidance=2.0), dict(steps=2, shift=2.0),
            dict(steps=2, precision="bfloat16"), dict(steps=2, best_of=2, reward=str(on_path / "tiny-judge")),
            dict(steps=2, adapters=[("invert", 0.5)]), dict(steps=2, adapters=[("invert", 1.0)]),
            dict(steps=2, negative_prompt="a coat"), dict(steps=2, solver="dpmpp_2m")]
    made = [loaded.generate("a bag", out=tmp_path, **settings).images[0] for settings in runs]
    assert len({image.path for image in made}) == len(runs), "each setting is in the file name's tag"
    assert sorted(tmp_path.glob("*.png")) == sorted(image.path for image in made), "every earlier image is kept"
    for image in made:
        assert read_png_metadata(image.path)["steps"] == image.metadata["steps"], "each file holds its own run"
    again = loaded.generate("a bag", out=tmp_path, steps=2).images[0]
    assert again.path == made[0].path and len(list(tmp_path.glob("*.png"))) == len(runs), "the same call, same file"


def huge_png_header(tag: str) -> bytes:
    """A PNG of 60,000 × 60,000 pixels in a few hundred bytes: its header, a text chunk and a short IDAT."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 60_000, 60_000, 8, 0, 0, 0, 0))
            + chunk(b"tEXt", b"tag\0" + tag.encode()) + chunk(b"IDAT", zlib.compress(bytes(1000)))
            + chunk(b"IEND", b""))


def test_a_png_declaring_billions_of_pixels_is_refused_as_a_value_error(tmp_path):
    from cardtool.core.sampling.images import read_png

    (tmp_path / "huge.png").write_bytes(huge_png_header("x"))
    for pixels in (True, False):
        with pytest.raises(ValueError, match="pixels"):
            read_png(tmp_path / "huge.png", pixels)


def test_skip_existing_makes_only_the_images_an_earlier_run_did_not_leave(on_path, tmp_path):
    from cardtool.core.sampling.generate import LoadedCard

    loaded = LoadedCard("tiny-base")
    first = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=tmp_path)
    paths = [image.path for image in first.images]
    original = {p: p.read_bytes() for p in paths}
    paths[1].unlink()  # an interrupted run never wrote it
    paths[2].write_bytes(b"not a png")  # nor this one, whole
    stamps = {p: p.stat().st_mtime_ns for p in (paths[0], paths[3])}
    again = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=tmp_path, skip_existing=True, grid=True)
    assert [image.path for image in again.images] == paths and again.skipped == 2
    assert {p: p.read_bytes() for p in paths} == original, "the two made again are the images they were"
    paths[1].write_bytes(huge_png_header(first.images[1].metadata["tag"]))  # a small file declaring 3.6 G pixels
    again = loaded.generate(["a bag", "a coat"], num=2, steps=2, out=tmp_path, skip_existing=True, grid=True)
    assert [image.path for image in again.images] == paths and again.skipped == 3
    assert {p: p.read_bytes() for p in paths} == original, "the two made again are the images they were"
    assert {p: p.stat().st_mtime_ns for p in (paths[0], paths[3])} == stamps, "the two kept are not rewritten"
    assert again.images[0].metadata == first.images[0].metadata, "a kept image is reported with its metadata"
    other = loaded.generate(["a bag"], num=1, steps=3, out=tmp_path, skip_existing=True)
    assert other.skipped == 0 and other.images[0].path not in paths, "other settings are other images"
    assert json.loads(json.dumps(again.to_json()))["skipped"] == 3
    rate = again.to_json()["images_per_second"]  # of the one image made: the kept ones took no time
    assert rate == round(1 / again.seconds, 3)


def test_a_grid_of_many_images_shows_a_bounded_part_of_them(on_path, tmp_path, monkeypatch):
    from cardtool.core.sampling import generate
    from cardtool.core.sampling.generate import LoadedCard

    monkeypatch.setattr(generate, "GRID_SIDE", 2)
    shown = []
    real = generate.grid_image
    monkeypatch.setattr(generate, "grid_image", lambda rows: (shown.extend(rows), real(rows))[1])
    report = LoadedCard("tiny-base").generate(["a bag", "a coat", "a dress"], num=3, steps=1, out=tmp_path, grid=True)
    assert len(report.images) == 9, "every image is written"
    assert [(prompt, len(row)) for prompt, row in shown] == [("a bag", 2), ("a coat", 2)]
    assert any("the grid shows at most 2 images of each of the first 2 prompts" in w for w in report.warnings)


def test_off_a_terminal_a_long_run_logs_progress_lines(on_path, tmp_path, monkeypatch):
    """A log or CI gets a line every LINE_EVERY seconds (here every step's report) with what is done and left; the
    --json document on stdout stays one document."""
    from cardtool.cli.output import LateProgress

    monkeypatch.setattr(LateProgress, "LINE_EVERY", 0.0)
    result = run("generate", "tiny-base", "-p", "a bag", "-n", "3", "--steps", "4", "--max-batch", "2",
                 "--out", str(tmp_path / "out"), "--json")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("denoising ")]
    assert lines and all("of 12 request-steps" in line and "elapsed" in line and "left" in line for line in lines)
    assert len(json.loads(result.stdout)["images"]) == 3


def test_a_prompt_typed_under_an_ascii_locale_is_the_prompt_typed(on_path, tmp_path):
    """Python decoding the command line as ASCII (C locale, coercion off) hands `-p "a café bag"` over as lone
    surrogates, one a byte; its UTF-8 is the prompt (as from a prompts file). Bytes that are not UTF-8 stay refused."""
    ascii_argv = "a café bag".encode().decode("ascii", "surrogateescape")
    result = run("generate", "tiny-base", "-p", ascii_argv, "--negative-prompt", "naïve".encode().decode(
        "ascii", "surrogateescape"), "--steps", "1", "--out", str(tmp_path / "a"), "--json")
    assert result.exit_code == 0, result.output
    metadata = read_png_metadata(json.loads(result.stdout)["images"][0]["path"])
    assert (metadata["prompt"], metadata["negative_prompt"]) == ("a café bag", "naïve")
    (tmp_path / "prompts.txt").write_text("a café bag\n", encoding="utf-8")
    typed = run("generate", "tiny-base", "--prompts-file", str(tmp_path / "prompts.txt"), "--negative-prompt", "naïve",
                "--steps", "1", "--out", str(tmp_path / "b"), "--json")
    [a], [b] = (json.loads(r.stdout)["images"] for r in (result, typed))
    assert Path(a["path"]).name == Path(b["path"]).name and Path(a["path"]).read_bytes() == Path(b["path"]).read_bytes()
    refused = run("generate", "tiny-base", "-p", b"a \xff bag".decode("ascii", "surrogateescape"), "--steps", "1",
                  "--out", str(tmp_path / "c"))
    assert refused.exit_code == 2 and "not valid UTF-8" in refused.output


def test_a_folder_whose_name_is_not_utf8_gets_the_images_and_a_json_report(on_path, tmp_path):
    """A Linux file name may hold any byte; the command line hands a non-UTF-8 one over as U+DC80–U+DCFF. The images
    go into that folder, and --json writes the path with the byte as the text \\udcXX (as messages print it) —
    not an error document and exit 1 after the work was done."""
    folder = os.fsdecode(bytes(tmp_path) + b"/caf\xe9")
    result = run("generate", "tiny-base", "-p", "a bag", "--steps", "1", "--out", folder, "--json")
    assert result.exit_code == 0, result.output
    [image] = json.loads(result.stdout)["images"]
    assert image["path"].startswith(f"{tmp_path}/caf\\udce9/tiny-base-000-a-bag-seed0-")
    assert os.listdir(bytes(tmp_path) + b"/caf\xe9") == [os.fsencode(Path(image["path"]).name)]
    missing = run("generate", "tiny-base", "-p", "a bag", "--steps", "1", "--image", folder + ".png", "--json")
    assert missing.exit_code == 2 and json.loads(missing.stdout)["error"]["message"].endswith("caf\\udce9.png does "
                                                                                              "not exist")


def test_the_prompts_encoding_before_the_first_image_reports_its_progress(on_path):
    """20,000 new prompts kept the built-in encoder busy for 73 s before the first image: the encoding
    reports each chunk of distinct prompts it has encoded (a repeated prompt is encoded once; a negative prompt, with
    guidance, is one more)."""
    from cardtool.core.sampling.generate import LoadedCard

    seen = []
    prompts = [f"a bag number {i}" for i in range(300)]
    report = LoadedCard("tiny-base").generate([*prompts, prompts[0]], steps=1, out=None,
                                              on_encode=lambda done, total: seen.append((done, total)))
    assert len(report.images) == 301 and seen == [(256, 301), (301, 301)], "300 prompts and the empty negative one"
