"""Deep validation of a card's adapters against the component they target — LoRAs: PEFT/diffusers naming
(`<module>.lora_A.weight` (r, in), `<module>.lora_B.weight` (out, r)), the manifest's rank, and modules that
exist in the target with those in/out sizes; ControlNets: the blocks they copy and the tensors that implies. Reads
headers only."""

from __future__ import annotations

import math
import re

from cardtool.backends.lora_targets import DEFAULT_TARGETS, matching, module_key, rank_and_alpha, uses_prefix
from cardtool.backends.wan_config import CONTROLNET_BLOCKS
from cardtool.core.cards.components import tensor_problems
from cardtool.core.cards.weight_files import FLOAT_DTYPES, read_header, read_metadata
from cardtool.core.sampling.control_names import PREPROCESSORS
from cardtool.errors import Problem

__all__ = ["adapter_problems", "block_count", "lora_reasons"]

_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")


def adapter_problems(card, facts: dict[str, dict]) -> list[Problem]:
    problems = []
    for name, adapter in card.manifest.adapters.items():
        component = card.manifest.components.get(adapter.target)
        if component is not None and component.kind != "dit":
            problems.append(card.problem(("adapters", name, "target"), f"adapter '{name}' targets '{adapter.target}', "
                                         f"a {component.kind}; adapters apply to a DiT", "target the card's DiT"))
            continue
        if adapter.kind == "controlnet" and adapter.control not in PREPROCESSORS:
            problems.append(card.problem(("adapters", name, "control"), f"unknown control preprocessor "
                                         f"'{adapter.control}'", f"use one of: {', '.join(PREPROCESSORS)}"))
        target = facts.get(adapter.target, {}).get("tensors")
        if target is None:  # an unsound target is reported as a component problem
            continue
        if adapter.kind == "controlnet":
            problems += _controlnet_problems(card, name, adapter, target)
            continue
        path = card.folder / adapter.weights
        header, unreadable = read_header(path)
        metadata = {} if unreadable else read_metadata(path)
        reasons = lora_reasons(header, metadata, adapter, target)
        fix = "use a LoRA made for this component, with the manifest's rank"
        problems += [card.problem(("adapters", name, "weights"), reason, fix) for reason in reasons[:3]]
    return problems


def _controlnet_problems(card, name: str, adapter, target: dict[str, tuple[int, ...]]) -> list[Problem]:
    """A ControlNet's config (`blocks`: how many of the target's blocks it copies) and its weights against the
    tensors that implies: the copied blocks' tensors as the target has them, the control latent's patch embedding
    shaped as the target's, and one dim × dim output per block (`backends/controlnet.py`)."""
    at = ("adapters", name)
    unknown = sorted(str(key) for key in adapter.config if key != "blocks")
    if unknown:
        return [card.problem(at + ("config", unknown[0]), f"a ControlNet's config takes only blocks, not "
                             f"{', '.join(unknown)[:200]}", "remove it")]
    depth = block_count(target)
    blocks = adapter.config.get("blocks", CONTROLNET_BLOCKS)
    if not isinstance(blocks, int) or isinstance(blocks, bool) or not 1 <= blocks <= depth:
        return [card.problem(at + ("config", "blocks"), f"blocks must be a whole number in 1…{depth} (the blocks of "
                             f"'{adapter.target}' it copies), got {blocks!r}"[:300], f"set blocks: 1 … {depth}")]
    embedding = target["patch_embedding.weight"]  # (dim, latent channels, *patch)
    dim = embedding[0]
    expected = {"control_embedding.weight": embedding, "control_embedding.bias": (dim,)}
    for i in range(blocks):
        expected |= {key: shape for key, shape in target.items() if key.startswith(f"blocks.{i}.")}
        expected |= {f"controlnet_blocks.{i}.weight": (dim, dim), f"controlnet_blocks.{i}.bias": (dim,)}
    return tensor_problems(card, at, card.folder / adapter.weights, expected)


def block_count(tensors) -> int:
    """How many transformer blocks a DiT's tensor names (`blocks.N.…`) hold."""
    return len({key.split(".")[1] for key in tensors if key.startswith("blocks.")})


def lora_reasons(header: dict, metadata: dict[str, str], adapter, target: dict[str, tuple[int, ...]]) -> list[str]:
    """Why a LoRA file (its header: tensor → (safetensors dtype, shape), and its header metadata) does not fit the
    target's tensors and the manifest's rank, alpha and target patterns; empty when it does."""
    rank, targets = adapter.rank, adapter.targets or DEFAULT_TARGETS
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    reasons = []
    prefixed = uses_prefix(header)
    for tensor, (dtype, shape) in header.items():
        match = _LORA.match(module_key(tensor, prefixed))
        if match is None:
            reasons.append(f"'{tensor[:80]}' is not named <module>.lora_A.weight or <module>.lora_B.weight")
            continue
        if dtype not in FLOAT_DTYPES:
            reasons.append(f"'{tensor[:80]}' is {dtype}; LoRA weights are floating point ({', '.join(FLOAT_DTYPES)})")
        modules.setdefault(match["module"], {})[match["part"]] = shape
    stated = rank_and_alpha(metadata)  # a header that disagrees with the card: one of the two is wrong
    for key, declared in (("rank", rank), ("alpha", adapter.alpha)):
        if key in stated and not _same(stated[key], declared):
            reasons.append(f"its header says {key} {stated[key]}, the card {declared}")
    if not modules and not reasons:
        reasons.append("the file holds no LoRA tensors")
    for module, parts in sorted(modules.items()):
        base = target.get(f"{module}.weight")
        if base is None or len(base) != 2:
            reasons.append(f"'{module[:80]}' is not a linear layer of the target")
        elif set(parts) != {"A", "B"}:
            reasons.append(f"'{module[:80]}' has lora_{next(iter(parts))} without its pair")
        elif not matching([module], targets):
            reasons.append(f"'{module[:80]}' is not among the adapter's targets ({', '.join(targets)[:200]})")
        elif parts["A"] != (rank, base[1]) or parts["B"] != (base[0], rank):
            reasons.append(f"'{module[:80]}': lora_A {list(parts['A'])} and lora_B {list(parts['B'])} are not "
                           f"[{rank}, {base[1]}] and [{base[0]}, {rank}] (rank {rank} on a {list(base)} layer)")
    return reasons


def _same(text: str, value: float) -> bool:
    try:
        return math.isclose(float(text), float(value), rel_tol=1e-6)
    except ValueError:
        return False
