"""`cardtool cards extract-lora BASE TUNED --rank R --id ID`: TUNED's change to BASE's transformer as a LoRA on BASE.

For every linear layer the change ΔW = W_tuned − W_base is factored by its truncated SVD, ΔW ≈ U_r·S_r·V_rᵀ, the
best rank-r approximation in Frobenius norm (Eckart–Young); B = U_r·√S_r and A = √S_r·V_rᵀ, α = r. Biases, norms,
the patch embedding and the modulation tables are not linear weights, and a LoRA carries none of their change: the
report says what share of the whole change the linear weights hold, and what share of theirs the rank keeps. The
adapter card extends BASE with TUNED's loop defaults and the adapter in its default stack (under BASE's own), so
sampling it approximates TUNED — an RL'd or distilled card served per request on its base (LCM-LoRA's idea for a
DMD2 student, arXiv 2311.05556), composable with other adapters and scalable. Each card counts as it serves, its
default LoRA stack merged, so a LoRA card can be resized and a stack flattened into one LoRA."""

from __future__ import annotations

import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import check_new_folder, check_new_id
from cardtool.core.cards.loader import Card, load_card
from cardtool.core.cards.merge import check_architecture, check_related
from cardtool.core.cards.schema import checked_name
from cardtool.core.cards.weight_files import FLOAT_DTYPES, read_header, sha256_file
from cardtool.core.cards.writer import card_folder, card_folder_usable, write_card
from cardtool.core.training.derived import extends_reference
from cardtool.errors import BadInput
from cardtool.paths import opened_by_utf8_name
from cardtool.shell_words import shell_join

__all__ = ["Extraction", "extract_lora"]


@dataclass(frozen=True)
class Extraction:
    card: Card
    adapter: str
    rank: int
    modules: int  # linear layers whose change the LoRA carries
    linear_share: float  # of the whole change ‖Δθ‖², the share in linear weights (what a LoRA can carry)
    kept: float  # of the linear weights' change ‖ΔW‖², the share the rank keeps


def extract_lora(base_ref: str, tuned_ref: str, rank: int, card_id: str, *, adapter: str | None = None,
                 target: str = "transformer", out: Path | None = None, overwrite: bool = False,
                 command: str | None = None) -> Extraction:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise BadInput(f"--rank must be a whole number, at least 1, got {rank!r}")
    base, tuned = load_card(locate(base_ref)), load_card(locate(tuned_ref))
    if base.file.resolve() == tuned.file.resolve():
        raise BadInput(f"BASE and TUNED are both '{base.id}'; TUNED is a card made from BASE")
    check_related([base, tuned])
    check_new_id(card_id, [base, tuned], "give the adapter card another --id")
    component = base.manifest.components.get(target)
    if component is None or component.kind != "dit" or component.weights is None:
        raise BadInput(f"'{base.id}' has no DiT component '{target}' with weights to adapt")
    check_architecture([base, tuned], target)
    others = [name for name, c in base.manifest.components.items() if name != target and c.weights is not None
              and sha256_file(base.weights_file(name)) != sha256_file(tuned.weights_file(name))]
    if others:
        raise BadInput(f"'{tuned.id}' also changes {', '.join(others)} of '{base.id}'; a LoRA on '{target}' carries "
                       "the transformer's change only")
    adapter = tuned.id if adapter is None else adapter  # an empty --adapter is refused, not taken as the default
    try:
        checked_name(adapter)  # it names the weights file: 'adapters/../../x' would write outside the card
    except ValueError:
        raise BadInput(f"--adapter {adapter!r}"[:200] + ": an adapter name starts with a letter or digit and uses only "
                       "letters, digits, '.', '_' and '-' (at most 128)") from None
    if adapter in base.manifest.adapters:
        raise BadInput(f"'{base.id}' already has an adapter '{adapter}'; name this one with --adapter")
    out = card_folder(card_id, out)
    check_new_folder(out, [base, tuned])
    card_folder_usable(out, card_id, overwrite)  # before the work, not after it
    extends = extends_reference(base, out)
    shapes = {n.removesuffix(".weight"): shape for n, (_, shape) in read_header(base.weights_file(target))[0].items()
              if n.endswith(".weight") and len(shape) == 2}
    full = max((min(shape) for shape in shapes.values()), default=0)
    if rank > full:
        raise BadInput(f"--rank {rank} is above the full rank of every linear layer of '{target}' (at most {full}): "
                       f"a higher rank adds only zeros; give at most {full}")
    (base_stack, base_deltas), (_, tuned_deltas) = (_served(card, target) for card in (base, tuned))
    a, b, linear_share, kept = _factor(base.weights_file(target), tuned.weights_file(target), rank, base.id, tuned.id,
                                       base_deltas, tuned_deltas)
    rel = f"adapters/{adapter}.safetensors"
    from cardtool.backends.lora import lora_file

    tensors, metadata = lora_file(a, b, rank, float(rank))
    loops = {}
    for name, loop in tuned.manifest.loops.items():
        if name in base.manifest.loops and target in loop.uses:  # the tuned card's settings, with the adapter on
            loops[name] = {"defaults": {**loop.defaults, "adapters": {**base_stack, adapter: 1.0}}}
    manifest = {"schema": "cardtool/v1", "id": card_id,
                "description": f"Rank-{rank} LoRA on {base.id} extracted from {tuned.id}: {base.id} with it "
                               f"approximates {tuned.id}",
                "extends": extends, "loops": loops,
                "adapters": {adapter: {"kind": "lora", "target": target, "weights": rel, "rank": rank,
                                       "alpha": float(rank), "targets": _patterns(sorted(a), list(shapes))}},
                "recipe": {"method": "lora_extract", "parents": [base.id, tuned.id],
                           "assumes": tuned.manifest.recipe.assumes.model_dump(mode="json", exclude_none=True),
                           "hyperparameters": {"rank": rank},
                           "metrics": {"modules": len(a), "linear_share": round(linear_share, 6),
                                       "kept": round(kept, 6)},
                           "command": command or shell_join(["cardtool", "cards", "extract-lora", base_ref, tuned_ref,
                                                             "--rank", str(rank), "--id", card_id])}}
    card = write_card(out, manifest, {rel: tensors}, overwrite=overwrite, metadata={rel: metadata})
    return Extraction(card, adapter, rank, len(a), linear_share, kept)


def _served(card: Card, target: str) -> tuple[dict[str, float], dict]:
    """The LoRA stack `card`'s denoise loop applies by default (name → scale) and what it adds to the target's
    weights (module → Σ scale·(α/r)·B·A, float64): a card compares as it serves, a LoRA card as its base with its
    LoRA merged (as a post-training method takes it)."""
    import torch

    from cardtool.backends.lora import LoraWeights, lora_parts, read_lora

    loop = card.manifest.loops.get("denoise")
    stack = dict((loop.defaults.get("adapters") or {}) if loop is not None else {})
    deltas = {}
    for name, scale in stack.items():
        spec = card.manifest.adapters[name]
        if spec.kind != "lora" or spec.target != target:
            raise BadInput(f"'{card.id}' serves with adapter '{name}' by default, a {spec.kind} on '{spec.target}': "
                           f"no change to the weights of '{target}' a LoRA can carry")
        lora = LoraWeights(name, spec.rank, spec.alpha, *lora_parts(read_lora(card.weights_file(name, "adapters"))[0],
                                                                     dtype=torch.float64))
        for module in lora.a:
            delta = lora.delta(module, scale)
            deltas[module] = deltas[module] + delta if module in deltas else delta
    return stack, deltas


def _factor(base_path: Path, tuned_path: Path, rank: int, base_id: str, tuned_id: str, base_deltas: dict,
            tuned_deltas: dict):
    """A (r, in) and B (out, r) per changed linear layer, and the shares of the change (see Extraction); each side's
    weights with what its default LoRA stack adds (`_served`)."""
    import torch
    from safetensors import safe_open

    header = read_header(base_path)[0]
    a, b = {}, {}
    whole = linear = kept = 0.0
    with ExitStack() as files:
        old, new = (files.enter_context(safe_open(files.enter_context(opened_by_utf8_name(p)), framework="pt"))
                    for p in (base_path, tuned_path))
        for tensor, (dtype, shape) in sorted(header.items()):
            if dtype not in FLOAT_DTYPES:
                continue
            delta = new.get_tensor(tensor).to(torch.float64) - old.get_tensor(tensor).to(torch.float64)
            module = tensor.removesuffix(".weight")
            for deltas, sign in ((tuned_deltas, 1), (base_deltas, -1)):
                if module in deltas and tensor.endswith(".weight"):
                    delta = delta + sign * deltas[module]
            energy = float(delta.square().sum())
            if not math.isfinite(energy):
                raise BadInput(f"'{tensor}' differs by inf or NaN between '{base_id}' and '{tuned_id}'")
            whole += energy
            if not (tensor.endswith(".weight") and len(shape) == 2) or energy == 0:
                continue
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            k = min(rank, s.numel())
            root = s[:k].sqrt()
            b[module] = torch.zeros(shape[0], rank, dtype=torch.float64)
            a[module] = torch.zeros(rank, shape[1], dtype=torch.float64)
            b[module][:, :k], a[module][:k] = u[:, :k] * root, root[:, None] * vh[:k]  # rank padded with zeros
            linear += energy
            kept += float(s[:k].square().sum())
    if not a:
        raise BadInput(f"'{tuned_id}' does not change the linear weights of '{base_id}' (as each serves, its default "
                       "LoRA stack merged): there is nothing to extract")
    return a, b, linear / whole, kept / linear


def _patterns(modules: list[str], linear: list[str]) -> list[str]:
    """The adapter's targets: `blocks.*.X` where X changed in every block, else each module's own name."""
    from cardtool.backends.lora_targets import matching

    chosen = set(modules)
    out = []
    for module in modules:
        pattern = re.sub(r"^blocks\.\d+\.", "blocks.*.", module)
        if not set(matching(linear, [pattern])) <= chosen:
            pattern = module
        if pattern not in out:
            out.append(pattern)
    return out
