"""Weights versions (tensor digests) are remembered across processes by file identity, never past a change."""

from __future__ import annotations

import json

import torch
from helpers import race
from safetensors.torch import save_file

from cardtool.cache import cache_dir
from cardtool.core.cards import weight_files
from cardtool.core.cards.weight_files import tensor_digest


def test_a_digest_is_read_back_in_a_new_process_and_recomputed_when_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3)}, str(path))
    first = tensor_digest(path)
    memo_file = cache_dir() / "digests.json"
    memo = json.loads(memo_file.read_text())
    assert memo[str(path.resolve())][-1] == first
    memo[str(path.resolve())][-1] = "remembered"  # what a new process would trust for the same file identity
    memo_file.write_text(json.dumps(memo))
    monkeypatch.setattr(weight_files, "_memo", None)  # a new process
    assert tensor_digest(path) == "remembered", "not hashed again"
    save_file({"a": torch.zeros(3)}, str(path))  # new content: new size/inode/times, so the entry is stale
    changed = tensor_digest(path)
    assert changed not in (first, "remembered") and len(changed) == 64
    memo_file.write_text("not json")
    monkeypatch.setattr(weight_files, "_memo", None)
    assert tensor_digest(path) == changed, "an unreadable memo is only a cache miss"


def test_a_process_that_moves_its_cache_reads_and_writes_the_new_one(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(3)}, str(path))
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "first"))
    digest = tensor_digest(path)
    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path / "second"))
    assert tensor_digest(path) == digest
    memo = json.loads((tmp_path / "second" / "digests.json").read_text())
    assert memo[str(path.resolve())][-1] == digest, "remembered where the process now keeps its cache"


def test_threads_hashing_files_at_once_share_the_memo_safely(tmp_path, monkeypatch):
    """LoadedCards built in several threads hash their weights at once: one thread's trim of the memo deleted an
    entry another had just deleted (KeyError), or its write met another's change (RuntimeError)."""
    import numpy as np

    paths = []
    for i in range(64):
        paths.append(tmp_path / f"w{i}.safetensors")
        save_file({"w": torch.full((4,), float(i))}, str(paths[-1]))
    monkeypatch.setattr(weight_files, "_MEMO_ENTRIES", 4)  # trimmed on every write

    def load(seed):
        for i in np.random.default_rng(seed).integers(0, 64, size=600):
            tensor_digest(paths[i])

    assert race(load) == []
    assert len(json.loads((cache_dir() / "digests.json").read_text())) == 4
