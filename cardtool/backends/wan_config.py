"""The `wan-dit` configuration, shared by the torch module and the numpy reference forward, and the exact
tensors (diffusers' `WanTransformer3DModel` key names) a weights file for it holds."""

from __future__ import annotations

import math
from typing import Annotated

from pydantic import Field, model_validator

from cardtool.backends.component_config import ComponentConfig, Count, FiniteFloat, Size
from cardtool.errors import BadInput

__all__ = ["CONTROLNET_BLOCKS", "WanDiTConfig", "from_diffusers"]

CONTROLNET_BLOCKS = 2  # the base's blocks a ControlNet adapter copies where its config names none

PatchSize = Annotated[int, Field(strict=True, ge=1, le=16)]


class WanDiTConfig(ComponentConfig):
    """Sizes of a Wan2.1-architecture DiT (arXiv 2503.20314). Latents are (B, C, F, H, W)."""

    dim: Size = 256
    depth: Count = 6
    heads: Count = 4
    ffn_dim: Size = 1024
    in_channels: Count = 4
    out_channels: Count = 4
    text_dim: Size = 384
    freq_dim: Annotated[int, Field(strict=True, ge=2, le=4096)] = 256
    patch: tuple[PatchSize, PatchSize, PatchSize] = (1, 2, 2)
    eps: Annotated[FiniteFloat, Field(gt=0, lt=1)] = 1e-6
    cross_attn_norm: Annotated[bool, Field(strict=True)] = True
    # Wan2.1 (official code and diffusers) attends to every text token, the padding being zero states; true
    # masks the padding instead — an option for cards trained so, which diffusers cannot run as trained
    text_mask: Annotated[bool, Field(strict=True)] = False

    @model_validator(mode="after")
    def _heads_split_dim(self):
        if self.dim % self.heads or self.head_dim % 2:
            raise ValueError(f"dim {self.dim} must split into {self.heads} heads of an even size (3D RoPE "
                             "rotates channel pairs)")
        return self

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def tensors(self) -> dict[str, tuple[int, ...]]:
        d, f = self.dim, self.ffn_dim
        out = {"patch_embedding.weight": (d, self.in_channels, *self.patch), "patch_embedding.bias": (d,),
               "scale_shift_table": (1, 2, d), "proj_out.weight": (self.out_channels * math.prod(self.patch), d),
               "proj_out.bias": (self.out_channels * math.prod(self.patch),)}
        for name, (d_in, d_out) in {"time_embedder.linear_1": (self.freq_dim, d), "time_embedder.linear_2": (d, d),
                                    "time_proj": (d, 6 * d), "text_embedder.linear_1": (self.text_dim, d),
                                    "text_embedder.linear_2": (d, d)}.items():
            out |= _linear(f"condition_embedder.{name}", d_in, d_out)
        for i in range(self.depth):
            block = f"blocks.{i}"
            for attn in ("attn1", "attn2"):
                for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                    out |= _linear(f"{block}.{attn}.{proj}", d, d)
                out |= {f"{block}.{attn}.norm_q.weight": (d,), f"{block}.{attn}.norm_k.weight": (d,)}
            if self.cross_attn_norm:
                out |= {f"{block}.norm2.weight": (d,), f"{block}.norm2.bias": (d,)}
            out |= _linear(f"{block}.ffn.net.0.proj", d, f) | _linear(f"{block}.ffn.net.2", f, d)
            out[f"{block}.scale_shift_table"] = (1, 6, d)
        return out

    def facts(self, source=None) -> dict:
        return {"in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "patch": self.patch}

    def to_diffusers(self, *, unpadded_text: bool = False) -> dict:
        """The same model as a diffusers `WanTransformer3DModel` config (its state-dict keys match ours). A card with
        text_mask is the same model only for callers that pass each prompt's text states without padding
        (`unpadded_text`): attending to no padding equals masking it."""
        if self.text_mask and not unpadded_text:
            raise BadInput("a wan-dit with text_mask: true masks padded text tokens, which diffusers' "
                           "WanTransformer3DModel does not; its outputs would differ")
        return {"patch_size": list(self.patch), "num_attention_heads": self.heads, "attention_head_dim": self.head_dim,
                "in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.depth,
                "cross_attn_norm": self.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": self.eps}


# diffusers' WanTransformer3DModel arguments that wan-dit has no part for (image-to-video conditioning); each must be
# null in a config.json it imports. rope_max_seq_len only bounds the positions its table holds: ours are computed.
_DIFFUSERS_UNSUPPORTED = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
_DIFFUSERS_KNOWN = {"patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                    "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps",
                    "rope_max_seq_len", *_DIFFUSERS_UNSUPPORTED}


def from_diffusers(config: dict) -> WanDiTConfig:
    """The wan-dit config of a diffusers `WanTransformer3DModel` config.json (the inverse of `to_diffusers`): Wan2.1
    semantics, so `text_mask` is false. Keys starting with `_` are diffusers' bookkeeping; any other key this
    mapping does not know, or an image-to-video part, is BadInput rather than a model silently built without it."""
    unknown = sorted(k for k in config if not k.startswith("_") and k not in _DIFFUSERS_KNOWN)
    if unknown:
        raise BadInput(f"config.json sets {', '.join(unknown)}, which a wan-dit does not know; it cannot be the same "
                       "model")
    present = [k for k in _DIFFUSERS_UNSUPPORTED if config.get(k) is not None]
    if present:
        raise BadInput(f"config.json sets {', '.join(present)}: image-to-video conditioning, which a wan-dit (text to "
                       "image or video) does not have")
    if config.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
        raise BadInput(f"config.json's qk_norm is {config['qk_norm']!r}; a wan-dit normalises q and k with "
                       "rms_norm_across_heads (Wan2.1's)")
    defaults = WanDiTConfig()
    heads = config.get("num_attention_heads", 40)
    head_dim = config.get("attention_head_dim", 128)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (heads, head_dim)):
        raise BadInput(f"config.json: num_attention_heads and attention_head_dim must be whole numbers, got {heads!r}, "
                       f"{head_dim!r}")
    card = {"dim": heads * head_dim, "heads": heads, "depth": config.get("num_layers", 40),
            "ffn_dim": config.get("ffn_dim", 13824), "in_channels": config.get("in_channels", 16),
            "out_channels": config.get("out_channels", 16), "text_dim": config.get("text_dim", 4096),
            "freq_dim": config.get("freq_dim", 256), "patch": config.get("patch_size", [1, 2, 2]),
            "eps": config.get("eps", defaults.eps), "cross_attn_norm": config.get("cross_attn_norm", True),
            "text_mask": False}
    return WanDiTConfig.from_card(card, "wan-dit (from config.json)")


def _linear(name: str, d_in: int, d_out: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (d_out, d_in), f"{name}.bias": (d_out,)}
