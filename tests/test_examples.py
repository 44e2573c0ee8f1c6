"""Every script under examples/ runs; the example cards' weights are exactly what their script writes; the example
plugin installs and passes parity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from helpers import EXAMPLE_CARDS, REPO


def test_make_tiny_weights_reproduces_the_committed_example_cards(tmp_path):
    copy = tmp_path / "cards"
    shutil.copytree(EXAMPLE_CARDS, copy)
    for weights in copy.rglob("*.safetensors"):
        weights.unlink()
    subprocess.run([sys.executable, str(copy / "make_tiny_weights.py"), str(copy)], check=True, cwd=REPO,
                   capture_output=True, timeout=120)
    differs = [str(committed.relative_to(EXAMPLE_CARDS)) for committed in sorted(EXAMPLE_CARDS.rglob("*"))
               if committed.suffix in (".safetensors", ".yaml", ".toml")
               and (copy / committed.relative_to(EXAMPLE_CARDS)).read_bytes() != committed.read_bytes()]
    assert differs == [], "remade files differ from the committed ones"


def test_the_example_plugin_installs_and_its_own_op_passes_parity(tmp_path):
    """examples/plugin as a user installs it (pip, offline: its build backend is one of the dev tools): its cells
    join the matrix under its distribution's name, and `parity` holds them to its numpy oracle on its own inputs."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-cache-dir", "--target", str(site), str(REPO / "examples" / "plugin")], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(site), "CARDTOOL_ARCH": "avx2"}

    def cardtool(*args: str) -> dict:
        done = subprocess.run([sys.executable, "-m", "cardtool", *args, "--json"], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        return json.loads(done.stdout)

    cells = {c["cell"]: c for c in cardtool("platform", "matrix", "--op", "soft_cap")["cells"]}
    assert {name: (c["source"], c["reference"]) for name, c in cells.items()} == {
        "soft_cap/numpy/generic/default": ("cardtool-soft-cap", True),
        "soft_cap/cpu/generic/default": ("cardtool-soft-cap", False),
        "soft_cap/cuda/generic/default": ("cardtool-soft-cap", False)}
    report = cardtool("parity", "--op", "soft_cap")
    rows = [(r["cell"], r["dtype"], r["passed"], r["source"]) for r in report["rows"]]
    assert report["ok"] and rows == [("soft_cap/cpu/generic/default", dtype, True, "cardtool-soft-cap")
                                     for dtype in ("float64", "float32", "bfloat16")], "each row names the plugin"
    assert report["rows"][0]["shapes"] == ["4x8, cap 2: most values saturate", "2x3x5, cap 50: nearly the identity"]
