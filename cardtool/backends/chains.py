"""Device and arch fallback chains, as explicit tables (DESIGN.md §5).

A chain only ever walks to older or portable code, never to a newer arch: sm120 (consumer Blackwell) takes
the sm80-family tier, sm100 never receives sm90a-only code (wgmma/TMA kernels built for sm_90a do not run
there). After its arch tiers every device falls back to its device-generic torch code; the CPU chain ends
at the numpy reference, which is also the oracle for every other cell.
"""

from __future__ import annotations

__all__ = ["DEVICES", "ARCH_TIERS", "arch_tiers", "kernel_chain", "component_chain"]

DEVICES = ("cuda", "cpu", "numpy")

# arch → the arch-specific tiers whose kernels it may run, most specific first.
ARCH_TIERS: dict[str, dict[str, tuple[str, ...]]] = {
    "cuda": {
        "sm120": ("sm120", "sm80"),
        "sm100": ("sm100", "sm80"),
        "sm90": ("sm90a", "sm80"),
        "sm89": ("sm89", "sm80"),
        "sm86": ("sm86", "sm80"),
        "sm80": ("sm80",),
        "sm75": ("sm75",),
        "sm70": ("sm70",),
    },
    "cpu": {
        "zen5": ("zen5", "zen4", "avx512_bf16", "avx2"),  # AMD's full-width AVX-512 cores
        "zen4": ("zen4", "avx512_bf16", "avx2"),  # AMD's AVX-512 cores: the avx512_bf16 ISA, other fast paths
        "avx512_bf16": ("avx512_bf16", "avx2"),
        "avx2": ("avx2",),
        "generic": (),
    },
    "numpy": {"generic": ()},
}

GENERIC = "generic"


def arch_tiers(device: str, arch: str) -> tuple[str, ...]:
    """The arch-specific tiers `arch` may run. An unknown CUDA arch newer than sm80 gets only the
    portable sm80 tier (it cannot be assumed to run anything newer); an unknown older one gets none."""
    table = ARCH_TIERS[device]
    if arch in table:
        return table[arch]
    if device == "cuda" and arch.startswith("sm") and arch[2:].isdecimal() and int(arch[2:]) >= 80:
        return ("sm80",)
    return ()


def kernel_chain(device: str, arch: str) -> list[tuple[str, str]]:
    """(device, arch) cells to try for a kernel op, in order."""
    chain = [(device, tier) for tier in arch_tiers(device, arch)]
    if device != "numpy":
        chain.append((device, GENERIC))
    if device in ("cpu", "numpy"):
        chain.append(("numpy", GENERIC))
    return chain


def component_chain(device: str) -> list[str]:
    """Devices to try for a component implementation, in order."""
    return {"cuda": ["cuda"], "cpu": ["cpu", "numpy"], "numpy": ["numpy"]}[device]
