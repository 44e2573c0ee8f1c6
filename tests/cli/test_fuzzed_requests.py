"""A small run of the request fuzzer (benchmarks/fuzz_requests.py): generate's options, --like metadata, recipes
through --set, train, eval, workflow manifests, cards import's diffusers folders, the Python API's arguments and
checkpoints to resume, mutated — none may crash, hang or print anything but JSON (or raise anything but a
CardtoolError); and API calls from several threads at once, each giving what it gives alone."""

from __future__ import annotations

import sys

import torch
from helpers import REPO


def test_mutated_requests_never_crash_hang_or_print_invalid_json():
    torch.set_num_threads(1)
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from fuzz_requests import BAD, SURFACES, fuzz
    finally:
        sys.path.pop(0)
    report = fuzz(48, seed=5, surfaces=list(SURFACES))
    assert not any(report["counts"].get(k) for k in BAD), report["details"]
    assert set(report["by_surface"]) == set(SURFACES) and report["counts"].get("ok", 0) > 0
