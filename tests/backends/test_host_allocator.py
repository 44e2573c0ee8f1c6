"""glibc's allocator kept from handing freed tensor memory back to the kernel (host_allocator): once a process has built
a torch component on the CPU, a tensor of a few MiB comes from the heap and what it freed stays with the process for
the next ones; CARDTOOL_HOST_ALLOCATOR=system keeps glibc's defaults. Each case runs in a process of its own: the
setting is the process's."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# Five 20 MiB tensors made and freed, as one denoising step's activations: with glibc's defaults each is mapped apart
# and handed back to the kernel when freed, to be faulted in again, page by page, by the next step.
SCRIPT = """
import json, resource, torch
torch.set_num_threads(1)
from cardtool.backends import builders, host_allocator
builders._torch_module(lambda: torch.nn.Linear(2, 2), None, "cpu", "float32")
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()

def mapping(address):
    for line in open("/proc/self/maps"):
        fields = line.split()
        low, high = (int(end, 16) for end in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else "anonymous"

before = resident()
step = [torch.ones(5 * 2**20) for _ in range(5)]
region = mapping(step[0].data_ptr())
del step
print(json.dumps({"fixed": host_allocator.keep_freed_memory(), "region": region,
                  "kept_mib": (resident() - before) / 2**20}))
"""


def _run(**env) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cpu_component_build_keeps_freed_memory_for_the_next_tensors():
    kept, system = _run(CARDTOOL_HOST_ALLOCATOR=""), _run(CARDTOOL_HOST_ALLOCATOR="system")
    assert kept["fixed"] and not system["fixed"]
    assert kept["region"] == "[heap]" and system["region"] != "[heap]", (kept, system)
    assert kept["kept_mib"] > 90, kept  # the 100 MiB freed stay resident, ready for the next step
    assert system["kept_mib"] < 10, system


def test_a_misspelt_choice_is_refused_not_taken_for_the_default(monkeypatch):
    from cardtool.backends import host_allocator
    from cardtool.errors import BadInput

    monkeypatch.setattr(host_allocator, "_done", None)
    monkeypatch.setenv("CARDTOOL_HOST_ALLOCATOR", "sytem")
    with pytest.raises(BadInput, match="CARDTOOL_HOST_ALLOCATOR is 'sytem'; set it to system"):
        host_allocator.keep_freed_memory()


def test_datasets_go_through_the_vae_and_the_judge_in_batches_whose_activations_stay_on_the_heap():
    """Training turns the whole dataset into latents, and every eval runs the judge over the 10,000 test images; a
    batch whose activations pass the mmap threshold would be mapped and handed back on every call (batches of 1,000:
    11 million page faults for Fashion-MNIST's latents, 3 million for the judge's test features)."""
    import yaml

    from cardtool.backends.host_allocator import MMAP_THRESHOLD
    from cardtool.core.evaluation.reward import JUDGE_BATCH
    from cardtool.core.training.methods.vae import ENCODE_BATCH

    cards = Path(__file__).parents[2] / "cards"
    vae = yaml.safe_load((cards / "fashion-base" / "card.yaml").read_text())["components"]["vae"]["config"]
    widest = max(width * (vae["padded_size"] // 2**level) ** 2 for level, width in enumerate(vae["channels"]))
    assert ENCODE_BATCH * widest * 4 <= MMAP_THRESHOLD
    judge = yaml.safe_load((cards / "fashion-classifier" / "card.yaml").read_text())["components"]["classifier"]
    assert JUDGE_BATCH * judge["config"]["width"] * 28 * 28 * 4 <= MMAP_THRESHOLD  # its first two layers' output


def test_another_c_library_leaves_the_allocator_alone(monkeypatch):
    """Without glibc's `gnu_get_libc_version` (musl, macOS) mallopt's numbers mean other things: nothing is set."""
    import ctypes

    from cardtool.backends import host_allocator

    class NotGlibc:
        def __init__(self, name):
            pass

        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", NotGlibc)
    monkeypatch.setattr(host_allocator, "_done", None)
    monkeypatch.delenv("CARDTOOL_HOST_ALLOCATOR", raising=False)
    assert host_allocator.keep_freed_memory() is False
