"""The `conv-vae` configuration, shared by the torch module and the numpy reference decode."""

from __future__ import annotations

from dataclasses import dataclass

from cardtool.backends.config_dataclass import config_from_card, config_to_card
from cardtool.errors import BadInput

__all__ = ["ConvVAEConfig"]


@dataclass(frozen=True)
class ConvVAEConfig:
    """A convolutional VAE for small grey images: 28×28 padded to 32×32 (a power of two, so each stride-2
    level halves it exactly) and encoded to latent_channels × 8×8 with three channel levels."""

    image_channels: int = 1
    image_size: int = 28
    padded_size: int = 32
    latent_channels: int = 4
    channels: tuple[int, ...] = (32, 64, 128)
    scaling_factor: float = 1.0  # latents are scaled by this (≈ 1/std of the training latents) for the DiT

    @property
    def latent_size(self) -> int:
        return self.padded_size // 2 ** (len(self.channels) - 1)

    @classmethod
    def from_card(cls, config: dict) -> ConvVAEConfig:
        made = config_from_card(cls, "conv-vae", config)
        if made.padded_size < made.image_size or made.padded_size % 2 ** (len(made.channels) - 1):
            raise BadInput(f"conv-vae config: padded_size {made.padded_size} must hold image_size "
                           f"{made.image_size} and halve {len(made.channels) - 1} times exactly")
        return made

    def to_card(self) -> dict:
        return config_to_card(self)
