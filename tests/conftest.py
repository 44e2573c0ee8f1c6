"""Shared fixtures: an isolated working directory and helpers that write cards with real safetensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

try:  # tiny models run faster on one thread, and the test machines are small and shared
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CARDS = REPO / "examples" / "cards"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each test runs in its own empty folder with no CARDTOOL_PATH, so only the cards it makes exist."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CARDTOOL_PATH", raising=False)
    return tmp_path


@pytest.fixture
def examples(tmp_path) -> Path:
    """A private copy of examples/cards (tiny-base ← tiny-rl ← tiny-distilled)."""
    target = tmp_path / "examples"
    shutil.copytree(EXAMPLE_CARDS, target)
    return target


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
