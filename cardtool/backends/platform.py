"""The platform: which device and arch this process runs on, detected honestly and cheaply.

CUDA only when torch reports a CUDA device (arch from its compute capability); else torch on the host CPU
when torch is installed (arch = the ISA tier read from the CPU flags); else the numpy CPU rung. `--device`
or CARDTOOL_DEVICE overrides the device, CARDTOOL_ARCH forces an arch so arch paths are testable without
the hardware. Detection never imports torch into a process that has not imported it already: when a GPU
driver is present it asks torch in a subprocess, so light commands stay light and no CUDA context is made.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform as host
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.backends.chains import ARCH_TIERS, DEVICES, arch_tiers, component_chain, kernel_chain
from cardtool.errors import BadInput

__all__ = ["Platform", "cpu_tier"]


@dataclass(frozen=True)
class Platform:
    device: str  # "cuda" | "cpu" (torch on the host CPU) | "numpy"
    arch: str  # "sm90", "avx512_bf16", "generic", …
    name: str = field(default="", compare=False)  # the GPU or CPU model, for people
    why: tuple[str, ...] = field(default=(), compare=False)  # how the device and arch were decided
    # a CUDA arch forced (CARDTOOL_ARCH) on a machine without a CUDA device: cells are listed and resolved as
    # on that arch, but nothing runs (platform detect/matrix work; generate, parity and train refuse cleanly)
    simulated: bool = False

    @property
    def tiers(self) -> tuple[str, ...]:
        return arch_tiers(self.device, self.arch)

    def kernel_chain(self) -> list[tuple[str, str]]:
        return kernel_chain(self.device, self.arch)

    def component_chain(self) -> list[str]:
        return component_chain(self.device)

    @property
    def supports_bf16(self) -> bool:
        """Fast bfloat16 compute: CUDA from sm80 (Ampere) on, CPUs on the avx512_bf16 tier."""
        if self.device == "cuda":
            return self.arch[2:].isdecimal() and int(self.arch[2:]) >= 80
        return self.device == "cpu" and "avx512_bf16" in self.tiers

    @property
    def torch_device(self) -> str:
        """The torch device string for tensors on this platform (`numpy` has none)."""
        if self.device == "numpy":
            raise BadInput("the numpy platform has no torch device, which this needs (training, a classifier); use "
                           "--device cpu or cuda")
        if self.simulated:
            raise BadInput(f"{self.device}/{self.arch} is simulated ({', '.join(self.why[-1:])}): there is no CUDA "
                           "device to run on; unset CARDTOOL_DEVICE and CARDTOOL_ARCH, or use --device cpu")
        return self.device

    def to_json(self) -> dict:
        return {"device": self.device, "arch": self.arch, "name": self.name, "simulated": self.simulated,
                "tiers": list(self.tiers),
                "kernel_chain": ["/".join(c) for c in self.kernel_chain()],
                "component_chain": self.component_chain(), "why": list(self.why)}

    @classmethod
    def detect(cls, device: str | None = None, arch: str | None = None) -> Platform:
        """Detect the platform; `device` (from --device) beats CARDTOOL_DEVICE, CARDTOOL_ARCH forces the arch."""
        why, source = [], ""  # source: where a device not given with --device came from, for the messages
        if device:
            why.append(f"device {device} asked for with --device")
        elif os.environ.get("CARDTOOL_DEVICE"):
            device, source = os.environ["CARDTOOL_DEVICE"], "CARDTOOL_DEVICE: "
            why.append(f"device {device} forced by CARDTOOL_DEVICE")
        if device is not None and device not in DEVICES:
            # torch's `cuda:1`: the GPU is chosen as CUDA chooses it, so every process of a run agrees on it
            hint = (f" (a GPU by number: CUDA_VISIBLE_DEVICES={device.partition(':')[2]} with --device cuda)"
                    if isinstance(device, str) and device.startswith("cuda:") else "")
            raise BadInput(f"{source}unknown device '{device}'; choose one of: {', '.join(DEVICES)}{hint}")
        forced_arch = arch or os.environ.get("CARDTOOL_ARCH") or None
        has_torch = importlib.util.find_spec("torch") is not None

        cuda = None
        if device in (None, "cuda") and has_torch:
            cuda = _cuda_probe()
        if device is None:
            if cuda:
                device = "cuda"
                why.append(f"torch reports CUDA device {cuda['name']} (capability {cuda['capability']})")
            elif has_torch:
                device = "cpu"
                why.append("torch is installed and reports no CUDA device: torch on the host CPU")
            else:
                device = "numpy"
                why.append("torch is not installed: the numpy CPU rung")
        if device in ("cpu", "cuda") and not has_torch:
            raise BadInput(f"device {device} needs torch, which is not installed (pip install torch==2.13.0)")

        if device == "numpy":  # one arch only: a forced arch is for the torch devices
            return cls("numpy", "generic", _cpu_name(), tuple(why))
        if forced_arch:
            if forced_arch not in ARCH_TIERS[device] and not (device == "cuda" and forced_arch.startswith("sm")):
                source = "" if arch else "CARDTOOL_ARCH: "
                cuda_arch = (f" ({forced_arch} is a CUDA arch: it applies with --device cuda)"
                             if device == "cpu" and forced_arch.startswith("sm") else "")
                raise BadInput(f"{source}unknown {device} arch '{forced_arch}'; known: "
                               f"{', '.join(ARCH_TIERS[device])}{cuda_arch}")
            why.append(f"arch {forced_arch} forced by CARDTOOL_ARCH")
            simulated = device == "cuda" and not cuda
            if simulated:
                why.append("no CUDA device here: simulated, nothing runs")
            return cls(device, forced_arch, cuda["name"] if cuda else _cpu_name(), tuple(why), simulated)
        if device == "cuda":
            if not cuda:
                raise BadInput(f"{source}device cuda asked for, but torch reports no CUDA device: {_no_cuda_reason()}; "
                               f"use --device cpu{' or unset CARDTOOL_DEVICE' if source else ''} (CARDTOOL_ARCH=sm90 "
                               "simulates a GPU for `cardtool platform`)")
            major, minor = cuda["capability"]
            return cls("cuda", f"sm{major}{minor}", cuda["name"], tuple(why))
        tier, flags = cpu_tier()
        why.append(f"CPU flags {flags}: ISA tier {tier}" if flags else f"CPU flags unknown: ISA tier {tier}")
        return cls("cpu", tier, _cpu_name(), tuple(why))


def cpu_tier(flags_text: str | None = None, vendor: str | None = None, family: str | None = None) -> tuple[str, str]:
    """The CPU's tier (zen5, zen4, avx512_bf16, avx2 or generic) and the flags (vendor and family) that decided it.
    zen4 is avx512_bf16 on an AMD CPU (Zen 4 is AMD's first with AVX-512): the same ISA, other fastest paths; zen5 is
    one of family 26 (Zen 5) or later, whose AVX-512 units are full width where Zen 4's run two 256-bit halves
    (`cpu_zen4.py` says what that changes)."""
    if flags_text is None:
        flags_text, vendor, family = _cpu_field("flags"), _cpu_field("vendor_id"), _cpu_field("cpu family")
    flags = set(flags_text.split())
    if "avx512_bf16" in flags and vendor == "AuthenticAMD":
        if not (family or "").isdecimal():
            return "zen4", "include avx512_bf16 on an AMD CPU (AuthenticAMD)"
        if int(family) >= 26:
            return "zen5", f"include avx512_bf16 on an AMD CPU (AuthenticAMD, family {family}: Zen 5 or later)"
        return "zen4", f"include avx512_bf16 on an AMD CPU (AuthenticAMD, family {family}: Zen 4)"
    for tier in ("avx512_bf16", "avx2"):
        if tier in flags:
            return tier, f"include {tier}"
    return "generic", "have neither avx512_bf16 nor avx2" if flags else ""


def _cpu_field(name: str) -> str:
    """A field of the first CPU in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    return _cpu_field("model name") or host.processor() or host.machine()


_PROBE = ("import json, torch; ok = torch.cuda.is_available(); "
          "print(json.dumps({'name': torch.cuda.get_device_name(0), 'capability': torch.cuda.get_device_capability(0)}"
          " if ok else None))")


def _no_cuda_reason() -> str:
    """Why torch sees no GPU, as far as can be told without importing it: its build, the driver, the environment."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        build = version("torch")
    except PackageNotFoundError:
        build = ""
    if build.endswith("+cpu"):
        return f"the installed torch {build} is a CPU-only build"
    if not _has_nvidia_driver():
        return "this machine shows no NVIDIA driver"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={visible!r} hides them" if visible is not None else "the driver lists none for it"


def _has_nvidia_driver() -> bool:
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def _cuda_probe() -> dict | None:
    """What torch says about CUDA device 0: in this process if torch is already imported, else in a
    subprocess — and only when an NVIDIA driver is present, so CPU machines pay nothing."""
    if "torch" in sys.modules:
        import torch

        if not torch.cuda.is_available():
            return None
        return {"name": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0))}
    if not _has_nvidia_driver():
        return None
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
