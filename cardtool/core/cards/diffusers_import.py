"""`cardtool cards import SOURCE --base CARD --id ID`: a transformer in diffusers' layout — a `WanTransformer3DModel`
folder (`config.json` and `diffusion_pytorch_model.safetensors`, or its shards with their `.index.json`), or a model
folder holding one under `transformer/` (a pipeline, or a `cards export`) — as a card. The card extends BASE, whose
text encoder, VAE and loop it uses, and replaces the transformer; BASE's adapters, made for BASE's transformer, are
not carried over. Weights are read with safetensors only; a pickle checkpoint is refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cardtool.core.cards.components import few
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import check_new_id
from cardtool.core.cards.loader import Card, load_card
from cardtool.errors import BadInput
from cardtool.files import is_regular_file, parse_json, read_small_file
from cardtool.paths import opened_by_utf8_name
from cardtool.shell_words import shell_join

__all__ = ["import_diffusers"]

DIFFUSERS_CLASS = "WanTransformer3DModel"
WEIGHTS = "diffusion_pytorch_model.safetensors"
STORAGE = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}


def import_diffusers(source: Path, base_ref: str, card_id: str, out: Path | None = None, *, variant: str | None = None,
                     overwrite: bool = False, command: str | None = None) -> Card:
    """Write the card for the diffusers transformer at `source` on `base_ref`'s other components; `variant` picks
    diffusers' `diffusion_pytorch_model.VARIANT.safetensors` files."""
    from cardtool.backends.wan_config import from_diffusers
    from cardtool.core.cards.writer import card_folder, write_card
    from cardtool.core.training.derived import extends_reference

    out = card_folder(card_id, out)
    base = load_card(locate(base_ref))
    check_new_id(card_id, [base], "give the imported card another --id")
    dits = [n for n, c in base.manifest.components.items() if c.kind == "dit"]
    if dits != ["transformer"] or "denoise" not in base.manifest.loops:
        raise BadInput(f"base '{base.id}' has no denoise loop over a `transformer` DiT for the import to replace")
    if variant is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", variant):
        raise BadInput(f"--variant {variant!r}: a variant is a short name such as fp16")
    weights = f"diffusion_pytorch_model.{variant}.safetensors" if variant else WEIGHTS
    folder = _transformer_folder(Path(source), weights)
    text, reason = read_small_file(folder / "config.json")
    if reason:
        raise BadInput(f"cannot read the transformer's config: {reason}")
    try:
        config = parse_json(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{folder / 'config.json'} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise BadInput(f"{folder / 'config.json'} is not a JSON object")
    if config.get("_class_name", DIFFUSERS_CLASS) != DIFFUSERS_CLASS:
        raise BadInput(f"{folder} holds a {config['_class_name']}; cardtool imports a {DIFFUSERS_CLASS} (Wan2.1's DiT)")
    dit = from_diffusers(config)
    state = _weights(folder, weights)
    expected = dit.tensors()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = [f"{what} {few(names)}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names]
        raise BadInput(f"the weights do not fit config.json: {'; '.join(parts)}")
    wrong = [k for k, shape in expected.items() if tuple(state[k].shape) != shape]
    if wrong:
        k = wrong[0]
        more = f" ({len(wrong)} tensors differ)" if len(wrong) > 1 else ""
        raise BadInput(f"the weights do not fit config.json: {k} is {tuple(state[k].shape)}, not {expected[k]}{more}")
    dtypes = {str(v.dtype) for v in state.values()}
    if not dtypes <= set(STORAGE):
        raise BadInput(f"the weights are {', '.join(sorted(dtypes))}; a card stores float32, float16 or bfloat16")
    broken = [k for k, v in state.items() if not bool(v.isfinite().all())]
    if broken:  # the source's fault, said of the source: not of the card it would have become
        raise BadInput(f"{folder} holds NaN or inf in {few(broken)}; a card's weights must be finite")
    # one precision for the file, losing nothing: diffusers keeps norms and modulation float32 in a bf16 model
    storage = STORAGE[dtypes.pop()] if len(dtypes) == 1 else "float32"

    loop_defaults = base.manifest.loops["denoise"].defaults
    manifest = {
        "schema": "cardtool/v1", "id": card_id,
        "description": f"{DIFFUSERS_CLASS} imported from {folder.name}, on {base.id}'s text encoder and VAE",
        "extends": extends_reference(base, out),
        "components": {"transformer": {"kind": "dit", "impl": "wan-dit", "config": dit.to_card(),
                                       "weights": "transformer.safetensors"}},
        # the base's adapters fit the base's transformer, not this one
        **({"adapters": {name: None for name in base.manifest.adapters}} if base.manifest.adapters else {}),
        **({"loops": {"denoise": {"defaults": {"adapters": None}}}} if loop_defaults.get("adapters") else {}),
        "recipe": {"method": "import", "parents": [base.id], "assumes": {"loop": "denoise"},
                   "command": command or shell_join(["cardtool", "cards", "import", str(source), "--base", base_ref,
                                                     "--id", card_id, *(["--variant", variant] if variant else [])])},
        "parity": {"consistency": "C1"}}
    return write_card(out, manifest, {"transformer.safetensors": state}, storage=storage, overwrite=overwrite)


def _transformer_folder(source: Path, weights: str) -> Path:
    if not source.is_dir():
        from cardtool.core.cards.discovery import hub_download

        hub = hub_download(str(source))
        kind = "not a folder" if source.exists() else "no such folder"
        raise BadInput(f"{source}: {kind}; give the folder of a diffusers WanTransformer3DModel (or of a pipeline with "
                       "a transformer/ folder)" + (f"; cardtool never downloads: {hub} first, then give DIR" if hub
                                                  else ""))
    for folder in (source, source / "transformer"):
        if is_regular_file(folder / "config.json") and (
                is_regular_file(folder / weights) or is_regular_file(folder / f"{weights}.index.json")):
            return folder
    names = [p.name for folder in (source, source / "transformer") if folder.is_dir() for p in folder.iterdir()]
    pickled = [n for n in names if n.endswith(".bin")]
    if pickled:
        raise BadInput(f"{source} holds {', '.join(pickled)}: pickle checkpoints are never loaded; save the model with "
                       "safetensors (save_pretrained(..., safe_serialization=True))")
    variants = sorted({m[1] for n in names if (m := re.fullmatch(r"diffusion_pytorch_model\.([^.]+)\.safetensors"
                                                                  r"(?:\.index\.json)?", n))})
    raise BadInput(f"{source} is not a diffusers transformer folder: no config.json with {weights} (or its "
                   "shards' .index.json) in it or in its transformer/ folder"
                   + (f"; it holds the variant(s) {', '.join(variants)}: pass --variant" if variants else ""))


def _weights(folder: Path, weights: str) -> dict:
    """The state dict, from one file or from the shards an index names (each inside the folder)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / f"{weights}.index.json"
    if is_regular_file(folder / weights):
        files = [folder / weights]
    else:
        text, reason = read_small_file(index, limit=16 << 20)
        try:
            weight_map = parse_json(text)["weight_map"] if not reason else None
        except (json.JSONDecodeError, KeyError, TypeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise BadInput(f"{index}: {reason or 'not a safetensors index (no weight_map of file names)'}")
        files = []
        for name in sorted(set(weight_map.values())):
            shard = None if "\x00" in name else (folder / name).resolve()  # a path can hold no NUL
            if shard is None or shard.parent != folder.resolve() or not is_regular_file(shard):
                raise BadInput(f"{index} names {name!r}, which is not a file in {folder}")
            files.append(shard)
    state = {}
    for file in files:
        try:
            with opened_by_utf8_name(file) as name:
                tensors = load_file(name)
        except (SafetensorError, OSError) as e:
            raise BadInput(f"{file} is not a readable safetensors file: {str(e).splitlines()[0][:160]}") from None
        twice = sorted(tensors.keys() & state.keys())
        if twice:
            raise BadInput(f"{few(twice)} in two shards")
        state.update(tensors)
    return state

