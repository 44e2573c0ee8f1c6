"""Write the example card family's weights: tiny, randomly initialised (seeded) Wan-DiT, conv-VAE, LoRA and
classifier tensors in the real architectures, so every command runs on them in seconds; then put each file's sha256
into the manifests. They are not trained: they exist to exercise cards, loading and parity.

    python examples/cards/make_tiny_weights.py [FOLDER]   (default: the folder this script is in)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from cardtool.atomic import atomic_path, write_atomic
from cardtool.backends.conv_vae import ConvVAE
from cardtool.backends.platform import Platform
from cardtool.backends.training import FashionCNN
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import WanDiT
from cardtool.core.cards.weight_files import sha256_file

DIT = WanDiTConfig(dim=32, depth=2, heads=2, ffn_dim=64, in_channels=4, out_channels=4, text_dim=384, freq_dim=64)
VAE = ConvVAEConfig(channels=(8, 16, 32), latent_channels=4)


def dit_weights(seed: int) -> dict:
    torch.manual_seed(seed)
    model = WanDiT(DIT, Platform("cpu", "generic"))
    torch.nn.init.normal_(model.proj_out.weight, std=0.02)  # a zero head would make every parity check trivial
    return model.state_dict()


def write(folder: Path, rel: str, tensors: dict, metadata: dict | None = None) -> None:
    path = folder / rel
    with atomic_path(path) as temporary:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(temporary), metadata=metadata)
    manifest = next(p for p in (folder / "card.yaml", folder / "card.toml") if p.exists())
    text = manifest.read_text()
    # the sha256 line right after this file's weights line
    pattern = re.compile(rf"(weights\s*[:=]\s*\"?{re.escape(rel)}\"?\s*\n\s*sha256\s*[:=]\s*\"?)([0-9a-f]{{64}})")
    if not pattern.search(text):
        raise SystemExit(f"{manifest}: no sha256 line after weights {rel}")
    write_atomic(manifest, pattern.sub(lambda m: m.group(1) + sha256_file(path), text).encode())


def main(root: Path) -> None:
    torch.manual_seed(0)
    write(root / "tiny-base", "vae.safetensors", ConvVAE(VAE).state_dict())
    write(root / "tiny-base", "transformer.safetensors", dit_weights(1))
    generator = torch.Generator().manual_seed(2)
    lora = {"blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, 32, generator=generator) / 32**0.5,
            "blocks.0.attn1.to_q.lora_B.weight": torch.randn(32, 4, generator=generator) / 2}
    # rank and alpha as diffusers stores them: one JSON metadata entry (one key keeps the header deterministic)
    config = {"r": 4, "lora_alpha": 4, "target_modules": ["blocks.0.attn1.to_q"]}
    write(root / "tiny-base", "adapters/invert.safetensors", lora,
          {"lora_adapter_metadata": json.dumps(config, sort_keys=True)})
    write(root / "tiny-rl", "transformer.safetensors", dit_weights(3))
    write(root / "tiny-distilled", "transformer.safetensors", dit_weights(4))
    torch.manual_seed(5)
    write(root / "tiny-judge", "classifier.safetensors", FashionCNN(width=8, features=16).state_dict())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
