"""Every script under examples/ runs; the example cards' weights are exactly what their script writes."""

from __future__ import annotations

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
