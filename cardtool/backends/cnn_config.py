"""The `fashion-cnn` configuration (the judge's classifier) and the exact tensors its weights file holds."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from cardtool.backends.component_config import ComponentConfig, Count, FiniteFloat, Size

__all__ = ["FashionCNNConfig"]


class FashionCNNConfig(ComponentConfig):
    classes: Count = 10
    width: Annotated[int, Field(strict=True, ge=8, le=512)] = 32
    features: Size = 256
    dropout: Annotated[FiniteFloat, Field(ge=0, lt=1)] = 0.3

    @model_validator(mode="after")
    def _groups(self):
        if self.width % 8:
            raise ValueError(f"width {self.width} must be a multiple of 8 (GroupNorm with 8 groups)")
        return self

    def tensors(self) -> dict[str, tuple[int, ...]]:
        w, out = self.width, {}
        for conv, norm, c_in, c_out in ((0, 1, 1, w), (3, 4, w, w), (7, 8, w, 2 * w), (10, 11, 2 * w, 2 * w)):
            out |= {f"conv.{conv}.weight": (c_out, c_in, 3, 3), f"conv.{conv}.bias": (c_out,),
                    f"conv.{norm}.weight": (c_out,), f"conv.{norm}.bias": (c_out,)}
        return out | {"features.2.weight": (self.features, 2 * w * 49), "features.2.bias": (self.features,),
                      "head.1.weight": (self.classes, self.features), "head.1.bias": (self.classes,)}
