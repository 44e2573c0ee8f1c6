"""Helpers shared by the tests: paths, and cards written with real safetensors weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CARDS = REPO / "examples" / "cards"


def write_weights(path: Path, seed: int = 0) -> str:
    """Write a small real safetensors file and return its sha256."""
    from safetensors.numpy import save_file

    from cardtool.core.weight_files import sha256_file

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"proj.weight": rng.standard_normal((4, 4)).astype(np.float32)}, str(path))
    return sha256_file(path)


def write_card(folder: Path, manifest: str, *, name: str = "card.yaml", weights: tuple[str, ...] = ()) -> Path:
    """A card folder holding `manifest` (dedented) and a real safetensors file for each of `weights`."""
    import textwrap

    folder.mkdir(parents=True, exist_ok=True)
    for seed, rel in enumerate(weights):
        write_weights(folder / rel, seed)
    (folder / name).write_text(textwrap.dedent(manifest).lstrip("\n"))
    return folder
