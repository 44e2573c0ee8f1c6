"""Deep validation (issue: a card that validates must run): each component against its implementation's
declared schema — the right kind, a config that schema accepts, the weights or source it needs, and a weights
file whose header holds exactly the tensors (names, shapes, a floating dtype) that config implies — and each
loop against its kind: typed defaults, the component kinds it runs, and sizes that agree across components.
Reads safetensors headers and small JSON files only; imports no torch."""

from __future__ import annotations

import difflib
import importlib

from cardtool.backends.component_config import config_problems
from cardtool.backends.registry import COMPONENTS
from cardtool.core.cards.loops import LOOP_KINDS
from cardtool.core.cards.weight_files import FLOAT_DTYPES, read_header
from cardtool.errors import BadInput, Problem, raise_if_the_machines

__all__ = ["component_problems", "few", "loop_problems", "tensor_problems"]


def component_problems(card) -> tuple[list[Problem], dict[str, dict]]:
    """Problems of every component, and the facts (sizes) of those that are sound, by component name."""
    problems, facts = [], {}
    for name, spec in card.manifest.components.items():
        found, schema_facts = _component(card, name, spec)
        problems += found
        if not found and schema_facts is not None:
            facts[name] = schema_facts
    return problems, facts


def _component(card, name: str, spec) -> tuple[list[Problem], dict | None]:
    at = ("components", name)
    cell = COMPONENTS.implementation(spec.impl)
    impls = {c.key[0]: c.kind for c in COMPONENTS.cells() if c.kind is not None}
    if cell is None or cell.kind is None:
        close = difflib.get_close_matches(spec.impl, list(impls), n=1)
        what = "is not a component implementation" if cell is not None else "is not a registered implementation"
        fix = f"did you mean '{close[0]}'?" if close else f"use one of: {', '.join(sorted(impls))}"
        return [card.problem(at + ("impl",), f"'{spec.impl}' {what}", fix)], None
    if cell.kind != spec.kind:
        same = sorted(i for i, k in impls.items() if k == spec.kind)
        fix = f"use an implementation of kind {spec.kind}: {', '.join(same)}" if same else \
            f"set kind: {cell.kind}, or choose another implementation"
        return [card.problem(at + ("impl",), f"'{spec.impl}' implements kind '{cell.kind}', not '{spec.kind}'",
                             fix)], None
    if cell.schema is None:  # a plugin that declares no schema: its config is its own business
        return [], None
    module, _, attribute = cell.schema.partition(":")
    schema = getattr(importlib.import_module(module), attribute)
    problems = [card.problem(at + ("config", *where), message, fix)
                for where, message, fix in config_problems(schema, spec.config)]
    if problems:
        return problems, None
    config = schema.model_validate(spec.config)
    if schema.needs == "weights" and spec.weights is None:
        return [card.problem(at, f"'{spec.impl}' needs a weights file", "add weights: FILE.safetensors")], None
    if schema.needs == "source" and spec.source is None:
        return [card.problem(at, f"'{spec.impl}' needs a source folder",
                             "add source: package:<module>/<folder> or a folder inside the card")], None
    # the other of the two would validate and never be read: a card that says more than it runs
    if schema.needs == "weights" and spec.source is not None:
        return [card.problem(at + ("source",), f"'{spec.impl}' reads its weights file, never a source folder",
                             "remove source")], None
    if schema.needs == "source" and (spec.weights, spec.sha256) != (None, None):
        field = "weights" if spec.weights is not None else "sha256"
        return [card.problem(at + (field,), f"'{spec.impl}' reads its weights from its source folder, never a "
                             "weights file", "remove weights and sha256")], None
    source = None
    if spec.source is not None:
        try:
            source = card.source_path(name)
        except BadInput as e:  # a package that is not installed: a located problem instead
            return [card.problem(at + ("source",), str(e), "install the package or correct the source")], None
        reasons = config.source_problems(source) + _source_weights_problems(source)
        if reasons:
            fix = f"point source at a complete folder for {spec.impl}"
            return [card.problem(at + ("source",), r, fix) for r in reasons], None
        problems = [card.problem(at + ("config", *where), message, fix)
                    for where, message, fix in config.setting_problems(source)]
        if problems:
            return problems, None
    if spec.weights is not None:
        problems = tensor_problems(card, at, card.folder / spec.weights, config.tensors())
    return problems, (None if problems else {**config.facts(source), "tensors": config.tensors()})


def _source_weights_problems(source) -> list[str]:
    """Every safetensors file in a source folder is loaded (and versioned) later: each header must be sound."""
    try:
        files = sorted(source.glob("*.safetensors")) if source.is_dir() else []
    except OSError as e:
        raise_if_the_machines(e)
        return [f"cannot list {source}: {e.strerror}"]
    return [f"{source}: {reason}" for path in files if (reason := read_header(path)[1])]


def tensor_problems(card, at, path, expected: dict[str, tuple[int, ...]]) -> list[Problem]:
    """A weights file's header against the tensors (name → shape) its config implies: missing, extra, reshaped or
    not floating point, each located at `at`.weights."""
    header, reason = read_header(path)
    if reason:  # the file problems are reported by the loader already
        return [card.problem(at + ("weights",), reason, "write the weights with safetensors")]
    if not expected:
        return []
    where, fix = at + ("weights",), "use weights made for this config, or the config these weights were made with"
    missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
    problems = []
    if missing:
        are = "tensor the config implies is" if len(missing) == 1 else "tensors the config implies are"
        problems.append(card.problem(where, f"{len(missing)} {are} missing: {few(missing)}", fix))
    if extra:
        tensors = "tensor" if len(extra) == 1 else "tensors"
        problems.append(card.problem(where, f"{len(extra)} {tensors} the config does not imply: {few(extra)}", fix))
    shaped = [f"{k} is {list(header[k][1])}, the config implies {list(v)}" for k, v in expected.items()
              if k in header and header[k][1] != v]
    if shaped:
        have = "tensor has another shape" if len(shaped) == 1 else "tensors have other shapes"
        problems.append(card.problem(where, f"{len(shaped)} {have}: {few(shaped)}", fix))
    typed = sorted(k for k in header if header[k][0] not in FLOAT_DTYPES)
    if typed:
        problems.append(card.problem(where, f"tensors that are not floating point ({header[typed[0]][0]}): "
                                     f"{few(typed)}", "store weights as F32, F16, BF16 or F64"))
    return problems


def few(items: list[str], n: int = 3) -> str:
    """The first n items, and how many more."""
    shown = ", ".join(i if len(i) <= 120 else i[:117] + "..." for i in items[:n])
    return shown + (f" (and {len(items) - n} more)" if len(items) > n else "")


def loop_problems(card, facts: dict[str, dict]) -> list[Problem]:
    """Each loop: a known kind, defaults its schema accepts, one component of each kind it runs, and sizes
    that agree between those components (facts of components that failed their own checks are absent)."""
    m, problems = card.manifest, []
    for name, loop in m.loops.items():
        at = ("loops", name)
        kind = LOOP_KINDS.get(loop.kind)
        if kind is None:
            problems.append(card.problem(at + ("kind",), f"unknown loop kind '{loop.kind}'",
                                         f"use one of: {', '.join(LOOP_KINDS)}"))
            continue
        problems += [card.problem(at + ("defaults", *where), message, fix)
                     for where, message, fix in config_problems(kind.defaults, loop.defaults)]
        defaults = loop.defaults.get("adapters")
        for adapter in defaults if isinstance(defaults, dict) else ():
            spec = m.adapters.get(adapter)
            if spec is None or spec.kind != "lora":
                loras = ", ".join(n for n, a in m.adapters.items() if a.kind == "lora") or "none"
                problems.append(card.problem(at + ("defaults", "adapters", str(adapter)),
                                             f"default adapter '{adapter}' is not a LoRA the card declares",
                                             f"name one of the card's LoRAs: {loras}"))
        used = [u for u in loop.uses if u in m.components]
        by_kind = {}
        for need in kind.needs:
            named = [u for u in used if m.components[u].kind == need]
            if len(named) != 1:
                count = "none" if not named else f"{len(named)} ({', '.join(named)})"
                problems.append(card.problem(at + ("uses",), f"a {loop.kind} loop runs one {need} component; it "
                                             f"uses {count}", f"list exactly one {need} component in uses"))
            else:
                by_kind[need] = facts.get(named[0], {})
        if len(by_kind) == len(kind.needs):
            problems += [card.problem(at + ("uses",), message, "use components whose sizes agree")
                         for message in _disagreements(by_kind)]
    return problems


def _disagreements(sizes: dict[str, dict]) -> list[str]:
    """flow_denoise: the DiT reads the encoder's states and the VAE's latents, one frame, a grid its patch tiles."""
    text, vae, dit = sizes.get("text_encoder", {}), sizes.get("vae", {}), sizes.get("dit", {})
    out = []
    if "text_dim" in text and "text_dim" in dit and text["text_dim"] != dit["text_dim"]:
        out.append(f"the DiT's text_dim {dit['text_dim']} is not the text encoder's width {text['text_dim']}")
    if "latent_channels" in vae and "in_channels" in dit:
        for field in ("in_channels", "out_channels"):
            if dit[field] != vae["latent_channels"]:
                out.append(f"the DiT's {field} {dit[field]} is not the VAE's latent_channels {vae['latent_channels']}")
    if vae.get("image_channels", 1) != 1:  # its images are grey throughout: PNGs, control images, judges
        out.append(f"the VAE makes images of {vae['image_channels']} channels; a flow_denoise loop makes grey images "
                   "(image_channels 1)")
    if "patch" in dit:
        frames, rows, cols = dit["patch"]
        if frames != 1:
            out.append(f"the DiT's patch {list(dit['patch'])} spans {frames} frames; images are one frame")
        size = vae.get("latent_size")
        if size is not None and (size % rows or size % cols):
            out.append(f"the DiT's patch {list(dit['patch'])} does not tile the VAE's {size}×{size} latents")
    return out
