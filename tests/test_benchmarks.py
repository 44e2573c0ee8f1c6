"""The benchmark scripts run and write their JSON (their numbers are reported, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def test_cli_startup_benchmark_writes_medians(tmp_path):
    out = tmp_path / "cli_startup.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "cli_startup.py"), "--repeats", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=120)
    medians = json.loads(out.read_text())["median_s"]
    assert set(medians) == {"cardtool --help", "cardtool cards list --json",
                            "cardtool cards validate --checksums examples/cards cards"}
    assert all(t > 0 for t in medians.values())


def test_generate_throughput_benchmark_writes_rows(tmp_path):
    out = tmp_path / "throughput.json"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "generate_throughput.py"), "--steps", "2",
                    "--batch-sizes", "1", "2", "--repeats", "1", "--out", str(out)], check=True, capture_output=True,
                   timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["generate_images_per_s"] > 0 and r["bare_loop_images_per_s"] > 0 for r in rows)
