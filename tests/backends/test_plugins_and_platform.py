"""Out-of-tree cells arrive through the `cardtool.backends` entry point; detection is honest and overridable."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import REPO
from typer.testing import CliRunner

from cardtool.backends import platform as platform_module
from cardtool.backends import registry
from cardtool.backends.parity import run_parity
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


def install(tmp_path, monkeypatch, package: str, register: str, ops: str, name: str | None = None,
            entry: str = "dummy", target: str | None = None):
    """A small installed distribution (a package plus its dist-info) whose entry point `entry` is `target`
    (`package:register`); the plugins are loaded again on next use."""
    site = tmp_path / "site"
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(register)
    (site / package / "ops.py").write_text(ops)
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name or package.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[cardtool.backends]\n{entry} = {target or package + ':register'}\n")
    monkeypatch.syspath_prepend(str(site))
    for module in (package, f"{package}.ops"):  # another test's package of that name, imported before
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr(registry, "_plugins_loaded", False)
    monkeypatch.setattr(registry, "_plugin_errors", [])
    return site


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch, kernels):
    """A plugin registering one kernel and one component."""
    yield install(tmp_path, monkeypatch, "dummy_backend", PLUGIN, OPS)
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


@pytest.fixture
def soft_cap_plugin(tmp_path, monkeypatch, kernels):
    """examples/plugin installed as pip would: its package, and a dist-info with its pyproject's entry point; the
    parity inputs it registers are replaced where a test asks."""
    from cardtool.core.cards.source import _toml

    plugin = REPO / "examples" / "plugin"
    project = _toml().loads((plugin / "pyproject.toml").read_text())["project"]
    [(name, target)] = project["entry-points"]["cardtool.backends"].items()

    def installed(inputs: str | None = None, tolerances: str | None = None):
        register = (plugin / "cardtool_soft_cap" / "__init__.py").read_text()
        if inputs is not None:
            register = register.replace("ops:parity_inputs", f"ops:{inputs}")
        if tolerances is not None:
            register = register.replace('{"bfloat16": (2e-2, 3e-2)}', tolerances)
        ops = (plugin / "cardtool_soft_cap" / "ops.py").read_text() + NOT_INPUTS
        return install(tmp_path, monkeypatch, "cardtool_soft_cap", register, ops, project["name"], name, target)

    yield installed
    for module in ("cardtool_soft_cap", "cardtool_soft_cap.ops"):
        sys.modules.pop(module, None)


NOT_INPUTS = """

def not_inputs(rng):
    return [("4x8", {"x": rng.standard_normal((4, 8))})]


def floats_not_a_dict(rng):
    return [("4x8", [rng.standard_normal((4, 8))], {"cap": 2.0})]


def fixed_not_a_dict(rng):
    return [("4x8", {"x": rng.standard_normal((4, 8))}, 2.0)]


def keys_not_text(rng):
    return [("4x8", {"x": rng.standard_normal((4, 8))}, {1: 2.0})]


def label_not_text(rng):
    return [(48, {"x": rng.standard_normal((4, 8))}, {"cap": 2.0})]


def no_inputs(rng):
    return []
"""


def test_an_op_a_plugin_adds_is_held_to_its_reference_on_the_inputs_the_plugin_gives(soft_cap_plugin, kernels,
                                                                                    monkeypatch):
    soft_cap_plugin()
    registry.load_plugins()
    kernels.register("soft_cap", "cpu", "avx2", "default", target="wrong_kernels:soft_cap_clamped")
    monkeypatch.setenv("CARDTOOL_ARCH", "avx2")
    result = CliRunner().invoke(app, ["parity", "--device", "cpu", "--op", "soft_cap", "--json"])
    assert result.exit_code == 1, result.output  # the clamp fails
    rows = {(r["cell"], r["dtype"]): r for r in json.loads(result.stdout)["rows"]}
    assert {key: row["passed"] for key, row in rows.items()} == {
        ("soft_cap/cpu/generic/default", "float64"): True, ("soft_cap/cpu/generic/default", "float32"): True,
        ("soft_cap/cpu/generic/default", "bfloat16"): True, ("soft_cap/cpu/avx2/default", "float64"): False,
        ("soft_cap/cpu/avx2/default", "float32"): False,
        ("soft_cap/cpu/avx2/default", "bfloat16"): True,  # against itself in float32, which fails against numpy
    }, {key: row["error"] for key, row in rows.items()}
    right = rows[("soft_cap/cpu/generic/default", "float64")]
    assert right["shapes"] == ["4x8, cap 2: most values saturate", "2x3x5, cap 50: nearly the identity"]
    assert 0 <= right["max_abs_err"] < 1e-12
    assert rows[("soft_cap/cpu/avx2/default", "float64")]["max_abs_err"] > 0.1
    # the plugin's bfloat16 tolerance, the table's elsewhere
    tolerance = {dtype: (rows[("soft_cap/cpu/generic/default", dtype)]["atol"],
                         rows[("soft_cap/cpu/generic/default", dtype)]["rtol"]) for dtype in ("bfloat16", "float32")}
    assert tolerance == {"bfloat16": (0.02, 0.03), "float32": (1e-5, 1e-5)}
    source = registry.KERNELS.parity_inputs("soft_cap").source
    assert source == "cardtool-soft-cap", "the inputs record the plugin that gave them"


@pytest.mark.parametrize(("inputs", "error"), [
    *((name, "must return a list of (label, floats, fixed)") for name in (
        "not_inputs", "floats_not_a_dict", "fixed_not_a_dict", "keys_not_text", "label_not_text", "no_inputs")),
    ("missing", "AttributeError")])
def test_parity_inputs_that_are_not_cases_fail_the_rows_naming_the_function(soft_cap_plugin, inputs, error):
    soft_cap_plugin(inputs)
    rows = run_parity(Platform("cpu", "generic"), "soft_cap")
    assert rows and all(not r.passed and error in r.error for r in rows), [r.error for r in rows]
    if inputs == "not_inputs":
        assert "cardtool_soft_cap.ops:not_inputs (cardtool-soft-cap)" in rows[0].error


@pytest.mark.parametrize(("tolerances", "said"), [("{'bfloat8': (1, 1)}", "'bfloat8'"),
                                                   ("{'float16': (1e-3,)}", "(0.001,)"),
                                                   ("{'float16': (1e-3, float('nan'))}", "nan")])
def test_tolerances_a_plugin_cannot_mean_are_its_load_error(soft_cap_plugin, tolerances, said):
    soft_cap_plugin(tolerances=tolerances)
    errors = registry.plugin_errors()
    assert len(errors) == 1 and "tolerances map a dtype" in errors[0] and said in errors[0], errors


@pytest.mark.parametrize(("call", "said"), [
    ("kernels.register_inputs('rms_norm', target='x.ops:inputs')",
     "ValueError: 'rms_norm' is a built-in op: its parity inputs are cardtool's, and a plugin's cells of it are "
     "checked on them"),
    ("components.register_inputs('wan-dit', target='x.ops:inputs')",
     "ValueError: 'wan-dit' is a built-in component implementation: its parity inputs are cardtool's, and a "
     "plugin's cells of it are checked on them"),
    ("kernels.register_inputs('toy', target='x.ops.inputs')",
     "ValueError: parity inputs of 'toy': target must be 'package.module:function', got 'x.ops.inputs'")])
def test_parity_inputs_a_plugin_cannot_give_are_its_load_error(kernels, tmp_path, monkeypatch, call, said):
    install(tmp_path, monkeypatch, "other_inputs", f"def register(components, kernels):\n    {call}\n", "")
    assert registry.plugin_errors() == [f"other_inputs:register (dummy): {said}"]
    assert registry.KERNELS.parity_inputs("rms_norm") is None and registry.KERNELS.parity_inputs("toy") is None
    assert registry.COMPONENTS.parity_inputs("wan-dit").source == "builtin"
    sys.modules.pop("other_inputs", None)


@pytest.mark.parametrize(("call", "said"), [
    ("kernels.register('rms_norm', 'numpy', 'generic', 'default', target='wrong_kernels:numpy_attention')",
     "ValueError: rms_norm/numpy/generic/default is cardtool's numpy oracle of 'rms_norm', which parity holds the "
     "other cells to; add a numpy kernel as another variant (rms_norm/numpy/generic/NAME)"),
    ("components.register('wan-dit', 'numpy', 'default', target='wrong_kernels:numpy_attention')",
     "ValueError: wan-dit/numpy/default is cardtool's numpy oracle of 'wan-dit', which parity holds the other cells "
     "to; add a numpy component as another variant (wan-dit/numpy/NAME)"),
    ("components.register('arrays', 'numpy', 'default', target='wrong_kernels:numpy_attention')",  # reference loop's
     "ValueError: arrays/numpy/default is cardtool's numpy oracle of 'arrays', which parity holds the other cells "
     "to; add a numpy component as another variant (arrays/numpy/NAME)"),
    ("kernels.register('rms_norm', 'numpy', 'generic', 'fast', target='x:y', reference=True)",
     "ValueError: rms_norm/numpy/generic/fast: an op's oracle is its numpy/generic/default cell, where parity finds "
     "it; register this one without reference=True and parity checks it")])
def test_a_plugin_neither_replaces_an_ops_oracle_nor_takes_its_cell_out_of_parity(kernels, tmp_path, monkeypatch,
                                                                                 call, said):
    """Parity holds every cell of an op to its numpy/generic/default cell and skips reference cells: a plugin's cell
    there would make cardtool's kernels answer to the plugin's, and one marked reference elsewhere would go unchecked.
    Replacing a built-in cell that is not the oracle is what a plugin may do: parity then checks the plugin's."""
    install(tmp_path, monkeypatch, "other_cells", f"def register(components, kernels):\n    {call}\n", "")
    assert registry.plugin_errors() == [f"other_cells:register (dummy): {said}"]
    for found in (registry.KERNELS, registry.COMPONENTS):
        oracle = found.resolve("rms_norm" if found is registry.KERNELS else "wan-dit", Platform("numpy", "generic"))[0]
        assert (oracle.source, oracle.reference) == ("builtin", True)
    assert all(c.key[3] != "fast" for c in registry.KERNELS.cells() if c.key[0] == "rms_norm")
    sys.modules.pop("other_cells", None)


COMPONENT_PLUGIN = '''
def register(components, kernels):
    schema = "cardtool.backends.vae_config:ConvVAEConfig"
    components.register("toy-vae", "cpu", "default", target="toy_components.ops:torch_vae", kind="vae", schema=schema)
    components.register("toy-vae", "numpy", "default", target="toy_components.ops:numpy_vae", kind="vae", schema=schema)
    components.register_inputs("toy-vae", target="toy_components.ops:inputs", tolerances={"float32": (1e-3, 1e-3)})
'''
COMPONENT_OPS = '''
from cardtool.backends.builders import conv_vae_numpy, conv_vae_torch


def torch_vae(config, weights, source, platform, precision):
    return conv_vae_torch(config, weights, source, platform, precision)


def numpy_vae(config, weights, source, platform, precision):
    return conv_vae_numpy(config, weights, source, platform, precision)


class Paired:
    """The VAE, its decode giving the images twice where the numpy forward gives them once."""

    def __init__(self, vae):
        self.vae = vae

    def decode(self, latents):
        images = self.vae.decode(latents)
        return images, images


def paired_vae(config, weights, source, platform, precision):
    return Paired(conv_vae_torch(config, weights, source, platform, precision))


class Shifted:
    """The VAE, its decode 2e-3 off."""

    def __init__(self, vae):
        self.vae = vae

    def decode(self, latents):
        return self.vae.decode(latents) + 2e-3


def shifted_vae(config, weights, source, platform, precision):
    return Shifted(conv_vae_torch(config, weights, source, platform, precision))


def inputs(config, rng):
    z = rng.standard_normal((3, config["latent_channels"], 8, 8))
    return [("decode 3x4x8x8", "decode", {"latents": z}, {}), ("decode one", "decode", {"latents": z[:1]}, {})]


def popping_inputs(config, rng):
    config.pop("latent_channels")
    return inputs({**config, "latent_channels": 4}, rng)


def not_inputs(config, rng):
    return [("decode", {"latents": rng.standard_normal((1, 4, 8, 8))}, {})]


def floats_not_a_dict(config, rng):
    return [("decode", "decode", ["latents"], {})]


def keys_not_text(config, rng):
    return [("decode", "decode", {"latents": rng.standard_normal((1, 4, 8, 8))}, {0: 1})]


def method_not_text(config, rng):
    return [("decode", None, {"latents": rng.standard_normal((1, 4, 8, 8))}, {})]
'''


@pytest.fixture
def toy_vae_card(tmp_path, monkeypatch, kernels, examples):
    """A plugin adding the component 'toy-vae' in torch and numpy (the built-in VAE under another name) with its
    parity inputs, and tiny-base using it; `installed(...)` edits the plugin's registration first."""
    manifest = examples / "tiny-base" / "card.yaml"
    manifest.write_text(manifest.read_text().replace("impl: conv-vae", "impl: toy-vae"))

    def installed(*edits: tuple[str, str]):
        register = COMPONENT_PLUGIN
        for old, new in edits:
            register = register.replace(old, new)
        install(tmp_path, monkeypatch, "toy_components", register, COMPONENT_OPS)
        return examples / "tiny-base"

    yield installed
    for module in ("toy_components", "toy_components.ops"):
        sys.modules.pop(module, None)


def test_a_component_a_plugin_adds_is_held_to_its_numpy_forward_on_the_inputs_it_gives(toy_vae_card, kernels):
    """`parity --card` runs a plugin's component by the platform's cell and by its numpy forward on the card's
    weights, on the inputs the plugin registers, at its tolerances; a cell 2e-3 off fails both dtypes."""
    from cardtool.backends.component_parity import component_rows
    from cardtool.core.cards.loader import load_card

    card = toy_vae_card()
    result = CliRunner().invoke(app, ["parity", "--card", str(card), "--device", "cpu", "--op", "cfg_combine",
                                      "--json"])
    assert result.exit_code == 0, result.output
    rows = {(r["cell"], r["dtype"]): r for r in json.loads(result.stdout)["rows"] if r["cell"].startswith("vae:")}
    assert set(rows) == {("vae:toy-vae/cpu/generic", "float64"), ("vae:toy-vae/cpu/generic", "float32")}
    for (_, dtype), row in rows.items():
        assert row["passed"] and row["source"] == "toy-components" and row["shapes"] == ["decode 3x4x8x8",
                                                                                          "decode one"]
        assert (row["atol"], row["rtol"]) == {"float64": (1e-9, 1e-9), "float32": (1e-3, 1e-3)}[dtype]
        assert 0 <= row["max_abs_err"] < {"float64": 1e-12, "float32": 1e-4}[dtype]
    registry.COMPONENTS.register("toy-vae", "cpu", "default", target="toy_components.ops:shifted_vae", kind="vae")
    component = load_card(card).manifest.components["vae"]
    shifted = component_rows("vae", "toy-vae", component.config, card / "vae.safetensors", Platform("cpu", "generic"))
    assert [(r.dtype, r.passed) for r in shifted] == [("float64", False), ("float32", False)]
    assert all(abs(r.max_abs_err - 2e-3) < 1e-5 for r in shifted), [r.max_abs_err for r in shifted]


@pytest.mark.parametrize(("edit", "error"), [
    (("components.register_inputs(", "0 and components.register_inputs("),
     "LookupError: 'toy-vae' has a numpy forward but no parity inputs: the plugin that adds it registers none "
     "(components.register_inputs)"),
    *((("ops:inputs", f"ops:{name}"),
       f"TypeError: toy_components.ops:{name} (toy-components), the parity inputs of 'toy-vae', must return a list "
       "of (label, method, floats, fixed)") for name in ("not_inputs", "floats_not_a_dict", "keys_not_text",
                                                         "method_not_text")),
    (('components.register("toy-vae", "numpy"', '0 and components.register("toy-vae", "numpy"'),
     "NoCellAvailable: nothing can run component 'toy-vae' (variant default) on numpy/generic"),
    (('components.register("toy-vae"', '0 and components.register("toy-vae"'),
     "NoCellAvailable: no component cell named 'toy-vae'"),  # its inputs alone
    (("ops:torch_vae", "ops:paired_vae"), "ValueError: zip() argument 2 is shorter than argument 1")])
def test_a_plugin_component_that_cannot_be_compared_fails_its_rows_saying_why(toy_vae_card, edit, error):
    from cardtool.backends.component_parity import component_rows

    card = toy_vae_card(edit)
    assert registry.plugin_errors() == []
    config = {"latent_channels": 4, "channels": [8, 16, 32]}  # tiny-base's
    rows = component_rows("vae", "toy-vae", config, card / "vae.safetensors", Platform("cpu", "generic"))
    assert [r.dtype for r in rows] == ["float64", "float32"]
    assert all(not r.passed and r.error.startswith(error) for r in rows), [r.error for r in rows]
    assert all(r.source == "toy-components" for r in rows), "the rows name the plugin, whatever failed"


def test_a_plugins_inputs_get_a_copy_of_the_cards_config(toy_vae_card):
    from cardtool.backends.component_parity import component_rows
    from cardtool.core.cards.loader import load_card

    card = toy_vae_card(("ops:inputs", "ops:popping_inputs"))
    component = load_card(card).manifest.components["vae"]
    rows = component_rows("vae", "toy-vae", component.config, card / "vae.safetensors", Platform("cpu", "generic"))
    assert [r.passed for r in rows] == [True, True] and component.config["latent_channels"] == 4


def test_a_component_compared_with_nothing_has_no_rows_and_is_reported_unchecked(toy_vae_card):
    """Where the platform's chain ends at the numpy forward itself (no cpu cell) there is nothing to compare; the
    report's `unchecked` says which and why (and on numpy, everything: it is the reference)."""
    from cardtool.backends.component_parity import component_rows
    from cardtool.backends.parity import ParityRow
    from cardtool.core.cards.loader import load_card
    from cardtool.core.evaluation.card_parity import unchecked

    card = toy_vae_card(('components.register("toy-vae", "cpu"', '0 and components.register("toy-vae", "cpu"'))
    loaded = load_card(card)
    component = loaded.manifest.components["vae"]
    assert registry.COMPONENTS.resolve("toy-vae", Platform("cpu", "generic"))[0].key[1] == "numpy"
    assert component_rows("vae", "toy-vae", component.config, card / "vae.safetensors",
                          Platform("cpu", "generic")) == []
    compared = [ParityRow(f"{name}/cpu/generic", "float64", "numpy float64", [], 0, 0, 0, 0, True)
                for name in ("transformer:wan-dit", "text_encoder:hf-encoder")]
    said = {u["name"]: u["why"] for u in unchecked(loaded, Platform("cpu", "generic"), compared)}
    assert said == {"vae": "the cpu platform runs its numpy forward itself",
                    "adapters.invert": "no generation with it was compared"}
    numpy = unchecked(loaded, Platform("numpy", "generic"), [])
    assert {u["name"]: u["why"] for u in numpy if not u["name"].startswith("adapters.")} == {
        name: "numpy is the reference: nothing to compare it with" for name in ("text_encoder", "vae", "transformer")}


def test_a_plugin_may_replace_a_built_in_cell_that_is_not_the_oracle_and_parity_checks_it(kernels, tmp_path,
                                                                                         monkeypatch):
    call = "kernels.register('rms_norm', 'cpu', 'generic', 'default', target='wrong_kernels:rms_norm_eps_1e3')"
    install(tmp_path, monkeypatch, "other_cells", f"def register(components, kernels):\n    {call}\n", "")
    cell = registry.KERNELS.resolve("rms_norm", Platform("cpu", "generic"))[0]
    assert (cell.source, registry.plugin_errors()) == ("other-cells", [])
    rows = [r for r in run_parity(Platform("cpu", "generic"), "rms_norm") if r.cell == "rms_norm/cpu/generic/default"]
    assert rows and not any(r.passed for r in rows if r.dtype != "bfloat16"), "held to cardtool's oracle, and failed"
    sys.modules.pop("other_cells", None)


def test_cpu_tier_from_flags():
    assert cpu_tier("fpu sse avx2 avx512f avx512_bf16") == ("avx512_bf16", "include avx512_bf16")
    assert cpu_tier("fpu sse avx2") == ("avx2", "include avx2")
    assert cpu_tier("fpu sse") == ("generic", "have neither avx512_bf16 nor avx2")
    amd = "fpu sse avx2 avx512f avx512_bf16"
    assert cpu_tier(amd, "AuthenticAMD") == ("zen4", "include avx512_bf16 on an AMD CPU (AuthenticAMD)")
    assert cpu_tier(amd, "AuthenticAMD", "25") == (
        "zen4", "include avx512_bf16 on an AMD CPU (AuthenticAMD, family 25: Zen 4)"), "AVX-512 as two halves"
    assert cpu_tier(amd, "AuthenticAMD", "26") == (
        "zen5", "include avx512_bf16 on an AMD CPU (AuthenticAMD, family 26: Zen 5 or later)")
    assert cpu_tier(amd, "AuthenticAMD", "27")[0] == "zen5" and cpu_tier(amd, "AuthenticAMD", "x")[0] == "zen4"
    assert cpu_tier(amd, "GenuineIntel", "26")[0] == "avx512_bf16"
    assert cpu_tier(amd, "GenuineIntel")[0] == "avx512_bf16"
    assert cpu_tier("fpu sse avx2", "AuthenticAMD")[0] == "avx2", "an AMD CPU without AVX-512 is an avx2 one"


def test_cpu_tier_reads_the_vendor_and_family_from_cpuinfo(monkeypatch):
    fields = {"flags": "fpu avx2 avx512f avx512_bf16", "vendor_id": "AuthenticAMD", "cpu family": "26"}
    monkeypatch.setattr(platform_module, "_cpu_field", fields.get)
    assert cpu_tier()[0] == "zen5"
    fields["cpu family"] = "25"
    assert cpu_tier()[0] == "zen4"


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
