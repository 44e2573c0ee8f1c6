"""The benchmark scripts run and write their JSON (their numbers are reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO


def test_cli_startup_benchmark_writes_medians(tmp_path):
    out = tmp_path / "cli_startup.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "cli_startup.py"), "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    medians = json.loads(out.read_text())["median_s"]
    assert set(medians) == {"cardtool --help", "cardtool cards list --json",
                            "cardtool cards validate --checksums examples/cards cards"}
    assert all(t > 0 for t in medians.values())


def test_peer_benchmark_times_every_method_and_writes_ratios(tmp_path, examples):
    pytest.importorskip("diffusers")
    out = tmp_path / "peer.json"
    script = REPO / "benchmarks" / "peer_diffusers.py"
    subprocess.run([sys.executable, str(script), "--card", str(examples / "tiny-base"), "--steps", "2",
                    "--batch-sizes", "1", "2", "--repeats", "1", "--startup-repeats", "1",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert {(r["method"], r["batch"], r["precision"]) for r in report["rows"]} == {
        (m, b, p) for m in ("generate warm", "generate cold", "command", "loop", "bare forward", "diffusers loop",
                            "WanPipeline") for b in (1, 2) for p in ("float32", "bfloat16")}
    assert all(r["median_s"] > 0 for r in report["rows"])
    assert report["ratios"]["float32 B=2"]["generate warm / diffusers loop"] > 0
    assert report["startup"]["ratio"] > 0
