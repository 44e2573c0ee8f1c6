"""Out-of-tree cells arrive through the `cardtool.backends` entry point; detection is honest and overridable."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from cardtool.backends import platform as platform_module
from cardtool.backends import registry
from cardtool.backends.platform import Platform, cpu_tier
from cardtool.cli import app
from cardtool.errors import BadInput

PLUGIN = '''
def register(components, kernels):
    kernels.register("cfg_combine", "cpu", "avx2", "default", target="dummy_backend.ops:cfg_combine",
                     requires=("torch",), dtypes=("float32",))
    components.register("toy-vae", "numpy", "default", target="dummy_backend.ops:ToyVae")
'''
OPS = '''
from cardtool.backends.torch_ops import cfg_combine


class ToyVae:
    pass
'''


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch, kernels):
    """A small installed distribution (a package plus its dist-info) registering one kernel and one component."""
    site = tmp_path / "site"
    (site / "dummy_backend").mkdir(parents=True)
    (site / "dummy_backend" / "__init__.py").write_text(PLUGIN)
    (site / "dummy_backend" / "ops.py").write_text(OPS)
    info = site / "dummy_backend-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[cardtool.backends]\ndummy = dummy_backend:register\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_plugin_errors", [])
    yield site
    for module in ("dummy_backend", "dummy_backend.ops"):
        sys.modules.pop(module, None)


def test_entry_point_cells_are_registered_and_resolved(installed_plugin):
    cell, fn = registry.KERNELS.resolve("cfg_combine", Platform("cpu", "avx2"))
    assert cell.name == "cfg_combine/cpu/avx2/default" and cell.source == "dummy-backend"
    assert fn.__module__ == "cardtool.backends.torch_ops"
    component = registry.COMPONENTS.resolve("toy-vae", Platform("cpu", "avx2"))[0]
    assert component.name == "toy-vae/numpy/default", "the cpu component chain ends at numpy"


def test_plugin_cells_show_in_the_matrix_with_their_source(installed_plugin, monkeypatch):
    monkeypatch.setenv("CARDTOOL_ARCH", "avx2")
    result = CliRunner().invoke(app, ["platform", "matrix", "--op", "cfg_combine", "--json"])
    assert result.exit_code == 0
    cells = {c["cell"]: c for c in json.loads(result.stdout)["cells"]}
    assert cells["cfg_combine/cpu/avx2/default"]["source"] == "dummy-backend"
    assert cells["cfg_combine/cpu/avx2/default"]["available"]
    assert set(cells) == {"cfg_combine/numpy/generic/default", "cfg_combine/cpu/generic/default",
                          "cfg_combine/cuda/generic/default", "cfg_combine/cpu/avx2/default"}


def test_a_broken_plugin_is_reported_not_fatal(installed_plugin):
    broken = "def register(components, kernels):\n    raise RuntimeError('boom')\n"
    (installed_plugin / "dummy_backend" / "__init__.py").write_text(broken)
    cell = registry.KERNELS.resolve("cfg_combine", Platform("cpu", "avx2"))[0]
    assert cell.name == "cfg_combine/cpu/generic/default"
    assert registry.plugin_errors() == ["dummy_backend:register (dummy): RuntimeError: boom"]


def test_cpu_tier_from_flags():
    assert cpu_tier("fpu sse avx2 avx512f avx512_bf16") == ("avx512_bf16", "include avx512_bf16")
    assert cpu_tier("fpu sse avx2") == ("avx2", "include avx2")
    assert cpu_tier("fpu sse") == ("generic", "have neither avx512_bf16 nor avx2")
    amd = "fpu sse avx2 avx512f avx512_bf16"
    assert cpu_tier(amd, "AuthenticAMD") == ("zen4", "include avx512_bf16 on an AMD CPU (AuthenticAMD)")
    assert cpu_tier(amd, "GenuineIntel")[0] == "avx512_bf16"
    assert cpu_tier("fpu sse avx2", "AuthenticAMD")[0] == "avx2", "an AMD CPU without AVX-512 is an avx2 one"


def test_detect_on_this_machine_is_torch_on_the_cpu(monkeypatch):
    monkeypatch.delenv("CARDTOOL_DEVICE", raising=False)
    monkeypatch.delenv("CARDTOOL_ARCH", raising=False)
    monkeypatch.setattr(platform_module, "_cuda_probe", lambda: None)
    detected = Platform.detect()
    assert detected.device == "cpu" and detected.arch == cpu_tier()[0]
    assert detected.why[0] == "torch is installed and reports no CUDA device: torch on the host CPU"


def test_detect_reports_cuda_from_torchs_capability(monkeypatch):
    monkeypatch.delenv("CARDTOOL_DEVICE", raising=False)
    monkeypatch.delenv("CARDTOOL_ARCH", raising=False)
    monkeypatch.setattr(platform_module, "_cuda_probe", lambda: {"name": "NVIDIA H200", "capability": [9, 0]})
    detected = Platform.detect()
    assert (detected.device, detected.arch, detected.tiers) == ("cuda", "sm90", ("sm90a", "sm80"))


def test_detect_without_torch_is_the_numpy_rung(monkeypatch):
    monkeypatch.delenv("CARDTOOL_DEVICE", raising=False)
    monkeypatch.setattr(platform_module.importlib.util, "find_spec", lambda name: None)
    assert Platform.detect() == Platform("numpy", "generic")
    with pytest.raises(BadInput, match="needs torch"):
        Platform.detect("cpu")


def test_overrides_force_device_and_arch(monkeypatch):
    monkeypatch.setenv("CARDTOOL_DEVICE", "cuda")
    monkeypatch.setenv("CARDTOOL_ARCH", "sm120")
    forced = Platform.detect()
    assert (forced.device, forced.arch) == ("cuda", "sm120")
    assert "arch sm120 forced by CARDTOOL_ARCH" in forced.why
    assert Platform.detect("numpy").device == "numpy", "--device beats the environment"
    monkeypatch.setenv("CARDTOOL_ARCH", "avx2")
    assert Platform.detect("cpu") == Platform("cpu", "avx2")


def test_bad_overrides_are_bad_input(monkeypatch):
    with pytest.raises(BadInput, match="unknown device 'tpu'"):
        Platform.detect("tpu")
    with pytest.raises(BadInput, match=r"'cuda:1'.*\(a GPU by number: CUDA_VISIBLE_DEVICES=1 with --device cuda\)"):
        Platform.detect("cuda:1")
    with pytest.raises(BadInput, match=r"unknown device '\[1\]'"):  # the Python API's callers pass anything
        Platform.detect([1])
    monkeypatch.setenv("CARDTOOL_DEVICE", "CPU")  # set in a profile and forgotten: the message says where it is
    with pytest.raises(BadInput, match="^CARDTOOL_DEVICE: unknown device 'CPU'; choose one of: cuda, cpu, numpy$"):
        Platform.detect()
    assert Platform.detect("cpu").device == "cpu", "--device beats the environment, also a bad one"
    monkeypatch.delenv("CARDTOOL_DEVICE")
    monkeypatch.setenv("CARDTOOL_ARCH", "avx9000")
    with pytest.raises(BadInput, match="CARDTOOL_ARCH: unknown cpu arch 'avx9000'"):
        Platform.detect("cpu")
    monkeypatch.setenv("CARDTOOL_ARCH", "sm90")  # a GPU's arch on the CPU: said so, not only refused
    with pytest.raises(BadInput, match=r"'sm90'; known: .* \(sm90 is a CUDA arch: it applies with --device cuda\)"):
        Platform.detect("cpu")


@pytest.mark.parametrize(("build", "driver", "visible", "reason"), [
    ("2.13.0+cpu", True, None, "the installed torch 2.13.0[+]cpu is a CPU-only build"),
    ("2.13.0", False, None, "this machine shows no NVIDIA driver"),
    ("2.13.0+cu128", True, "", "CUDA_VISIBLE_DEVICES='' hides them"),
    ("2.13.0+cu128", True, None, "the driver lists none for it"),
])
def test_asking_for_cuda_without_a_device_explains_why_as_far_as_it_can_tell(monkeypatch, build, driver, visible,
                                                                              reason):
    import importlib.metadata

    monkeypatch.delenv("CARDTOOL_ARCH", raising=False)
    monkeypatch.setattr(platform_module, "_cuda_probe", lambda: None)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: build)
    monkeypatch.setattr(platform_module.Path, "exists", lambda self: driver and "nvidia" in str(self))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(BadInput, match=f"torch reports no CUDA device: {reason}; use --device cpu"):
        Platform.detect("cuda")
    monkeypatch.setenv("CARDTOOL_DEVICE", "cuda")
    with pytest.raises(BadInput, match=f"^CARDTOOL_DEVICE: device cuda asked for, but torch reports no CUDA device: "
                                       f"{reason}; use --device cpu or unset CARDTOOL_DEVICE "):
        Platform.detect()


def test_a_forced_cuda_arch_without_cuda_is_simulated_and_runs_nothing(monkeypatch, examples, tmp_path):
    monkeypatch.setattr(platform_module, "_cuda_probe", lambda: None)
    monkeypatch.setenv("CARDTOOL_DEVICE", "cuda")
    monkeypatch.setenv("CARDTOOL_ARCH", "sm90")
    simulated = Platform.detect()
    assert (simulated.device, simulated.arch, simulated.simulated) == ("cuda", "sm90", True)
    cell = registry.KERNELS.implementation("attention")
    assert registry.KERNELS.resolve("attention", Platform("cuda", "sm90"))[0].key[1] == "cuda", "a fake one runs"
    with pytest.raises(BadInput, match="simulated"):
        registry.KERNELS.resolve(cell.key[0], simulated)
    result = CliRunner().invoke(app, ["generate", str(examples / "tiny-base"), "-p", "x", "--steps", "1", "--out",
                                      str(tmp_path)])
    assert result.exit_code == 2 and "simulated" in result.stderr, result.output
    matrix = CliRunner().invoke(app, ["platform", "matrix", "--json"])
    assert matrix.exit_code == 0 and json.loads(matrix.stdout)["platform"]["simulated"] is True


def test_the_matrix_for_people_marks_the_oracle_each_cell_that_runs_and_why_the_others_do_not():
    table = CliRunner().invoke(app, ["platform", "matrix", "--device", "cpu", "--op", "linear"],
                               env={"COLUMNS": "1000", "CARDTOOL_ARCH": "avx2"})
    rows = {line.split()[0]: line.split(None, 1)[1].strip() for line in table.stdout.splitlines() if "linear/" in line}
    assert table.exit_code == 0 and rows["linear/numpy/generic/default"].startswith("yes (oracle)   builtin")
    assert rows["linear/cpu/avx2/default"].split() == ["yes", "builtin"]
    assert rows["linear/cuda/generic/default"].split(None, 2) == ["no", "builtin",
                                                                  "cuda/generic is not on the chain of cpu/avx2"]


def test_matrix_available_lists_only_the_cells_that_run_here():
    def cells(*extra):
        result = CliRunner().invoke(app, ["platform", "matrix", "--device", "cpu", "--json", *extra],
                                    env={"CARDTOOL_ARCH": "avx2"})
        return {row["cell"]: row["available"] for row in json.loads(result.stdout)["cells"]}

    every, here = cells(), cells("--available")
    assert here == {cell: True for cell, available in every.items() if available}
    assert "linear/cpu/avx2/default" in here and not any(cell.startswith("linear/cuda") for cell in here)


def test_matrix_refuses_an_unknown_op():
    result = CliRunner().invoke(app, ["platform", "matrix", "--op", "NOSUCHOP"])
    assert result.exit_code == 2 and "unknown op or component 'NOSUCHOP'" in result.stderr


def test_platform_detect_cli_json(monkeypatch):
    monkeypatch.setenv("CARDTOOL_ARCH", "avx2")
    result = CliRunner().invoke(app, ["platform", "detect", "--device", "cpu", "--json"])
    assert result.exit_code == 0
    shown = json.loads(result.stdout)
    assert shown["kernel_chain"] == ["cpu/avx2", "cpu/generic", "numpy/generic"]
    assert CliRunner().invoke(app, ["platform", "detect", "--device", "tpu"]).exit_code == 2
    people = CliRunner().invoke(app, ["platform", "detect", "--device", "cpu"], env={"COLUMNS": "1000"})
    lines = people.stdout.splitlines()
    assert people.exit_code == 0 and lines[0].startswith("cpu / avx2  "), people.stdout
    assert lines[1:3] == ["kernel chain:    cpu/avx2 → cpu/generic → numpy/generic", "component chain: cpu → numpy"]
    assert "  because device cpu asked for with --device" in lines[3:]


def test_fast_bfloat16_is_cuda_from_sm80_and_cpus_on_the_avx512_bf16_tier():
    """What decides the slow-bfloat16 warning and the bf16 cells: Ampere and later GPUs, avx512_bf16 CPUs."""
    from cardtool.backends.platform import Platform

    fast = {(device, arch): Platform(device, arch).supports_bf16 for device, arch in (
        ("cuda", "sm80"), ("cuda", "sm90"), ("cuda", "sm120"), ("cuda", "sm75"), ("cuda", "smx"),
        ("cpu", "avx512_bf16"), ("cpu", "avx2"), ("cpu", "generic"), ("numpy", "generic"))}
    assert [key for key, value in fast.items() if value] == [("cuda", "sm80"), ("cuda", "sm90"), ("cuda", "sm120"),
                                                             ("cpu", "avx512_bf16")]
    with pytest.raises(BadInput, match="the numpy platform has no torch device"):
        _ = Platform("numpy", "generic").torch_device
    assert Platform("cpu", "avx2").torch_device == "cpu"


def test_a_plugin_component_without_a_schema_validates_on_its_own_terms(kernels, examples):
    """A component plugin that declares a kind but no config schema: its config and weights are its own business,
    so the card validates, and the loop's size checks leave out the component they know nothing of (a plugin VAE with
    an 8-channel config the built-in DiT could never take is not compared to it)."""
    from cardtool.core.cards.loader import load_card

    registry.COMPONENTS.register("toy-vae", "cpu", "default", target="cardtool.backends.builders:conv_vae_torch",
                                 kind="vae")
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("impl: conv-vae\n    config: {latent_channels: 4,",
                                                     "impl: toy-vae\n    config: {latent_channels: 8, anything: 1,"))
    result = CliRunner().invoke(app, ["cards", "validate", "--json", str(examples / "tiny-base")])
    assert result.exit_code == 0, result.output
    assert load_card(examples / "tiny-base").manifest.components["vae"].impl == "toy-vae"
