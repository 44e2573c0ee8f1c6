"""The `conv-vae` configuration, shared by the torch module and the numpy reference decode, and the exact
tensors a weights file for it holds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from cardtool.backends.component_config import ComponentConfig, Count, FiniteFloat

__all__ = ["ConvVAEConfig"]

Pixels = Annotated[int, Field(strict=True, ge=1, le=1024)]


class ConvVAEConfig(ComponentConfig):
    """A convolutional VAE for small grey images: 28×28 padded to 32×32 (a power of two, so each stride-2
    level halves it exactly) and encoded to latent_channels × 8×8 with three channel levels."""

    image_channels: Annotated[int, Field(strict=True, ge=1, le=4)] = 1
    image_size: Pixels = 28
    padded_size: Pixels = 32
    latent_channels: Count = 4
    channels: Annotated[tuple[Count, ...], Field(min_length=1, max_length=6)] = (32, 64, 128)
    # latents are scaled by this (≈ 1/std of the training latents) for the DiT, and divided by it for the decoder:
    # bounded both ways, since a denormal one (1e-45) validated and then made every image inf
    scaling_factor: Annotated[FiniteFloat, Field(ge=1e-6, le=1e6)] = 1.0

    @model_validator(mode="after")
    def _sizes_fit(self):
        halvings = len(self.channels) - 1
        if self.padded_size < self.image_size or self.padded_size % 2**halvings:
            raise ValueError(f"padded_size {self.padded_size} must hold image_size {self.image_size} and halve "
                             f"{halvings} times exactly")
        odd = [c for c in self.channels if c % min(8, c)]
        if odd:
            raise ValueError(f"channels {odd} do not split into GroupNorm's min(8, channels) groups; use multiples "
                             "of 8 (or fewer than 8)")
        return self

    @property
    def latent_size(self) -> int:
        return self.padded_size // 2 ** (len(self.channels) - 1)

    def tensors(self) -> dict[str, tuple[int, ...]]:
        ch, out = self.channels, {}
        out |= _conv("encoder.conv_in", self.image_channels, ch[0])
        for i in range(len(ch) - 1):
            out |= _res(f"encoder.down.{i}.res", ch[i]) | _conv(f"encoder.down.{i}.downsample", ch[i], ch[i + 1])
        out |= _res("encoder.mid", ch[-1]) | _norm("encoder.norm_out", ch[-1])
        out |= _conv("encoder.conv_out", ch[-1], 2 * self.latent_channels)
        out |= _conv("decoder.conv_in", self.latent_channels, ch[-1]) | _res("decoder.mid", ch[-1])
        for j, i in enumerate(range(len(ch) - 1, 0, -1)):
            out |= _conv(f"decoder.up.{j}.conv", ch[i], ch[i - 1]) | _res(f"decoder.up.{j}.res", ch[i - 1])
        return out | _norm("decoder.norm_out", ch[0]) | _conv("decoder.conv_out", ch[0], self.image_channels)

    def facts(self, source=None) -> dict:
        return {"latent_channels": self.latent_channels, "latent_size": self.latent_size,
                "image_channels": self.image_channels}


def _conv(name: str, c_in: int, c_out: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (c_out, c_in, 3, 3), f"{name}.bias": (c_out,)}


def _norm(name: str, channels: int) -> dict[str, tuple[int, ...]]:
    return {f"{name}.weight": (channels,), f"{name}.bias": (channels,)}


def _res(name: str, channels: int) -> dict[str, tuple[int, ...]]:
    return (_norm(f"{name}.norm1", channels) | _conv(f"{name}.conv1", channels, channels)
            | _norm(f"{name}.norm2", channels) | _conv(f"{name}.conv2", channels, channels))
