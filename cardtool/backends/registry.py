"""The registries `COMPONENTS(kind, device, variant)` and `KERNELS(op, device, arch, variant)`.

A cell is a key plus a dotted import path held as a string and the availability checks that give the
*reasons* it cannot run here (an empty list means it can). Nothing is imported until a cell is resolved,
so listing every cell stays light. Out-of-tree packages add cells through the entry-point group
`cardtool.backends`: each entry point names a function `register(components, kernels)`; a plugin that adds an op
gives `cardtool parity` its inputs with `kernels.register_inputs`, one that adds a component with a numpy forward
gives `parity --card` its inputs with `components.register_inputs` (`ParityInputs`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

from cardtool.backends.platform import Platform
from cardtool.errors import BadInput

__all__ = ["Cell", "ParityInputs", "Registry", "COMPONENTS", "KERNELS", "NoCellAvailable", "load_plugins",
           "plugin_errors"]

ENTRY_POINT_GROUP = "cardtool.backends"


class NoCellAvailable(BadInput):
    """Nothing on the platform's chain can run an op or component; the message lists every reason."""


@dataclass(frozen=True)
class Cell:
    key: tuple[str, ...]
    target: str  # "package.module:attribute", imported only on resolution
    requires: tuple[str, ...] = ()  # modules that must be importable
    check: str | None = None  # "package.module:function", called as function(platform) -> list[str]
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")  # what parity runs it at
    reference: bool = False  # the numpy oracle: parity compares the others against it
    source: str = "builtin"  # or the distribution whose entry point registered it
    kind: str | None = None  # components: the component kind it implements (dit, vae, text_encoder …)
    schema: str | None = None  # components: "module:Class", its ComponentConfig (config, needs, tensors)

    @property
    def name(self) -> str:
        return "/".join(self.key)

    def load(self) -> Callable:
        return _imported(self.target)


def _imported(target: str) -> Callable:
    """The attribute a "package.module:attribute" target names, its module imported now."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


PARITY_DTYPES = ("float64", "float32", "float16", "bfloat16")
ORACLE = ("numpy", "generic", "default")  # (device, arch, variant) of an op's numpy reference


@dataclass(frozen=True)
class ParityInputs:
    """What `cardtool parity` runs an op's cells on (an op a plugin adds: the built-in ops have theirs in
    backends/parity.py), or what `parity --card` runs a component implementation on, by torch and by its numpy
    forward, with a card's weights. `target` ("package.module:function") is called as function(rng) for an op and
    function(config, rng) for a component (config: the card's mapping), rng a seeded numpy Generator. An op's
    returns a list of (label, floats, fixed): the label the report shows (the shapes), `floats` the keyword arguments
    each precision rounds (numpy float arrays or numbers), `fixed` those passed as they are (integer or boolean
    arrays, options). A component's returns (label, method, floats, fixed): the method of the built component to call
    ("__call__" for the component itself) with those arguments. `tolerances`: dtype → (atol, rtol) where the op's or
    component's conditioning is not that of the default for the dtype."""
    name: str
    target: str
    tolerances: dict[str, tuple[float, float]] = field(default_factory=dict)
    source: str = "builtin"

    def load(self) -> Callable:
        return _imported(self.target)


class Registry:
    """Cells keyed by (name, device[, arch], variant), resolved along a platform's chain."""

    def __init__(self, title: str, fields: tuple[str, ...]):
        self.title, self.fields = title, fields
        self._cells: dict[tuple[str, ...], Cell] = {}
        self._resolved: dict[tuple, tuple[Cell, Callable]] = {}
        self._inputs: dict[str, ParityInputs] = {}

    def register(self, *key: str, target: str, requires: tuple[str, ...] = (), check: str | None = None,
                 dtypes: tuple[str, ...] | None = None, reference: bool = False, source: str = "builtin",
                 kind: str | None = None, schema: str | None = None) -> Cell:
        if len(key) != len(self.fields):
            raise ValueError(f"{self.title} keys are ({', '.join(self.fields)}), got {key}")
        name = "/".join(key)
        # parity resolves an op's oracle at numpy/generic/default and checks every other cell against it: a
        # reference elsewhere would only take that cell out of parity, and a plugin replacing the built-in
        # oracle would hold cardtool's cells to its own kernel
        if reference and "op" in self.fields and tuple(key[1:]) != ORACLE:
            raise ValueError(f"{name}: an op's oracle is its {'/'.join(ORACLE)} cell, where parity finds it; "
                             "register this one without reference=True and parity checks it")
        replaced = self._cells.get(tuple(key))
        if source != "builtin" and replaced is not None and replaced.source == "builtin" and replaced.reference:
            other = "/".join((*key[:-1], "NAME"))
            raise ValueError(f"{name} is cardtool's numpy oracle of '{key[0]}', which parity holds the other cells "
                             f"to; add a numpy {self.title} as another variant ({other})")
        if dtypes is None and key[self.fields.index("device")] == "numpy":  # numpy has no bfloat16 to run one at
            dtypes = ("float64", "float32")
        extra = {"dtypes": dtypes} if dtypes is not None else {}
        cell = Cell(tuple(key), target, tuple(requires), check, reference=reference, source=source, kind=kind,
                    schema=schema, **extra)
        self._cells[cell.key] = cell
        self._resolved.clear()
        return cell

    def register_inputs(self, name: str, *, target: str, tolerances: dict | None = None,
                        source: str = "builtin") -> ParityInputs:
        """The parity inputs of `name`: an op or a component implementation (see ParityInputs). A built-in op's or
        implementation's inputs are cardtool's: every cell of it, a plugin's too, is held to the same ones."""
        what = "op" if "op" in self.fields else "component implementation"
        if source != "builtin" and any(c.key[0] == name and c.source == "builtin" for c in self._cells.values()):
            raise ValueError(f"'{name}' is a built-in {what}: its parity inputs are cardtool's, and a plugin's cells "
                             "of it are checked on them")
        if not isinstance(target, str) or ":" not in target:
            raise ValueError(f"parity inputs of '{name}': target must be 'package.module:function', got {target!r}")
        checked = {}
        for dtype, pair in (tolerances or {}).items():
            if dtype not in PARITY_DTYPES or not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                    isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < float("inf") for t in pair)):
                raise ValueError(f"parity inputs of '{name}': tolerances map a dtype ({', '.join(PARITY_DTYPES)}) to "
                                 f"(atol, rtol), two numbers at least 0; got {dtype!r}: {pair!r}")
            checked[dtype] = (float(pair[0]), float(pair[1]))
        self._inputs[name] = ParityInputs(name, target, checked, source)
        return self._inputs[name]

    def parity_inputs(self, name: str) -> ParityInputs | None:
        load_plugins()
        return self._inputs.get(name)

    def unregister(self, *key: str) -> None:
        self._cells.pop(tuple(key), None)
        self._resolved.clear()

    def cells(self) -> list[Cell]:
        load_plugins()
        return list(self._cells.values())

    def implementation(self, name: str) -> Cell | None:
        """A cell registered under `name` on any device (they share kind and schema), or None."""
        return next((c for c in self.cells() if c.key[0] == name), None)

    def names(self) -> list[str]:
        return sorted({c.key[0] for c in self.cells()})

    def reasons(self, cell: Cell, platform: Platform) -> list[str]:
        """Why `cell` cannot run on `platform`; empty when it can. Imports nothing heavy."""
        device, arch = cell.key[1], cell.key[2] if "arch" in self.fields else None
        reasons = []
        if arch is None:
            if device not in platform.component_chain():
                reasons.append(f"{device} is not on the chain of {platform.device}/{platform.arch}")
        elif (device, arch) not in platform.kernel_chain():
            reasons.append(f"{device}/{arch} is not on the chain of {platform.device}/{platform.arch}")
        if platform.simulated and device == "cuda":
            reasons.append(f"the platform {platform.device}/{platform.arch} is simulated: no device to run on")
        reasons += [f"needs {m}, which is not installed" for m in cell.requires if not _importable(m)]
        if cell.check and not reasons:
            module, _, function = cell.check.partition(":")
            reasons += getattr(importlib.import_module(module), function)(platform)
        return reasons

    def candidates(self, name: str, platform: Platform, variant: str) -> list[tuple[str, ...]]:
        """Keys to try, in order: along the chain with `variant`, then with the default variant."""
        variants = [variant] + (["default"] if variant != "default" else [])
        if "arch" in self.fields:
            return [(name, d, a, v) for v in variants for d, a in platform.kernel_chain()]
        return [(name, d, v) for v in variants for d in platform.component_chain()]

    def resolve(self, name: str, platform: Platform, variant: str = "default") -> tuple[Cell, Callable]:
        """The first cell on the platform's chain that can run, and its implementation; cached per platform."""
        memo = (name, platform, variant)
        if memo in self._resolved:
            return self._resolved[memo]
        load_plugins()
        for key in self.candidates(name, platform, variant):
            cell = self._cells.get(key)
            if cell is not None and not self.reasons(cell, platform):
                self._resolved[memo] = (cell, cell.load())
                return self._resolved[memo]
        cells = [c for c in self._cells.values() if c.key[0] == name]
        if not cells:
            known = ", ".join(sorted({k[0] for k in self._cells}))
            raise NoCellAvailable(f"no {self.title} cell named '{name}'; registered: {known}")
        lines = [f"  {c.name}: {'; '.join(self.reasons(c, platform)) or f'variant {c.key[-1]} was not asked for'}"
                 for c in cells]
        devices = sorted({c.key[1] for c in cells})
        if platform.device not in devices:  # no arch or variant of this device would do: say which device would
            lines.append(f"  it runs on {' or '.join(devices)}: use --device {devices[0]}")
        raise NoCellAvailable(f"nothing can run {self.title} '{name}' (variant {variant}) on "
                              f"{platform.device}/{platform.arch}:\n" + "\n".join(lines))


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


COMPONENTS = Registry("component", ("kind", "device", "variant"))
KERNELS = Registry("kernel", ("op", "device", "arch", "variant"))

_plugins_loaded = False
_plugin_errors: list[str] = []


def load_plugins() -> None:
    """Call every `cardtool.backends` entry point once; a broken plugin is reported, never fatal."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    from cardtool.backends import builtin

    builtin.register(COMPONENTS, KERNELS)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry.load()(_Scoped(COMPONENTS, entry), _Scoped(KERNELS, entry))
        except Exception as error:  # noqa: BLE001 - a plugin's failure must not take the tool down
            _plugin_errors.append(f"{entry.value} ({entry.name}): {type(error).__name__}: {error}")


def plugin_errors() -> list[str]:
    load_plugins()
    return list(_plugin_errors)


class _Scoped:
    """A registry as a plugin sees it: every cell it registers records the plugin as its source."""

    def __init__(self, registry: Registry, entry: importlib.metadata.EntryPoint):
        self._registry, self._source = registry, entry.dist.name if entry.dist else entry.value

    def register(self, *key: str, **kwargs) -> Cell:
        return self._registry.register(*key, **{**kwargs, "source": self._source})

    def register_inputs(self, name: str, **kwargs) -> ParityInputs:
        return self._registry.register_inputs(name, **{**kwargs, "source": self._source})
