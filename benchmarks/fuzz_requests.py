"""Fuzz requests: what users and scripts hand cardtool besides cards — `generate`'s options, the PNG metadata that
`generate --like` reads back, recipes through `--set` for `train`, `distill` and `rl` (and the flywheel's recipe
file, a value changed), `eval`'s options, workflow manifests, diffusers folders for `cards import` (config.json and
the shard index), the Python API's arguments
(`LoadedCard` and its `generate`, `evaluate`, `compare`, `run_workflow`, `load_card`), whole command lines of the
quick commands (`argv`: their options read from the app), the state `--resume` reads back (`resume`: a training
checkpoint's tensors and metadata, an eval report), and `LoadedCard.generate` calls made from several threads at once
(`threads`: each must give what it gives alone), image files in many formats, damaged (`images`), and the
environment a command starts in (`environment`: what cardtool, Rich, Typer, torch and transformers read from it, run
as a shell runs the command, in a process of its own) — mutated and run in process on the tiny example cards and a
tiny IDX folder, counted by outcome per surface.

Outcomes: `ok` (exit 0), `refused` (exit 2: bad input, said so; or exit 1 with located validation problems — a
workflow manifest's, as a card's), `failed` (exit 1 with another JSON error: work that could not finish, e.g. a loss
that overflowed — its messages are kept for reading), `check_failed` (exit 1 with `"ok": false`: a check that ran and
did not pass — `eval --expect`, `parity`, `cards validate`), and the failures the target is zero of:
`traceback`, `hang` (a command ran ≥ 120 s), `invalid_json` (anything but one strict JSON document on stdout),
`other_exit` (an exit code that is none of 0, 1, 2), `differs` (a call made beside others gave other images or
metadata than alone) and `validated_then_error` (a workflow that passed the validation `workflow run` begins with,
refused from inside a step: what a step refuses, validation must find first).

    python benchmarks/fuzz_requests.py --cases 2000 --seed 0 [--out benchmarks/results/fuzz-requests.json]
        [--surfaces generate like recipes train eval workflow import api argv resume threads images environment]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from fuzz_cards import VALUES, Hang, _alarm, _get, _paths, _strict_json, _value  # benchmarks/, this script's folder

REPO = Path(__file__).resolve().parents[1]
HANG_SECONDS = 120
BAD = ("traceback", "hang", "invalid_json", "other_exit", "differs")
NUMBERS = ["0", "-1", "1", "2", "3", "7", "64", "129", "1000000", "99999999999999999999", "nan", "inf", "1e9", "0.5",
           "x", ""]
FLOATS = ["0", "-1", "1", "1.5", "4", "nan", "inf", "-inf", "1e308", "1e-320", "x", "", "-0"]
# recipe values: mostly plausible ones (so that some runs get past validation), then hostile ones
PLAUSIBLE = ["0", "1", "2", "3", "4", "8", "0.5", "0.1", "1e-3", "1e-6", "10", "100", "[0, 1]", "[0.2, 0.4]",
             "[1, 2, 2]", "[0.9, 1.0]", "[1, 1]", "null", "true", "false", "0.999", "invert", "mirror", "edges",
             "silhouette", "none", "euler", "dpmpp_2m", "sde", "renoise", "[to_q]", "['*attn1*']", "[]", "[0.5, 1]",
             "float16", "bfloat16", "lora", "teacher", "sampler", "guided"]
HOSTILE = ["-1", "1e308", ".nan", ".inf", "x", "''", "{}", "[a, b]", "99999999999999999999", "../x", "a/b", "2.5",
           "[1, 0]", "{a: 1}", "3.5e+38", "1e30", "1e-320"]


class Env:
    """A scratch folder with copies of the example cards, a tiny IDX data folder, control images and a PNG made by
    generate (whose metadata the `like` surface mutates)."""

    def __init__(self, root: Path, runner, app):
        import numpy as np
        import yaml
        from PIL import Image

        sys.path.insert(0, str(REPO / "tests"))
        from helpers import write_idx_folder

        self.root, self.cards = root, root / "cards"
        shutil.copytree(REPO / "examples" / "cards", self.cards, ignore=shutil.ignore_patterns("*.py"))
        self.data = write_idx_folder(root / "idx")
        rng = np.random.default_rng(0)
        Image.fromarray((rng.random((28, 28)) * 255).astype("uint8")).save(root / "control.png")
        Image.fromarray((rng.random((8, 8, 4)) * 255).astype("uint8")).save(root / "rgba.png")
        (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(100)))
        (root / "loop").symlink_to(root / "loop")  # a link that names itself: resolving it goes round for ever
        (root / "prompts.txt").write_text("a bag\n\n" + "x" * 10000 + "\n")
        from cardtool.core.sampling.images import png_bytes

        (root / "bomb.png").write_bytes(png_bytes(np.zeros((5000, 5000), np.uint8)))  # 25 M pixels in ~25 KB
        made = runner.invoke(app, ["generate", str(self.cards / "tiny-base"), "-p", "a bag", "--steps", "2",
                                   "--adapter", "invert=0.5", "--out", str(root / "made.png"), "--json"])
        assert made.exit_code == 0, made.stdout
        from cardtool.core.sampling.images import read_png

        self.pixels, self.metadata = read_png(root / "made.png")
        self.workflow = yaml.safe_load((REPO / "examples" / "workflows" / "tiny-tour.yaml").read_text())
        self.images = root / "images"  # a clean folder of captioned images (image_folder.py): 27 train, 3 test
        (self.images / "sub").mkdir(parents=True)
        for i in range(30):
            Image.fromarray((rng.random((28, 28)) * 255).astype("uint8")).save(self.images / "sub" / f"{i}.png")
        (self.images / "metadata.jsonl").write_text("".join(
            f'{{"file_name": "sub/{i}.png", "text": "a {("bag", "dark coat", "boot")[i % 3]}"}}\n' for i in range(30)))
        self.export = _sharded_export(runner, app, self.cards / "tiny-rl", root / "export")
        self.image_files = _image_files(rng)

    def card(self, name: str) -> str:
        return str(self.cards / name)


def _image_files(rng) -> list[bytes]:
    """One small image in each of the formats read (several PNG modes among them) and in a few that are not."""
    import io

    import numpy as np
    from PIL import Image

    pixels = (rng.random((20, 24, 3)) * 255).astype("uint8")
    made = []
    for form, mode in [("PNG", "L"), ("PNG", "RGBA"), ("PNG", "P"), ("PNG", "1"), ("PNG", "I;16"), ("JPEG", "RGB"),
                       ("JPEG", "CMYK"), ("WEBP", "RGBA"), ("GIF", "P"), ("BMP", "RGB"), ("TIFF", "RGB"),
                       ("TIFF", "F"), ("PPM", "L"), ("ICNS", "RGBA"), ("DDS", "RGBA"), ("TGA", "RGB")]:
        if mode == "I;16":
            image = Image.fromarray(pixels[..., 0].astype(np.uint16) * 257)
        elif mode == "F":
            image = Image.fromarray(pixels[..., 0].astype(np.float32) / 255)
        else:
            image = Image.fromarray(pixels).convert(mode)
        data = io.BytesIO()
        image.save(data, form)
        made.append(data.getvalue())
    return made


def _generate(rng: random.Random, env: Env, out: Path) -> list[str]:
    r = str(env.root)
    options = {
        "-p": ["a bag", "", "x" * 100000, "\x00", "ünïcode 👜", "--json", "[a bag", '{"x": 1}'],
        "--prompts-file": [f"{r}/prompts.txt", "/dev/null", "/nonexistent", r, f"{r}/loop"],
        "--negative-prompt": ["a dress", "", "x" * 5000, "[1]"], "-n": NUMBERS, "--seed": NUMBERS, "--steps": NUMBERS,
        "--guidance": FLOATS, "--shift": FLOATS, "--control-scale": FLOATS, "--max-batch": NUMBERS,
        "--guidance-interval": ["0,1", "1,0", "0.2,0.4", "nan,1", "0", "a,b", "0,1,2", "", "-1,2"],
        "--solver": ["euler", "dpmpp_2m", "sde", "renoise", "x"], "--device": ["cpu", "numpy", "cuda", "tpu", ""],
        "--precision": ["float32", "bfloat16", "float16", "float64", "int8"], "--best-of": NUMBERS,
        "--reward": [env.card("tiny-judge"), env.card("tiny-base"), "nope"],
        "--adapter": ["invert", "invert=0.5", "invert=nan", "invert=x", "nope", "=1", "invert=1e308", ""],
        "--control": [f"{r}/control.png", f"{r}/broken.png", f"{r}/rgba.png:edges", f"{r}/control.png:nope",
                      "/nonexistent.png", r, f"{r}/bomb.png"],
        "--out": [str(out), str(out / "one.png"), "/dev/null", f"{r}/control.png", str(out / "a.jpg"), f"{r}/loop/x"],
        "--like": [f"{r}/made.png", f"{r}/control.png", "/nonexistent"],
        "--image": [f"{r}/control.png", f"{r}/made.png", f"{r}/broken.png", f"{r}/rgba.png", f"{r}/bomb.png",
                    "/nonexistent.png", r], "--strength": ["0.5", "0.01", "0.99", "1", "0", "nan", "1e-320", "x"],
        "--mask": [f"{r}/control.png", f"{r}/rgba.png", f"{r}/broken.png", f"{r}/bomb.png", "/nonexistent.png"],
        "--fuse": None, "--grid": None, "--strict": None, "--skip-existing": None}
    args = ["generate", env.card(rng.choice(["tiny-base", "tiny-distilled", "tiny-rl", "tiny-judge"])), "--json"]
    args += ["-p", "a bag"] if rng.random() < 0.8 else []
    args += ["--steps", rng.choice(["1", "2", "4"])] if rng.random() < 0.7 else []
    for option in rng.sample(sorted(options), rng.choice([1, 2, 3, 4])):
        args += [option] if options[option] is None else [option, rng.choice(options[option])]
    return args if "--out" in args else [*args, "--out", str(out)]


def _like(rng: random.Random, env: Env, out: Path) -> list[str]:
    """A PNG whose recorded request has fields changed, dropped or added (an image from elsewhere)."""
    from cardtool.core.sampling.images import png_bytes

    values = ["", "x", "-1", "0", "2", "nan", "inf", "1e308", "99999999999999999999", "[]", "{}", "null", "true",
              "euler", "renoise", "0,1", "1,0", "0.2,0.4,0.6", "tiny-base", "tiny-rl", "../../etc/passwd", "/dev/zero",
              env.card("tiny-rl"), "tiny-judge", "a" * 100000, "bfloat16", "int8",
              '[{"name": "invert", "scale": 0.5}]', '[{"name": "nope", "scale": 1}]', '[{"name": "invert"}]',
              '[{"name": "invert", "scale": 1e308}]', "[1]", '{"source": "/nonexistent", "preprocessor": "edges"}',
              "[" * 50000 + "]" * 50000]  # nested past the JSON parser's recursion
    metadata = dict(env.metadata)
    for _ in range(rng.choice([1, 1, 2, 3])):
        key = rng.choice([*env.metadata, "strength", "control", "best_of", "reward", "request_seed", "input"])
        if rng.random() < 0.15:
            metadata.pop(key, None)
        else:
            metadata[key] = rng.choice(values)
    image = out / "like.png"
    image.write_bytes(png_bytes(env.pixels, metadata))
    args = ["generate", "--like", str(image), "--json", "--out", str(out)]
    args += ["--seed", "3"] if rng.random() < 0.3 else []
    args += ["-p", "a dress"] if rng.random() < 0.2 else []
    return args + ([env.card("tiny-rl")] if rng.random() < 0.1 else [])


def _recipe_sets(rng: random.Random, keys: list[str]) -> list[str]:
    sets = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        sets += ["--set", f"{rng.choice(keys)}={rng.choice(PLAUSIBLE if rng.random() < 0.75 else HOSTILE)}"]
    return sets


COMMON_KEYS = ["optim.lr", "optim.weight_decay", "optim.betas", "optim.warmup", "optim.grad_clip", "optim.batch_size",
               "optim.steps", "train.seed", "train.ema", "train.checkpoint_every", "train.log_every", "train.precision",
               "train.parallel", "card.id", "card.storage", "card.description", "parents", "data", "model", "method",
               "x.y"]


DISTILL_LOSS = ["student_steps", "shift", "guidance", "guidance_interval", "generator_every", "critic_lr_scale",
                "t_range", "gan", "gan_generator_weight", "gan_critic_weight", "gan_head_lr_scale", "gan_real",
                "gan_t_range", "real", "real_lr_scale", "regression", "teacher_samples"]
RL_LOSS = ["group_size", "rollout_steps", "shift", "updates_per_rollout", "kl", "kl_start", "reference_guidance",
           "reference_interval", "advantage_clip", "reward_cap", "beta", "timesteps", "t_range", "decay_rate",
           "decay_max", "eta", "clip_range", "train_timesteps"]
LORA_KEYS = ["model.lora.rank", "model.lora.alpha", "model.lora.targets"]


def _recipes(rng: random.Random, env: Env, out: Path) -> list[str]:
    """distill, rl (DiffusionNFT, Flow-GRPO) and the flywheel of both on the tiny cards, a few settings changed."""
    common = ["--set", "train.precision=float32", "--no-eval", "--json", "--out", str(out / "card"), "--run-dir",
              str(out / "run")]
    distill_keys = [f"loss.{k}" for k in DISTILL_LOSS] + COMMON_KEYS + LORA_KEYS
    rl_keys = [f"loss.{k}" for k in RL_LOSS] + COMMON_KEYS + LORA_KEYS
    if rng.random() < 0.05:  # a folder reached through a symlink loop
        common[common.index(rng.choice(["--out", "--run-dir"])) + 1] = str(env.root / "loop" / "x")
    roll = rng.random()
    if roll < 0.2:
        tiny = ["rl.optim.steps=2", "rl.optim.batch_size=2", "rl.loss.group_size=4", "rl.train.precision=float32",
                "distill.optim.steps=2", "distill.optim.batch_size=4", "distill.train.precision=float32"]
        args = ["flywheel", env.card("tiny-base"), "--reward", env.card("tiny-judge"), "--steps",
                rng.choice(["1", "2", "0"]), "--stop-after", rng.choice(["rl", "distill", "x"]), "--json",
                "--out-dir", str(out / "cards"), "--run-dir", str(out / "runs")]
        for setting in tiny:
            args += ["--set", setting]
        if rng.random() < 0.4:  # the example recipe file, one value changed (its sections read before validation)
            args += ["--recipe", str(_flywheel_file(rng, out))]
            if rng.random() < 0.5:  # the student's steps from the file, not --steps
                del args[args.index("--steps"):args.index("--steps") + 2]
        keys = [f"rl.{k}" for k in rl_keys] + [f"distill.{k}" for k in distill_keys]
        return args + _watching(rng, env) + _recipe_sets(rng, keys + ["rl", "distill", "eval.per_class", "x.y"])
    if roll < 0.5:
        args = ["distill", env.card("tiny-base"), "--steps", rng.choice(["1", "2", "2", "4", "0"]), "--set",
                "optim.steps=2", "--set", "optim.batch_size=4", *common]
        keys = distill_keys
    else:
        args = ["rl", env.card("tiny-base"), "--reward", env.card("tiny-judge"), "--set", "optim.steps=2", "--set",
                "optim.batch_size=2", "--set", "loss.group_size=4", *common]
        args += ["--method", "flow_grpo"] if rng.random() < 0.4 else []
        keys = rl_keys
    args += ["--lora", rng.choice(["4", "0", "-2", "x", "100000"])] if rng.random() < 0.15 else []
    return args + _watching(rng, env) + _recipe_sets(rng, keys)


def _mutate(rng: random.Random, data, times: int, keys: list[str], value, prefer: list[tuple] = ()) -> None:
    """Change `data` in place `times` times at a random path (half the time one of `prefer`, where given): drop a key,
    add one of `keys`, or replace the value with `value(old)` — a copy: a later change inside it must not change the
    lists values are drawn from."""
    for _ in range(times):
        paths = list(_paths(data))
        preferred = [p for p in prefer if p in paths] if prefer and rng.random() < 0.5 else []
        path = rng.choice(preferred or paths)
        parent = _get(data, path[:-1])
        roll = rng.random()
        if roll < 0.15 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.25 and isinstance(parent, dict):
            parent[rng.choice(keys)] = copy.deepcopy(value(None))  # the value drawn first, then the key
        else:
            parent[path[-1]] = copy.deepcopy(value(parent[path[-1]]))


def _flywheel_file(rng: random.Random, out: Path) -> Path:
    """examples/recipes/fashion-flywheel.yaml with a value replaced (any type: a section by a number, a list by a
    mapping), a key dropped or a stray key added."""
    import yaml

    data = yaml.safe_load((REPO / "examples" / "recipes" / "fashion-flywheel.yaml").read_text())
    data["distill"]["loss"]["student_steps"] = 2  # present, so that it too may be changed
    read_first = [("method",), ("rl",), ("rl", "method"), ("distill",), ("distill", "loss"),
                  ("distill", "loss", "student_steps"), ("distill", "card")]  # by the flywheel, before validation
    _mutate(rng, data, rng.choice([1, 1, 2]), ["x", "method", "loss", "lora", "student_steps"],
            lambda old: _value(rng, old), prefer=read_first)
    file = out / "flywheel.yaml"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(yaml.safe_dump(data))
    return file


def _watching(rng: random.Random, env: Env) -> list[str]:
    """Now and then `--watch-every` (the live model judged at progress lines) with its judges and data."""
    if rng.random() >= 0.15:
        return []
    return ["--watch-every", rng.choice(["1", "2", "0", "-1", "x", "1e9"]), "--judge", env.card("tiny-judge"),
            "--held-out-judge", rng.choice([env.card("tiny-judge"), "", env.card("tiny-base"), "nope"]),
            "--data", rng.choice([str(env.data)] * 3 + [str(env.root), "/dev/zero"])]


def _train(rng: random.Random, env: Env, out: Path) -> list[str]:
    """`cardtool train` of each method on the tiny IDX folder, a few settings changed."""
    tiny = ["optim.steps=2", "optim.batch_size=8", "train.precision=float32"]
    adapter = [*tiny, f"parents=[{env.card('tiny-base')}]"]
    recipes = {"fashion-vae": [*tiny, "model.channels=[8, 16, 32]"],
               "fashion-classifier": [*tiny, "model.width=8", "model.features=16"],
               "fashion-bold": [*adapter, "model.rank=2"], "fashion-mirror": [*adapter, "model.rank=2"],
               "fashion-silhouette": [*adapter, "model.blocks=1"],
               "fashion-base": [*tiny, "model.dim=32", "model.depth=1", "model.heads=2", "model.ffn_dim=64",
                                "parents=[fashion-vae]"]}
    name = rng.choice(sorted(recipes))
    data = _image_folder(rng, env, out / "images") if rng.random() < 0.3 else env.data
    args = ["train", "--recipe", str(REPO / "examples" / "recipes" / f"{name}.yaml"), "--data", str(data),
            "--json", "--out", str(out / "card"), "--run-dir", str(out / "run")]
    for setting in recipes[name]:
        args += ["--set", setting]
    keys = COMMON_KEYS + ["model.rank", "model.alpha", "model.targets", "model.blocks", "model.control",
                          "model.adapter", "model.channels", "model.width", "model.dim", "model.depth", "model.heads",
                          "model.patch", "model.text_mask", "loss.condition_dropout", "loss.kl_weight", "loss.scales",
                          "data.transform", "data.folder", "data.loop", "data.loop.steps", "data.loop.solver",
                          "data.loop.guidance_interval"]
    args += _recipe_sets(rng, keys)
    args += ["--micro-batches", rng.choice(["2", "0", "3", "16"])] if rng.random() < 0.1 else []
    return args + (["--method", rng.choice(["lora", "vae", "x"])] if rng.random() < 0.05 else [])


def _images(rng: random.Random, env: Env, out: Path) -> list[str]:
    """An image file — one of the formats read or another, its bytes overwritten, cut or added to here and there —
    as generate's --image or its --mask (the control image's reader is the same)."""
    data = bytearray(rng.choice(env.image_files))
    for _ in range(rng.choice([0, 1, 1, 2, 4, 16])):
        at, change = rng.randrange(len(data)), rng.random()
        if change < 0.5:
            data[at] = rng.randrange(256)
        elif change < 0.7:
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8)))
        elif change < 0.85:
            del data[at:at + rng.randrange(1, 64)]
        else:
            order = rng.choice(["big", "little"])  # a length or a size field set to an extreme
            data[at:at + 4] = rng.choice([0, 0xFFFFFFFF, 0x7FFFFFFF, 0x10000]).to_bytes(4, order)
        if len(data) < 16:
            break
    out.mkdir(parents=True, exist_ok=True)
    (out / "given.img").write_bytes(bytes(data))
    given = str(out / "given.img")
    use = rng.choice([["--image", given], ["--image", str(env.root / "control.png"), "--mask", given]])
    return ["generate", env.card("tiny-base"), "-p", "a bag", "--steps", "1", "--json", *use, "--out", str(out)]


def _image_folder(rng: random.Random, env: Env, root: Path) -> Path:
    """A folder of captioned images (metadata.jsonl) with none, one or two of its rows, lines or files made hostile."""
    import json

    import numpy as np
    from PIL import Image

    (root / "sub").mkdir(parents=True)
    rows = []
    for i in range(12):
        name = f"sub/{i}.png" if i % 2 else f"{i}.png"
        size = rng.choice([28, 28, 5, 40])
        Image.fromarray(np.full((size, size), 20 * i, np.uint8)).save(root / name)
        rows.append({"file_name": name, "text": rng.choice(["a bag", "a dark coat", "", "x" * 5000])})
    lines = [json.dumps(r) for r in rows]
    for _ in range(rng.choice([0, 1, 1, 2])):  # now and then a folder as it should be, which trains
        i = rng.randrange(len(rows))
        change = rng.choice(["name", "text", "split", "key", "line", "file", "drop", "empty"])
        if change == "name":
            rows[i]["file_name"] = rng.choice(["../x.png", "/etc/passwd", "", "sub", "missing.png", str(env.root /
                                               "bomb.png"), "a\u0000b", 3, None, "sub/../1.png", "/dev/zero"])
        elif change == "text":
            rows[i]["text"] = rng.choice([None, 3, ["a"], {"a": 1}, "\u0000", "a\nb", "x" * 100000])
        elif change == "split":
            rows[i]["split"] = rng.choice(["test", "test", "val", "", None, 1])
        elif change == "key":
            rows[i][rng.choice(["label", "file", "caption", ""])] = "x"
        elif change == "file":
            target = root / rows[i]["file_name"] if isinstance(rows[i]["file_name"], str) else root / "x"
            if target.is_file():
                target.write_bytes(rng.choice([b"", b"not an image", (env.root / "broken.png").read_bytes(),
                                               (env.root / "bomb.png").read_bytes()]))
        lines = [json.dumps(r) for r in rows]
        if change == "line":
            lines[i] = rng.choice(["{", "[1, 2]", "null", "\ufeff" + lines[i], "  ", "3", "[" * 50000 + "]" * 50000])
        elif change == "drop":
            lines = lines[:rng.randrange(len(lines))]
        elif change == "empty":
            lines = []
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _eval(rng: random.Random, env: Env, out: Path) -> list[str]:
    options = {"--judge": [env.card("tiny-judge"), env.card("tiny-base"), "nope"], "--steps": NUMBERS,
               "--guidance": FLOATS, "--guidance-interval": ["0,1", "1,0", "0.2,0.4", "nan,1", "x"],
               "--shift": FLOATS, "--solver": ["euler", "dpmpp_2m", "sde", "renoise", "x"],
               # past 6 the tiny IDX folder's 64 training images are too few: refused, as the huge ones must be
               "--per-class": ["0", "1", "2", "x", "-1", "7", "10001", "1000000000", "99999999999999999999"],
               "--seed": NUMBERS, "--device": ["cpu", "numpy", "cuda", "x"],
               # FOLDER: a captioned image folder of 12 rows or fewer (one test image at most), made hostile
               "--data": [str(env.data), str(env.images), str(env.root), "/nonexistent", "/dev/zero", "FOLDER"],
               "--precision": ["float32", "bfloat16", "float16", "float64", "int8"],
               "--adapter": ["invert", "invert=0.5", "nope", "invert=x"],
               "--out": [str(out / "r.json"), "/dev/null", str(env.root / "made.png"), str(out)], "--resume": None,
               "--expect": ["class_accuracy>=0", "fid_fmnist<0", "images_per_second>1e308", "kid<=nan", "fid>1",
                            "mean_reward", "manifold_recall>=0", "x", ""],
               "--versus": [env.card("tiny-base"), env.card("tiny-distilled"), env.card("tiny-judge"), "nope",
                            "/dev/null", str(out)]}
    args = ["eval", env.card(rng.choice(["tiny-base", "tiny-distilled", "tiny-rl", "tiny-judge"])), "--json",
            "--judge", env.card("tiny-judge"), "--data", str(env.data), "--per-class", "1", "--steps", "2"]
    for option in rng.sample(sorted(options), rng.choice([1, 2, 3])):
        args += [option] if options[option] is None else [option, rng.choice(options[option])]
    return [str(_image_folder(rng, env, out / "folder")) if a == "FOLDER" else a for a in args]


def _workflow(rng: random.Random, env: Env, out: Path) -> list[str]:
    """The tour's workflow with values changed, keys dropped or added, as YAML or TOML — or as it is, changed by
    `--set`."""
    import yaml

    if rng.random() < 0.3:
        paths = [".".join(map(str, p)) for p in _paths(env.workflow) if p and all(isinstance(k, str) for k in p)]
        sets = []
        for _ in range(rng.choice([1, 2])):
            key = rng.choice([*paths, "steps.nope.generate.card", "steps.pick.best_of_n.nn", "x", "steps"])
            sets += ["--set", f"{key}={rng.choice(PLAUSIBLE if rng.random() < 0.6 else HOSTILE)}"]
        tour = REPO / "examples" / "workflows" / "tiny-tour.yaml"
        (env.root / "workflows").mkdir(exist_ok=True)
        shutil.copy(tour, env.root / "workflows" / tour.name)  # beside the copied cards, as in examples/
        return ["workflow", "run", "--json", str(env.root / "workflows" / tour.name), "--out", str(out), *sets]
    data = copy.deepcopy(env.workflow)
    extra = [f"{env.cards}/tiny-judge", f"{env.cards}/tiny-base", "draft", "refine", "pick", "nope", -3, 0, 1, 10**5,
             1e9, 0.0, 2.0, -0.5, ["a"], [""], ["x" * 5000], [], {"generate": {}}, {"chain": {"input": "pick"}},
             # what generate refuses when the step runs: a scale past float32, seeds past 2⁶³ − 1, too long a prompt
             {"invert": 3.5e38}, 2**63 - 1, 2**63 - 2, ["x" * 70000], "x" * 70000]
    _mutate(rng, data, rng.choice([1, 1, 1, 2, 3]), ["input", "card", "cards", "reward", "n", "strength", "prompts",
                                                      "seed", "steps", "guidance", "adapters", "precision", "num",
                                                      "negative_prompt"],
            lambda old: rng.choice(VALUES + extra))
    # relative card paths resolve from the manifest's folder: put it where the tour's sits relative to its cards
    (env.root / "workflows").mkdir(exist_ok=True)
    file = env.root / "workflows" / f"w{out.name}.yaml"
    text = yaml.safe_dump(data)
    if rng.random() < 0.2:
        try:
            import tomli_w

            file, text = file.with_suffix(".toml"), tomli_w.dumps(data)
        except (ImportError, TypeError, ValueError):  # no TOML writer here, or a value TOML cannot hold
            pass
    file.write_text(text)
    return ["workflow", "run", "--json", str(file), "--out", str(out)]


def _sharded_export(runner, app, card: Path, folder: Path) -> Path:
    """`cards export` of `card`, its transformer split into two shards with an index, as a large diffusers model's."""
    from safetensors.numpy import load_file, save_file

    made = runner.invoke(app, ["cards", "export", str(card), "--out", str(folder), "--json"])
    assert made.exit_code == 0, made.stdout
    transformer = folder / "transformer"
    whole = transformer / "diffusion_pytorch_model.safetensors"
    tensors, weight_map = load_file(str(whole)), {}
    keys = sorted(tensors)
    for number, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:]), start=1):
        name = f"diffusion_pytorch_model-0000{number}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(transformer / name))
        weight_map.update(dict.fromkeys(part, name))
    (transformer / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    whole.unlink()
    return folder


def _import(rng: random.Random, env: Env, out: Path) -> list[str]:
    """`cards import` of a diffusers folder whose config.json or shard index has values changed, keys dropped or
    added, or whose text is cut short or beyond the parser."""
    source = out / "source"
    shutil.copytree(env.export, source)
    transformer = source / "transformer"
    file = transformer / rng.choice(["config.json", "diffusion_pytorch_model.safetensors.index.json"])
    data = json.loads(file.read_text())
    extra = ["/etc/passwd", "../x.safetensors", "a\x00b", "diffusion_pytorch_model-00001-of-00002.safetensors",
             "rms_norm", "rms_norm_across_heads", "WanTransformer3DModel", "UNet2DModel", [1, 2, 2], [0, 2, 2], 2**40]
    for _ in range(rng.choice([1, 1, 2])):
        added = [("image_dim",), ("added_kv_proj_dim",), ("rope_max_seq_len",)]  # keys diffusers' configs may hold
        path = rng.choice([p for p in _paths(data) if p] + added)
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.15 and isinstance(parent, dict):
            parent.pop(path[-1], None)
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(VALUES + extra))
    text, form = json.dumps(data), rng.random()
    if form < 0.1:  # cut short
        text = text[: rng.randrange(len(text))]
    elif form < 0.15:  # JSON the parser refuses beyond the grammar: nested past its recursion, an int past 4,300 digits
        text = rng.choice(["[" * 50000 + "]" * 50000, '{"num_layers": ' + "1" * 5000 + "}"])
    file.write_text(text)
    target = rng.choice([source, transformer])
    return ["cards", "import", str(target), "--base", env.card("tiny-base"), "--id", f"imported-{out.name}", "--out",
            str(out / "card"), "--json"]


class ApiCall:
    """A Python API call instead of a command: one of the API's entry points with arguments of any type a script
    might pass."""

    def __init__(self, env: Env, function: str, args: list, options: dict):
        self.env, self.function, self.args, self.options = env, function, args, options

    def __call__(self):
        import cardtool

        if self.function != "LoadedCard.generate":
            return getattr(cardtool, self.function)(*self.args, **self.options)
        if getattr(self.env, "loaded", None) is None:  # loaded once, as a script would
            self.env.loaded = cardtool.LoadedCard(self.env.card("tiny-base"))
        return self.env.loaded.generate(*self.args, **self.options)

    def shown(self) -> list[str]:
        return [self.function, *(repr(a)[:60] for a in self.args),
                *(f"{k}={v!r}"[:60] for k, v in self.options.items())]


def _api(rng: random.Random, env: Env, out: Path) -> ApiCall:
    """`LoadedCard.generate` most often; else `LoadedCard`, `evaluate`, `compare`, `run_workflow`, `load_card`, a
    training call (`train`, `distill`, `rl`, `flywheel`) or a card call (`merge`, `compose`, `extract_lora`, `export`,
    `import_diffusers`, `diff`), each with a few arguments of any type and the rest plausible, so that some calls
    run."""
    from PIL import Image

    pictures = [Image.new("RGB", (40, 40), (200, 30, 90)), Image.new("LAB", (28, 28)), Image.new("L", (0, 0)),
                Image.new("F", (28, 28), float("nan"))]  # a script's Pillow images: any mode and size, and unusable
    values = [None, 0, -1, 1, 2, 2.5, float("nan"), float("inf"), True, "", "x", "2", [], [1], ["a"], {}, (0, 1),
              (1, 0), (0.2, 0.4), [("invert", 0.5)], [("invert", "x")], [("nope", 1)], [("invert",)], "invert", b"x",
              10**30, "a\x00b", "euler", "dpmpp_2m", "renoise", "bfloat16", "float64", env.card("tiny-judge"),
              str(env.root / "control.png"),
              lambda *a: None, ["bfloat16"], [2], [0.5, 4.0], ["a=1"], ("steps.draft.generate.num=2",), object(),
              *pictures]

    def hostile(keywords, plausible):
        chosen = {k: rng.choice(values) for k in rng.sample(keywords, min(len(keywords), rng.choice([1, 1, 2])))}
        return {**plausible, **chosen}

    function = rng.choice(["LoadedCard.generate"] * 10 + ["LoadedCard", "evaluate", "compare", "run_workflow",
                                                           "load_card"] * 2 + ["train", "distill", "rl", "flywheel"]
                          + ["merge", "compose", "extract_lora", "export", "import_diffusers", "diff"])
    if function == "LoadedCard.generate":
        keywords = ["num", "seed", "steps", "guidance", "shift", "solver", "guidance_interval", "precision", "grid",
                    "strict", "on_step", "max_batch", "best_of", "reward", "adapters", "control", "preprocessor",
                    "control_scale", "fuse", "skip_existing", "negative_prompt", "out", "image", "strength", "mask"]
        options = hostile(keywords, {"steps": 2})
        prompts = rng.choice(["a bag", ["a bag", "a dress"], [], [1], None, "", ["x" * 70000], 3, "{a bag}"])
        args = [prompts]
    elif function == "LoadedCard":
        args = [rng.choice([env.card("tiny-base")] * 3 + values)]
        options = hostile(["device", "cache", "precision"], {})
    elif function in ("evaluate", "compare"):
        keywords = ["judge", "steps", "guidance", "guidance_interval", "per_class", "seed", "device", "data",
                    "precision", "on_row", "adapters", "shift", "solver", "out", "resume", "on_step", "keep_samples",
                    "stop", "max_batch"]
        args = [env.card("tiny-base")] + ([rng.choice([env.card("tiny-distilled")] * 3 + values)]
                                          if function == "compare" else [])
        options = hostile(keywords, {"judge": env.card("tiny-judge"), "steps": [2], "per_class": 1,
                                     "data": str(env.data)})
    elif function == "run_workflow":
        keywords = ["overrides", "out", "device", "max_batch", "on_step", "on_wave", "skip_existing"]
        args = [rng.choice([str(REPO / "examples" / "workflows" / "tiny-tour.yaml")] * 5 + values)]
        options = hostile(keywords, {"overrides": ["steps.draft.generate.num=1"]})
    elif function in ("train", "distill", "rl", "flywheel"):
        args, options = _training_call(rng, env, out, function, values, hostile)
    elif function in ("merge", "compose", "extract_lora", "export", "import_diffusers", "diff"):
        args, options = _card_call(rng, env, out, function, values, hostile)
    else:
        args, options = [rng.choice([env.card("tiny-base")] * 3 + values)], hostile(["checksums", "adapters"], {})
    if function in ("LoadedCard.generate", "run_workflow", "evaluate") and (
            isinstance(options.get("out"), str) and "\0" not in options["out"]  # NUL: no file is written
            or "out" not in options):  # never into the working directory
        options["out"] = out / "report.json" if function == "evaluate" else out
    return ApiCall(env, function, args, options)


def _training_call(rng: random.Random, env: Env, out: Path, function: str, values: list, hostile) -> tuple:
    """`cardtool.train`, `distill`, `rl` or `flywheel` on the tiny cards, one step, no eval, a few arguments of any
    type; what it writes goes under `out` whatever a path argument says."""
    card = rng.choice([env.card("tiny-base")] * len(values) + values)  # mostly plausible: some runs run
    common = {"out": out / "card", "run_dir": out / "run"}
    if function == "train":
        args = [rng.choice([str(REPO / "examples" / "recipes" / "fashion-bold.yaml")] * len(values) + values)]
        plausible = {**common, "data": str(env.images), "overrides": [
            f"parents=[{env.card('tiny-base')}]", "data.transform=none", "optim.steps=1", "optim.batch_size=2"]}
        keywords = ["method", "overrides", "resume", "data", "device", "overwrite", "micro_batches", "on_log"]
    elif function == "flywheel":
        args = [card]
        plausible = {"reward": env.card("tiny-judge"), "overrides": ["rl.optim.steps=1"], "stop_after": "rl",
                     "judge": env.card("tiny-judge"), "held_out_judge": None, "out_dir": out / "cards",
                     "run_dir": out / "run"}
        keywords = ["reward", "steps", "overrides", "out_prefix", "resume", "force", "stop_after", "compare",
                    "per_class", "judge", "held_out_judge", "device", "data", "micro_batches", "on_log", "on_stage"]
    else:
        args = [card]
        plausible = {**common, "overrides": ["optim.steps=1"], "evaluate": False,
                     **({"reward": env.card("tiny-judge")} if function == "rl" else {"steps": 1})}
        keywords = ["steps", "overrides", "lora", "resume", "device", "data", "force", "evaluate", "judge",
                    "held_out_judge", "per_class", "watch_every", "micro_batches", "on_log", "on_warning"]
        if function == "rl":
            keywords = [k for k in keywords if k != "steps"] + ["reward", "method", "prompts", "prompts_file"]
    options = hostile(keywords, plausible)
    for where in ("out", "run_dir", "out_dir"):  # never into the working directory
        if isinstance(options.get(where), (str, Path)):
            options[where] = plausible.get(where, out / where)
    return args, options


def _card_call(rng: random.Random, env: Env, out: Path, function: str, values: list, hostile) -> tuple:
    """`cardtool.merge`, `compose`, `extract_lora`, `export`, `import_diffusers` or `diff` on the tiny cards, a few
    arguments of any type; what it writes goes under `out` whatever a path argument says."""
    base, tuned = (rng.choice([env.card(c)] * len(values) + values) for c in ("tiny-base", "tiny-rl"))
    plausible = {"card_id": "made", "out": out / "made"}
    keywords = ["card_id", "out", "overwrite"]
    if function == "merge":
        args = [rng.choice([[base, tuned], [(base, 0.3), (tuned, 0.7)], [(base, rng.choice(values)), tuned]]
                           + values)]
    elif function == "compose":
        args = [base, rng.choice([[env.card("tiny-rl")], [tuned]] + values)]
    elif function == "extract_lora":
        args, plausible = [base, tuned], {**plausible, "rank": 2}
        keywords += ["rank", "adapter"]
    elif function == "diff":
        args, plausible, keywords = [base, tuned], {}, ["top"]
    elif function == "export":
        args, plausible, keywords = [tuned, rng.choice([out / "export"] * 3 + values)], {}, ["format", "overwrite"]
    else:
        args, plausible = [rng.choice([out, str(out / "none")] * 3 + values)], {**plausible, "base": base}
        keywords += ["base", "variant"]
    options = hostile(keywords, plausible)
    if isinstance(options.get("out"), (str, Path)) and "\0" not in str(options["out"]):
        options["out"] = out / "made"  # never into the working directory
    if function == "export" and isinstance(args[1], str) and "\0" not in args[1]:
        args[1] = out / "export"
    return args, options


class Differs(Exception):
    """Calls made from several threads at once gave other images or metadata than the same calls one by one."""


class ThreadedCalls:
    """`LoadedCard.generate` calls made one after another, then the same calls from several threads at once — on one
    shared LoadedCard, on LoadedCards of their own, or both — into one folder: each must give what it gave alone (the
    pixels and the metadata), a fused stack or a new LoadedCard beside it notwithstanding."""

    def __init__(self, env: Env, calls: list[tuple[str, str, dict]], shared: float, threads: int, out: Path):
        self.env, self.calls, self.shared, self.threads, self.out = env, calls, shared, threads, out

    def __call__(self):
        import threading

        import numpy as np

        import cardtool

        loaded = {card: cardtool.LoadedCard(self.env.card(card)) for card in {c for c, _, _ in self.calls}}
        alone, refused = [], []
        for card, prompt, options in self.calls:
            try:
                alone.append(loaded[card].generate(prompt, out=None, **options).images)
            except cardtool.CardtoolError as e:  # refused alone (a precision this card cannot run, say): left out
                refused.append(e)
                alone.append(None)
        if len(refused) == len(self.calls):
            raise refused[0]
        made, errors = [None] * len(self.calls), []

        def serve(first: int):
            try:
                for k in range(first, len(self.calls), self.threads):
                    if alone[k] is None:
                        continue
                    card, prompt, options = self.calls[k]
                    # a share `shared` of the calls, spread evenly over them (golden-ratio steps), on the shared one
                    own = loaded[card] if (k * 0.618) % 1 < self.shared else cardtool.LoadedCard(self.env.card(card))
                    made[k] = own.generate(prompt, out=self.out, **options).images
            except cardtool.CardtoolError as e:  # what ran alone must run beside the others
                errors.append(Differs(f"call {k} {self.calls[k]}: refused beside the others, not alone: {e}"))
            except Exception as e:  # noqa: BLE001 - raised in the caller's thread below
                errors.append(e)

        workers = [threading.Thread(target=serve, args=(first,), daemon=True) for first in range(self.threads)]
        [worker.start() for worker in workers]
        for worker in workers:
            worker.join(HANG_SECONDS)
            if worker.is_alive():
                raise Hang()
        if errors:
            raise errors[0]
        for k, (images, reference) in enumerate(zip(made, alone, strict=True)):
            for image, expected in zip(images or [], reference or [], strict=True):
                if not np.array_equal(image.pixels, expected.pixels) or image.metadata != expected.metadata:
                    raise Differs(f"call {k} {self.calls[k]}: made beside the others, not as made alone")

    def shown(self) -> list[str]:
        return [f"{self.threads} threads, shared {self.shared:.2f}", *(repr(c)[:120] for c in self.calls)]


def _threads(rng: random.Random, env: Env, out: Path) -> ThreadedCalls:
    """Plausible calls (hostile arguments are the api surface's): the cards, stacks with and without --fuse,
    precisions, solvers, best-of-N, image-to-image; prompts and seeds drawn from few, so that calls meet on files."""
    calls = []
    for _ in range(rng.randint(2, 8)):
        card = rng.choice(["tiny-base", "tiny-base", "tiny-rl", "tiny-distilled"])
        options = {"num": rng.randint(1, 3), "seed": rng.randint(0, 3), "steps": rng.randint(1, 3)}
        if card == "tiny-base" and rng.random() < 0.6:
            options["adapters"] = [("invert", rng.choice([0.0, 0.5, 1.0, -1.0]))]
            options["fuse"] = rng.random() < 0.5
        if rng.random() < 0.3:
            options["precision"] = rng.choice(["bfloat16", "float32", "float64"])
        if rng.random() < 0.2:
            options["solver"] = rng.choice(["dpmpp_2m", "sde", "renoise"])
        if rng.random() < 0.2:
            options["best_of"], options["reward"] = rng.randint(2, 3), env.card("tiny-judge")
        if rng.random() < 0.2:
            options["image"], options["strength"] = str(env.root / "control.png"), rng.choice([0.3, 0.8])
        if rng.random() < 0.2:
            options["guidance"] = rng.choice([1.0, 2.0, 6.0])
        calls.append((card, rng.choice(["a bag", "a coat", "a dark boot"]), options))
    return ThreadedCalls(env, calls, rng.choice([0.0, 0.5, 1.0]), rng.randint(2, 6), out)


# the commands the argv surface runs: each finishes in seconds on the tiny cards (train, distill, rl, flywheel and eval
# have surfaces of their own, sized to run)
ARGV_COMMANDS = ("generate", "cards list", "cards show", "cards validate", "cards lineage", "cards diff",
                 "cards export", "cards compose", "cards merge", "cards extract-lora", "cards import", "parity",
                 "platform detect", "platform matrix", "cache info", "cache prune", "workflow validate", "workflow run")


@functools.lru_cache(maxsize=1)
def _command_options() -> dict[str, tuple[list[tuple[str, bool]], int]]:
    """Each ARGV_COMMANDS command's options (an option's first name, and whether it is a flag) and how many
    arguments it takes, read from the app itself: a new option is fuzzed without this script knowing of it."""
    import click
    import typer.main

    from cardtool.cli import app

    found, group = {}, typer.main.get_command(app)
    for path in ARGV_COMMANDS:
        command = group
        for name in path.split():
            command = command.commands[name]
        options = [(p.opts[0], p.is_flag) for p in command.params
                   if isinstance(p, click.Option) and p.opts[0] not in ("--json", "--help")]
        arguments = sum(1 for p in command.params if isinstance(p, click.Argument) and p.required)
        found[path] = (options, arguments)
    return found


def _argv(rng: random.Random, env: Env, out: Path) -> list[str]:
    """A command line of any of ARGV_COMMANDS: its arguments and one to five of its options (introspected), each
    value drawn from plausible paths and cards here and hostile text; `--json` first, where no option takes it."""
    r = str(env.root)
    values = [*NUMBERS, *FLOATS, env.card("tiny-base"), env.card("tiny-rl"), env.card("tiny-judge"), "tiny-base",
              "fashion-base", f"{r}/control.png", f"{r}/control.png:edges", f"{r}/made.png", f"{r}/broken.png",
              f"{r}/prompts.txt", str(env.export / "transformer"),
              str(REPO / "examples" / "workflows" / "tiny-tour.yaml"),
              str(out), str(out / "x.png"), str(out / "card"), "/dev/null", "/dev/zero", "/proc", "-", "", " ", "\x00",
              os.fsdecode(os.fsencode(out) + b"/caf\xe9"), "a \udcff bag",  # bytes a shell passes that are not UTF-8
              "a bag", "invert=0.5", "invert=nan", "=1", "euler", "renoise", "bfloat16", "float16", "numpy", "cuda",
              "5GB", "-5MB", "0,0.4", "0.4,0", "steps.draft.generate.num=2", "a=b=c", "x" * 5000, "../x", "hf",
              "%s%n", "ünïcode 👜", "--help", "--json", "~", "~no-such-user/x", "./-", f"{env.card('tiny-rl')}=0.7",
              f"{env.card('tiny-base')}=0.3",
              "tiny-base=1.5", f"{env.card('tiny-rl')}=-1e300", f"{env.card('tiny-rl')}=1e308", "tiny-base=1e308"]
    path = rng.choice(ARGV_COMMANDS)
    options, arguments = _command_options()[path]
    if path == "cards merge":
        arguments = rng.choice([1, 2, 2, 3])  # CARD[=WEIGHT]...: a merge takes two or more
    args = [*path.split(), "--json", *(rng.choice(values) for _ in range(arguments))]
    for name, flag in rng.sample(options, min(len(options), rng.choice([1, 2, 3, 4, 5]))):
        args += [name] if flag else [name, rng.choice(values)]
    if path in ("generate", "workflow run", "cards export", "cards compose", "cards merge", "cards extract-lora",
                "cards import") and "--out" not in args:
        args += ["--out", str(out / "out")]  # never the working folder's default outputs/ or cards/
    return [*args, "--steps", "1"] if path == "generate" and "--steps" not in args else args


CHECKPOINT_VALUES = ["", "x", "-1", "0", "1", "3", "1e9", "nan", "inf", "3.5", "null", "[]", "{}", "[{}]", "[null]",
                     '[{"params": [0]}]', "1" * 400]


@functools.cache
def _runs(root: Path, cards: Path, data: Path) -> dict[str, tuple[list[str], Path]]:
    """Each trainer a checkpoint to resume — train (a LoRA, its EMA too), distill, rl of both methods — as the
    command that made it and its run folder; each rewound to step 3 of 4, which for rl is the second update of a
    rollout, so the resumed step trains on the buffer the checkpoint holds."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from cardtool.cli import app

    tiny = ["optim.steps=4", "train.checkpoint_every=1", "train.precision=float32"]
    base, judge = str(cards / "tiny-base"), str(cards / "tiny-judge")
    lora = ["optim.batch_size=8", f"parents=[{base}]", "model.rank=2", "train.ema=0.9"]
    rollouts = ["optim.batch_size=2", "loss.group_size=4", "loss.updates_per_rollout=2"]
    commands = {
        "train": ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data", str(data),
                  *(f"--set={v}" for v in [*tiny, *lora])],
        "distill": ["distill", base, "--steps", "2", "--no-eval",
                    *(f"--set={v}" for v in [*tiny, "optim.batch_size=4", "loss.generator_every=2"])],
        **{method: ["rl", base, "--reward", judge, "--method", method, "--no-eval",
                    *(f"--set={v}" for v in [*tiny, *rollouts])] for method in ("diffusion_nft", "flow_grpo")}}
    runs = {}
    for name, args in commands.items():
        made = CliRunner().invoke(app, [*args, "--out", str(root / "runs" / f"{name}-card"), "--run-dir",
                                        str(root / "runs" / name), "--json"])
        assert made.exit_code == 0, made.stdout
        checkpoint = root / "runs" / name / "checkpoint.safetensors"
        with safe_open(str(checkpoint), framework="pt") as f:
            metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, str(checkpoint), metadata={**metadata, "step": "3"})
        runs[name] = args, checkpoint
    return runs


def _damaged_tensors(rng: random.Random, tensors: dict, key: str) -> dict:
    import torch

    value = tensors[key]
    changed = {"flat": lambda: value.reshape(-1)[:1].clone(), "scalar": lambda: torch.tensor(1.0),
               "doubled": lambda: torch.cat([value.reshape(-1)] * 2), "long": lambda: value.long() + 7,
               "bool": lambda: value.bool(), "negative": lambda: -value - 1 if value.dtype != torch.bool else value,
               "huge": lambda: (value * 0 + (1e30 if value.is_floating_point() else 2**40)).to(value.dtype),
               "empty": lambda: value.reshape(-1)[:0].clone(), "nan": lambda: value.double() * float("nan"),
               "zero": lambda: torch.zeros_like(value), "flipped": lambda: value.flip(0).contiguous() if value.dim()
               else value.clone(), "transposed": lambda: value.transpose(0, -1).contiguous() if value.dim() > 1
               else value.clone()}
    what = rng.choice(sorted(changed) + ["drop", "added"])
    if what == "drop":
        return {k: v for k, v in tensors.items() if k != key}
    if what == "added":
        return {**tensors, rng.choice(["optim.99999.exp_avg", "optim.x.exp_avg", "optim.5", "task.buffer.extra",
                                       "task.extra", "model.transformer.extra", "ema.x.y"]): value.clone()}
    return {**tensors, key: changed[what]()}


def _resume(rng: random.Random, env: Env, out: Path) -> list[str]:
    """`--resume` of a run whose checkpoint a hand or a disk altered — a tensor dropped, added, reshaped, retyped,
    negated or made huge (optimizer state and rollout buffers most often), a metadata field changed or dropped, the
    file a pipe, a device or a folder, the run's lock a link or a folder — or of an eval whose report was (rows,
    floors, identity)."""
    if rng.random() < 0.25:
        return _resumed_eval(rng, env, out)
    from safetensors import safe_open
    from safetensors.torch import save_file

    name = rng.choice(["train", "distill", "diffusion_nft", "flow_grpo"])
    args, checkpoint = _runs(env.root, env.cards, env.data)[name]
    run = out / "run"
    shutil.copytree(checkpoint.parent, run)
    with safe_open(str(run / checkpoint.name), framework="pt") as f:
        metadata, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    for _ in range(rng.choice([1, 1, 2])):
        if rng.random() < 0.3:
            key = rng.choice(sorted(metadata) + ["x"])
            if rng.random() < 0.2:
                metadata.pop(key, None)
            else:
                metadata[key] = rng.choice(CHECKPOINT_VALUES)
        else:
            state = [k for k in tensors if not k.startswith(("model.", "ema.", "task.old."))]
            tensors = _damaged_tensors(rng, tensors, rng.choice(state if state and rng.random() < 0.7
                                                                 else sorted(tensors)))
    save_file(tensors, str(run / checkpoint.name), metadata=metadata)
    if rng.random() < 0.03:  # no checkpoint file at all: a pipe (which a read would wait on for ever), a device
        (run / checkpoint.name).unlink()
        rng.choice([os.mkfifo, lambda p: p.symlink_to("/dev/zero"), Path.mkdir])(run / checkpoint.name)
    if rng.random() < 0.05:
        lock = run / ".lock"
        lock.unlink(missing_ok=True)
        lock.symlink_to(env.root / "made.png") if rng.random() < 0.5 else lock.mkdir()
    return [*args, "--out", str(out / "card"), "--run-dir", str(run), "--resume", "--json"]


def _resumed_eval(rng: random.Random, env: Env, out: Path) -> list[str]:
    args = ["eval", env.card("tiny-base"), "--judge", env.card("tiny-judge"), "--data", str(env.data), "--per-class",
            "1", "--steps", "1", "--steps", "2", "--json"]
    report = env.root / "report.json"
    if not report.exists():
        from typer.testing import CliRunner

        from cardtool.cli import app

        assert CliRunner().invoke(app, [*args, "--out", str(report)]).exit_code == 0
    document = json.loads(report.read_text())
    for _ in range(rng.choice([1, 1, 2])):
        part = rng.choice(["rows", "rows", "floors", "kid_floors", "manifold_floors", "identity", None])
        node = document if part is None else document.get(part)
        node = rng.choice(node) if isinstance(node, list) and node else node
        node = node if isinstance(node, dict) else document  # a part an earlier change made a number or a list
        key = rng.choice(sorted(node) + ["x"])
        if rng.random() < 0.2:
            node.pop(key, None)
        else:
            node[key] = rng.choice([v for v in VALUES if not isinstance(v, float) or v == v and abs(v) != float("inf")])
    (out / "report.json").write_text(json.dumps(document))
    return [*args, "--out", str(out / "report.json"), "--resume", *(["--steps", "3"] if rng.random() < 0.5 else [])]


# what cardtool and the libraries it starts read from the environment, and values a shell, a scheduler or a
# container might hand them
ENVIRONMENT = ("CARDTOOL_ARCH", "CARDTOOL_DEVICE", "CARDTOOL_DATA", "CARDTOOL_PATH", "CARDTOOL_CACHE",
               "CARDTOOL_CACHE_MAX", "CARDTOOL_HOST_ALLOCATOR", "HOME", "XDG_CACHE_HOME", "COLUMNS", "LINES",
               "TERMINAL_WIDTH", "NO_COLOR", "FORCE_COLOR", "TERM", "RANK", "WORLD_SIZE", "LOCAL_RANK",
               "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE",
               "OMP_NUM_THREADS", "LC_ALL", "LANG", "PYTHONIOENCODING")
ENVIRONMENT_VALUES = ["", " ", "0", "1", "-1", "2", "80", "200", "1e400", "nan", "inf", "1.5", "²", "9" * 5000,
                      "99999999999999999999", "x" * 5000, "../x", "/dev/null", "/nonexistent/x", "/proc/self/mem",
                      "\x1b[31m", "caf\udce9", "cuda", "cuda:1", "numpy", "cpu", "zen4", "avx2", "generic", "a,b",
                      "C", "C.UTF-8", "5GB", "1KB", "-5MB", "localhost", "::"]


class InShell:
    """A command line run as a shell runs it — `python -m cardtool`, in a process of its own — with one to three of
    ENVIRONMENT set to what a shell might hand it, or unset: Rich, Typer and torch read theirs as they load, which an
    in-process run has done long before."""

    def __init__(self, args: list[str], changes: dict[str, str | None]):
        self.args, self.changes = args, changes

    def run(self):
        import subprocess
        from types import SimpleNamespace

        env = dict(os.environ)
        for key, value in self.changes.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        done = subprocess.run([sys.executable, "-m", "cardtool", *self.args], env=env, capture_output=True,
                              cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL)
        stderr = done.stderr.decode(errors="replace")
        crashed = "Traceback (most recent call last)" in stderr or done.returncode < 0
        return SimpleNamespace(exit_code=done.returncode, stdout=done.stdout.decode(errors="replace"),
                               exception=RuntimeError(f"exit {done.returncode}: {stderr[-1500:]}") if crashed else None)

    def shown(self) -> list[str]:
        return [*(f"{k}={v!r}"[:60] if v is not None else f"-u {k}" for k, v in self.changes.items()), *self.args]


def _environment_case(rng: random.Random, env: Env, out: Path) -> InShell:
    """A quick command — a one-step generate, the light commands, help, a usage error, now and then an eval — in an
    environment with one to three variables changed."""
    tiny = env.card("tiny-base")
    args = rng.choice([["generate", tiny, "-p", "a bag", "--steps", "1", "--out", str(out / "o"), "--json"],
                       ["generate", "tiny-base", "-p", "a bag", "--steps", "1", "--out", str(out / "o"), "--json"],
                       ["cards", "list", "--json"], ["platform", "detect", "--json"], ["cache", "info", "--json"],
                       ["--help"], ["cards", "show", tiny, "--json", "--bogus"], ["cards", "validate", tiny, "--json"],
                       ["eval", tiny, "--per-class", "1", "--steps", "1", "--json"]])
    values = [*ENVIRONMENT_VALUES, str(out), str(out / "cache"), str(env.cards), str(env.data)]
    encodings = ["ascii", "latin-1", "cp1252", "utf-8:strict", "ascii:strict"]  # another stops Python itself
    changes = {key: (None if rng.random() < 0.1 else rng.choice(encodings if key == "PYTHONIOENCODING" else values))
               for key in rng.sample(ENVIRONMENT, rng.choice([1, 1, 2, 3]))}
    return InShell(args, changes)


SURFACES = {"generate": _generate, "like": _like, "recipes": _recipes, "train": _train, "eval": _eval,
            "workflow": _workflow, "import": _import, "api": _api, "argv": _argv, "resume": _resume,
            "threads": _threads, "images": _images, "environment": _environment_case}


def run_case(runner, app, args) -> tuple[str, str]:
    """(outcome, detail) of one command, or of one API call: ok, or refused with a CardtoolError."""
    from cardtool.errors import CardtoolError

    signal.alarm(HANG_SECONDS)
    try:
        if isinstance(args, ApiCall | ThreadedCalls):
            args()
            return "ok", ""
        result = args.run() if isinstance(args, InShell) else runner.invoke(app, args)
        args = args.args if isinstance(args, InShell) else args
    except CardtoolError:
        return "refused", ""
    except Hang:
        return "hang", ""
    except Differs as e:
        return "differs", str(e)[:1500]
    except Exception as e:  # noqa: BLE001 - what an API call must never raise
        return "traceback", "".join(traceback.format_exception(e))[-1500:]
    finally:
        signal.alarm(0)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "traceback", "".join(traceback.format_exception(result.exception))[-1500:]
    plain = re.sub("\x1b\\[[0-9;]*m", "", result.stdout)  # FORCE_COLOR colours the help
    if "--help" in args and result.exit_code == 0 and re.search(r"Usage: (python -m )?cardtool", plain):
        return "ok", ""  # help asked for (an argument drawn as `--help` is click's flag): for people, not JSON
    if not _strict_json(result.stdout):
        return "invalid_json", result.stdout[-300:]
    document = json.loads(result.stdout)
    message = (document.get("error") or {}).get("message", "") if isinstance(document, dict) else ""
    if result.exit_code == 2 and args[:2] == ["workflow", "run"] and message.startswith("step '"):
        # a refusal from inside a step: the workflow had validated (run validates first), so it must run
        return "validated_then_error", message[:300]
    kind = {0: "ok", 2: "refused"}.get(result.exit_code)
    if kind is not None:
        return kind, ""
    if result.exit_code == 1 and document.get("ok") is False and "error" not in document:
        return "check_failed", ""  # a check that ran and did not pass (eval --expect, parity, validate)
    error = document.get("error")
    if not isinstance(error, dict):
        return "other_exit", f"exit {result.exit_code} without an error document"
    if result.exit_code == 1 and error.get("kind") == "validation" and error.get("problems"):
        return "refused", ""
    message = error.get("message", "")
    outcome = "failed" if result.exit_code == 1 and message else "other_exit"
    return outcome, f"exit {result.exit_code}: {message}"[:300]


@contextlib.contextmanager
def _environment(saved: dict):
    """Put the variables back as they were (a test process runs other tests after this one)."""
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def fuzz(cases: int, seed: int, surfaces: list[str], on_case=None) -> dict:
    """`cases` requests spread over `surfaces` in turn; the counts by surface and outcome, and up to 20 details of
    each outcome that is not ok or refused."""
    import typer.testing
    from typer.testing import CliRunner

    from cardtool.cli import app

    typer.testing._get_command = functools.lru_cache(maxsize=1)(typer.testing._get_command)  # built once, not per call
    rng, runner = random.Random(seed), CliRunner()
    counts = {s: collections.Counter() for s in surfaces}
    details = collections.defaultdict(list)
    signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    saved = {key: os.environ.get(key) for key in ("CARDTOOL_CACHE", "CARDTOOL_PATH")}
    with tempfile.TemporaryDirectory() as tmp, _environment(saved):
        os.environ.setdefault("CARDTOOL_CACHE", str(Path(tmp) / "cache"))
        os.environ["CARDTOOL_PATH"] = str(Path(tmp) / "env" / "cards")  # what --like finds a card id in
        env = Env(Path(tmp) / "env", runner, app)
        for case in range(cases):
            surface = surfaces[case % len(surfaces)]
            out = Path(tmp) / f"case{case}"
            out.mkdir()
            args = SURFACES[surface](rng, env, out)
            outcome, detail = run_case(runner, app, args)
            counts[surface][outcome] += 1
            if outcome not in ("ok", "refused", "check_failed"):
                shown = args.shown() if isinstance(args, ApiCall | ThreadedCalls | InShell) else \
                    [a if len(a) < 100 else a[:40] + "…" for a in args]
                print(f"case {case} {surface} {outcome}: {shown} → {detail}", file=sys.stderr, flush=True)
                if len(details[outcome]) < 20:
                    details[outcome].append({"surface": surface, "args": shown, "detail": detail})
            shutil.rmtree(out, ignore_errors=True)
            if on_case:
                on_case(case + 1, counts)
    totals = collections.Counter()
    for counted in counts.values():
        totals.update(counted)
    return {"cases": cases, "seed": seed, "seconds": round(time.perf_counter() - started, 1),
            "counts": dict(totals), "by_surface": {s: dict(c) for s, c in counts.items()}, "details": dict(details)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--surfaces", nargs="+", choices=sorted(SURFACES), default=list(SURFACES))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)

    def progress(done, counts):
        if done % 100 == 0:
            print(f"{done}/{args.cases} {json.dumps({s: dict(c) for s, c in counts.items()})}", file=sys.stderr,
                  flush=True)

    report = fuzz(args.cases, args.seed, args.surfaces, progress)
    print(json.dumps(report, indent=2))
    if args.out:
        from cardtool.atomic import write_atomic

        write_atomic(args.out, (json.dumps(report, indent=2) + "\n").encode())
    sys.exit(1 if any(report["counts"].get(k) for k in BAD) else 0)


if __name__ == "__main__":
    main()
