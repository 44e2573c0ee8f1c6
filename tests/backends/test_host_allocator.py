"""glibc's allocator kept from handing freed tensor memory back to the kernel (host_allocator): a process that builds a
torch component on the CPU re-uses what it freed instead of faulting fresh pages in; CARDTOOL_HOST_ALLOCATOR=system
keeps glibc's defaults. Each case runs in a process of its own: the setting is the process's."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

# A 24 MiB tensor made, freed and made again, as one denoising step's activations and the next's: with glibc's
# defaults the first is mapped apart and handed back to the kernel when freed, so the second faults 24 MiB of fresh
# pages in (6,144 of 4 KiB); kept, the second re-uses the first's memory.
SCRIPT = """
import json, resource, torch
torch.set_num_threads(1)
from cardtool.backends import builders, host_allocator
builders._torch_module(lambda: torch.nn.Linear(2, 2), None, "cpu", "float32")
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step = torch.ones(6 * 2**20)
del step
start = faults()
step = torch.ones(6 * 2**20)
print(json.dumps({"fixed": host_allocator.keep_freed_memory(), "faults": faults() - start}))
"""


def _run(**env) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_cpu_component_build_keeps_freed_memory_for_the_next_tensors():
    kept, system = _run(CARDTOOL_HOST_ALLOCATOR=""), _run(CARDTOOL_HOST_ALLOCATOR="system")
    assert kept["fixed"] and not system["fixed"]
    assert system["faults"] > 5_000, system
    assert kept["faults"] < 500, kept
