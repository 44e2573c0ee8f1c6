"""The `wan-dit` configuration, shared by the torch module and the numpy reference forward."""

from __future__ import annotations

from dataclasses import dataclass

from cardtool.backends.config_dataclass import config_from_card, config_to_card
from cardtool.errors import BadInput

__all__ = ["WanDiTConfig"]


@dataclass(frozen=True)
class WanDiTConfig:
    """Sizes of a Wan2.1-architecture DiT (arXiv 2503.20314). Latents are (B, C, F, H, W)."""

    dim: int = 256
    depth: int = 6
    heads: int = 4
    ffn_dim: int = 1024
    in_channels: int = 4
    out_channels: int = 4
    text_dim: int = 384
    freq_dim: int = 256
    patch: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6
    cross_attn_norm: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @classmethod
    def from_card(cls, config: dict) -> WanDiTConfig:
        """Read a card's `config` mapping; unknown keys and impossible sizes are errors, not silently dropped."""
        made = config_from_card(cls, "wan-dit", config)
        if made.dim % made.heads or made.head_dim % 2:
            raise BadInput(f"wan-dit config: dim {made.dim} must split into {made.heads} heads of an even size")
        if len(made.patch) != 3:
            raise BadInput(f"wan-dit config: patch must be (frames, height, width), got {made.patch}")
        return made

    def to_card(self) -> dict:
        return config_to_card(self)

    def to_diffusers(self) -> dict:
        """The same model as a diffusers `WanTransformer3DModel` config (its state-dict keys match ours)."""
        return {"patch_size": list(self.patch), "num_attention_heads": self.heads, "attention_head_dim": self.head_dim,
                "in_channels": self.in_channels, "out_channels": self.out_channels, "text_dim": self.text_dim,
                "freq_dim": self.freq_dim, "ffn_dim": self.ffn_dim, "num_layers": self.depth,
                "cross_attn_norm": self.cross_attn_norm, "qk_norm": "rms_norm_across_heads", "eps": self.eps}
