"""glibc's allocator set for tensor work on the CPU: memory a step frees is kept for the next step's tensors instead of
being returned to the OS and faulted in again, page by page.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised to the largest block freed so far) with
fresh pages from the kernel, and returns the top of its heap to the kernel once more than the trim threshold (twice the
mmap threshold) lies free there. A denoising step allocates and frees a few MiB of activations per layer in patterns
that keep crossing both: a float32 fashion-base forward on 64 images with 8 LoRAs took 47–59 thousand minor page faults
per 20 forwards on the 2-core Zen 5 EPYC, 0.41–0.46 s, and 3–4 faults, 0.33–0.34 s, with the thresholds fixed —
the no-adapter forward 0.31 → 0.24 s in one benchmark run (`benchmarks/adapters_forward.py`). PyTorch's CPU tuning
guide recommends a caching allocator (jemalloc, tcmalloc) preloaded for the same reason; this needs no preload.

The thresholds are fixed (fixing them also stops glibc's own adjustment): blocks up to 32 MiB, the most glibc allows,
come from the heap, and up to 256 MiB may lie free at its top. A process that builds a torch component on the CPU
(`builders`) or trains there (`trainer`) sets them once; `CARDTOOL_HOST_ALLOCATOR=system` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, once; whether they are fixed. False where the C library
    is not glibc or `CARDTOOL_HOST_ALLOCATOR=system` asks for its defaults."""
    global _done
    if _done is None:
        choice = os.environ.get("CARDTOOL_HOST_ALLOCATOR", "").strip().lower()
        if choice not in ("", "system"):  # a misspelt "system" would keep the thresholds without a word
            from cardtool.errors import BadInput

            raise BadInput(f"CARDTOOL_HOST_ALLOCATOR is {choice[:40]!r}; set it to system (glibc's own thresholds) "
                           "or leave it unset")
        _done = choice != "system" and _set_thresholds()
    return _done


def _set_thresholds() -> bool:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc alone has it; another libc's mallopt means other things
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # both or neither: either set alone stops glibc's adjustment and leaves the other at 128 KiB (the trim threshold
    # alone: ten times the defaults' page faults in the forward above)
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
