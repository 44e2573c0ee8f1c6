"""Every command the README shows runs as written, and CI runs the README's test command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from helpers import REPO

from cardtool.core.sampling.images import read_png_metadata

README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
SETUP_MAIN, SETUP_TESTS, TOUR = BLOCKS[0].strip(), BLOCKS[1].strip(), BLOCKS[2]
# Run `cardtool` through this interpreter so the tests need no console script on PATH.
SHIM = f'cardtool() {{ "{sys.executable}" -m cardtool "$@"; }}\n'


def bash(script: str, cwd) -> subprocess.CompletedProcess:
    """Run README lines in a scratch folder that sees the repository's examples/ (outputs land there)."""
    (cwd / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "CARDTOOL_CACHE": str(cwd / "cache")}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", SHIM + script], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def test_readme_has_the_two_setup_commands_and_a_tour():
    assert len(BLOCKS) == 3
    assert SETUP_MAIN.startswith("pip install torch==2.13.0 -e . && ")
    assert SETUP_TESTS.startswith("pip install torch==2.13.0 -e \".[dev]\" && ")


def test_ci_runs_the_readme_test_command():
    assert SETUP_TESTS in (REPO / ".ci" / "run").read_text().splitlines()


def test_main_job_runs(tmp_path):
    # the install half is what CI itself does; here the job after `&&` runs as written
    result = bash(SETUP_MAIN.split(" && ", 1)[1], tmp_path)
    assert result.returncode == 0, result.stderr
    made = sorted(p.name for p in (tmp_path / "outputs").glob("*.png"))
    assert made[0].startswith("fashion-base-000-an-ankle-boot") and len(made) == 4 + 1, made


def test_quick_tour_runs_as_written(tmp_path):
    result = bash(TOUR, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "tiny-base (pretrain) → tiny-rl (diffusion_nft) → tiny-distilled (dmd2)" in result.stdout
    assert '"id": "tiny-rl"' in result.stdout
    assert "tiny-base → tiny-rl" in result.stdout, "cards diff"
    assert result.stdout.count("ok ") >= 3, "validate --checksums reports each example card ok"
    assert len(list((tmp_path / "outputs").glob("tiny-base-*.png"))) == 4 + 1, "four images and the grid"
    kept = next(line for line in result.stderr.splitlines() if "4 images (4 already there)" in line)
    assert kept.endswith("(none made)"), "--skip-existing makes none of them again, and says no rate"
    assert read_png_metadata(tmp_path / "outputs" / "bag-bf16.png")["precision"] == "bfloat16"
    stack = json.loads(read_png_metadata(tmp_path / "outputs" / "bag-invert.png")["adapters"])
    assert [(a["name"], a["scale"]) for a in stack] == [("invert", 0.5)] and len(stack[0]["version"]) == 64
    like = read_png_metadata(tmp_path / "outputs" / "bag-invert-seed1.png")
    assert (like["seed"], like["steps"], json.loads(like["adapters"])) == ("1", "8", stack), "--like: a new seed only"
    dress = read_png_metadata(tmp_path / "outputs" / "dress.png")
    assert (dress["prompt"], dress["strength"], json.loads(dress["image"])["source"]) == (
        "a dress", "0.6", "outputs/bag-bf16.png"), "image-to-image from the bfloat16 bag"
    student = read_png_metadata(tmp_path / "outputs" / "student.png")
    assert (student["card"], student["steps"], student["solver"]) == ("tiny-base-2step", "2", "renoise")
    tuned = (tmp_path / "outputs" / "tiny-nft" / "card.yaml").read_text()
    assert "method: diffusion_nft" in tuned and "- tiny-judge" in tuned
    assert "tiny-base-nft" in result.stdout and "tiny-judge (classifier)" in result.stdout, "lineage: base and reward"
    assert "tiny-base-nft-1step (dmd2)\n└── tiny-base-nft (diffusion_nft)" in result.stdout, "the flywheel's chain"
    best = [read_png_metadata(p) for p in sorted((tmp_path / "outputs" / "best").glob("*.png"))]
    assert len(best) == 2 and all(m["best_of"] == "4" and m["reward"] == "tiny-judge" for m in best)
    assert {p.parent.name for p in (tmp_path / "outputs" / "tiny-tour").glob("*/*.png")} == {
        "draft", "refine", "compare", "pick"}
    assert "step pick (best_of_n): 1 image (1 already there)" in result.stderr, "the workflow resumed makes none"
    assert f"cache {tmp_path / 'cache'}" in result.stdout and "encoded prompts" in result.stdout
    assert (tmp_path / "outputs" / "tiny-distilled-hf" / "transformer" / "config.json").is_file()
    assert "wrote tiny-soup to outputs/tiny-soup: transformer averaged from tiny-base (0.5), tiny-rl (0.5)" in \
        " ".join(result.stdout.split())
    assert "wrote tiny-rl-lora to outputs/tiny-rl-lora: LoRA 'tiny-rl' (rank 4," in " ".join(result.stdout.split())
    mine = (tmp_path / "outputs" / "tiny-mine" / "card.yaml").read_text()
    assert "dataset: image-folder" in mine and "images: 18" in mine, "the LoRA of examples/images' captions"
    assert read_png_metadata(tmp_path / "outputs" / "mine.png")["card"] == "tiny-mine"
