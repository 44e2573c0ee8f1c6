"""Resume after a real kill: a `cardtool train` subprocess is killed with SIGKILL at a random step (sometimes
in the middle of writing a checkpoint), continued with --resume, and must end with exactly the weights of an
uninterrupted run — for every method."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import REPO, write_idx_folder
from safetensors.torch import load_file

from cardtool.core.training.recipes import load_recipe
from cardtool.core.training.train import train

RECIPES = REPO / "examples" / "recipes"
COMMON = ["optim.batch_size=8", "optim.warmup=2", "train.checkpoint_every=2", "train.log_every=1",
          "train.precision=float32", "train.ema=0.5", "card.storage=float32"]  # EMA on; weights kept exact
TINY = {
    "vae": ("fashion-vae", ["model.channels=[8, 16, 32]", "optim.steps=16"]),
    # dropout draws from torch's global RNG: the case the old resume got wrong
    "classifier": ("fashion-classifier", ["model.width=8", "model.features=16", "optim.steps=16"]),
    "pretrain": ("fashion-base", ["model.dim=32", "model.depth=1", "model.heads=2", "model.ffn_dim=64",
                                  "optim.steps=16"]),
    "finetune": ("fashion-base", ["method=finetune", "card.id=tuned", "model={}", "optim.steps=16"]),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Tiny IDX data, a VAE card and a text-to-image card for pretrain and finetune to start from."""
    root = tmp_path_factory.mktemp("family")
    data = write_idx_folder(root / "idx")
    vae = root / "vae"
    train(load_recipe(RECIPES / "fashion-vae.yaml", [*COMMON, *TINY["vae"][1], "optim.steps=2"]), command="c",
          out=vae, run_dir=root / "rv", data=str(data))
    base = root / "base"
    train(load_recipe(RECIPES / "fashion-base.yaml", [*COMMON, *TINY["pretrain"][1], "optim.steps=2",
                                                       f"parents=[{vae}]"]),
          command="c", out=base, run_dir=root / "rb", data=str(data))
    return {"data": data, "vae": vae, "base": base}


def overrides(method: str, family) -> tuple[str, list[str]]:
    name, extra = TINY[method]
    parent = {"pretrain": [f"parents=[{family['vae']}]"], "finetune": [f"parents=[{family['base']}]"]}
    return name, [*COMMON, *extra, *parent.get(method, [])]


def kill_at(args: list[str], step: int, delay: float) -> None:
    """Run `cardtool train` until it logs `step`, wait `delay` seconds, then SIGKILL it."""
    # one thread, as the in-process runs it is compared with (conftest sets OMP_NUM_THREADS for every process)
    process = subprocess.Popen([sys.executable, "-m", "cardtool", *args], stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        for line in process.stderr:
            if line.startswith(f"step {step}/"):
                time.sleep(delay)
                break
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"


@pytest.mark.parametrize("method", list(TINY))
def test_a_run_killed_at_a_random_moment_resumes_to_the_uninterrupted_weights(method, family, tmp_path):
    name, sets = overrides(method, family)
    recipe = load_recipe(RECIPES / f"{name}.yaml", sets)
    data = str(family["data"])
    whole = train(recipe, command="c", out=tmp_path / "whole", run_dir=tmp_path / "run-whole", data=data)

    chance = random.Random(f"{method}-{time.time_ns()}")
    step, delay = chance.randint(3, 10), chance.uniform(0, 0.02)  # six or more steps are left to run
    args = ["train", "--recipe", str(RECIPES / f"{name}.yaml"), *(f"--set={s}" for s in sets), "--data", data,
            "--run-dir", str(tmp_path / "run-killed"), "--out", str(tmp_path / "killed")]
    kill_at(args, step, delay)
    assert not (tmp_path / "killed").exists(), "a killed run writes no card"
    resumed = train(recipe, command="c", out=tmp_path / "killed", run_dir=tmp_path / "run-killed", data=data,
                    resume=True)
    component = next(iter(whole.manifest.components)) if method in ("vae", "classifier") else "transformer"
    a, b = load_file(str(whole.weights_file(component))), load_file(str(resumed.weights_file(component)))
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not differing, f"killed at step {step} (+{delay:.3f} s): {differing[:3]} differ"
    assert resumed.manifest.recipe.metrics["final_loss"] == whole.manifest.recipe.metrics["final_loss"]
    assert not list((tmp_path / "run-killed").glob(".*.tmp")), "no half-written checkpoint is left behind"


def test_a_run_killed_before_its_first_checkpoint_resumes_from_the_start(family, tmp_path):
    """A job re-run with --resume after a kill -9 must not fail where the kill came before the first checkpoint:
    the folder the run started in holds only its lock, and `--resume` starts over."""
    name, sets = overrides("pretrain", family)
    sets = [*sets, "optim.steps=6", "train.checkpoint_every=6"]  # the only checkpoint: the last step's
    recipe = load_recipe(RECIPES / f"{name}.yaml", sets)
    data = str(family["data"])
    whole = train(recipe, command="c", out=tmp_path / "whole", run_dir=tmp_path / "run-whole", data=data)
    args = ["train", "--recipe", str(RECIPES / f"{name}.yaml"), *(f"--set={s}" for s in sets), "--data", data,
            "--run-dir", str(tmp_path / "run-killed"), "--out", str(tmp_path / "killed")]
    kill_at(args, 1, 0)
    assert sorted(p.name for p in (tmp_path / "run-killed").iterdir()) == [".lock"], "killed before a checkpoint"
    resumed = train(recipe, command="c", out=tmp_path / "killed", run_dir=tmp_path / "run-killed", data=data,
                    resume=True)
    a, b = load_file(str(whole.weights_file("transformer"))), load_file(str(resumed.weights_file("transformer")))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
