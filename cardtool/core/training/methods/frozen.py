"""The card a post-training method starts from, held frozen: its Wan DiT as the registry built it (eval mode, no
gradients), the run's text cache, its denoise loop's defaults, trainable copies of its weights, and its velocity as
its card serves it — classifier-free guidance at the card's scale on the samples whose t lies in its guidance
interval (DMD2's real score; reward fine-tuning's CFG reference)."""

from __future__ import annotations

import torch

from cardtool.backends.platform import Platform
from cardtool.backends.registry import KERNELS
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import WanDiT
from cardtool.core.cards.loader import Card
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.sampling.denoise import DenoiseLoop
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import TextFeatureCache, encode_prompts
from cardtool.core.training.lora_settings import LoraSettings
from cardtool.errors import BadInput

__all__ = ["FrozenCard", "GuidedVelocity", "merge_default_stack"]


class FrozenCard:
    """`card` on `platform` in float32; `role` and `method` name it in errors ("teacher", "DMD2")."""

    def __init__(self, card: Card, platform: Platform, role: str, method: str):
        if "denoise" not in card.manifest.loops:
            raise BadInput(f"{role} '{card.id}' has no denoise loop: {method} trains a card's denoise sampling")
        self.card, self.platform, self.device = card, platform, platform.torch_device
        self.instance = ModelInstance(card, platform, "float32")
        # on disk as generate and eval keep it: a run again on the same prompts (a resume, the next flywheel turn, a
        # CI job) reads them back and never builds the text encoder, most of a short run's start-up
        self.cache = TextFeatureCache()
        self.loop = DenoiseLoop(self.instance, cache=self.cache)
        self.name = self.loop.transformer
        spec = card.manifest.components[self.name]
        if spec.impl != "wan-dit":
            raise BadInput(f"{role} '{card.id}': {method} trains wan-dit transformers, not '{spec.impl}'")
        self.module = self.instance.component(self.name)
        self.config = WanDiTConfig.from_card(spec.config)
        self.defaults = FlowDenoiseDefaults.model_validate(card.manifest.loops["denoise"].defaults)
        merge_default_stack(self.instance, self.module, self.defaults.adapters)

    def copy(self, lora: LoraSettings | None = None) -> torch.nn.Module:
        """A trainable module holding the card's transformer weights; with `lora`, the frozen weights and a new
        LoRA (rank, alpha, targets) that alone trains."""
        module = WanDiT(self.config, self.platform).to(self.device)
        module.load_state_dict(self.module.state_dict())
        if lora is None:
            return module
        from cardtool.backends.lora import LoraWrapped, TrainableLora

        try:
            return LoraWrapped(module, TrainableLora(module, lora.targets, lora.rank, lora.alpha))
        except ValueError as e:  # targets that name no layer of this transformer
            raise BadInput(f"model.lora.targets: {e}") from None

    def serving(self, module: torch.nn.Module) -> DenoiseLoop:
        """The card's denoise loop with its transformer served from `module` (live training weights)."""
        instance = ModelInstance(self.card, self.platform, "float32")
        instance.use(self.name, module)
        return DenoiseLoop(instance, cache=self.cache)

    def guided(self, guidance: float | None = None, interval: tuple[float, float] | None = None) -> GuidedVelocity:
        """The frozen velocity with CFG; the card's loop defaults for what is None."""
        [empty] = encode_prompts(self.instance, [""], self.cache, self.loop.text_encoder)  # the null condition
        return GuidedVelocity(self.module, KERNELS.resolve("cfg_combine", self.platform)[1], empty,
                              self.defaults.guidance if guidance is None else guidance,
                              self.defaults.guidance_interval if interval is None else interval, self.device)


def merge_default_stack(instance: ModelInstance, module: torch.nn.Module, adapters: dict[str, float]) -> None:
    """Merge into `module` (a copy of the card's transformer) the adapter stack its loop applies by default: a LoRA
    card is its base with its LoRA, as its loop serves it."""
    if adapters:
        from cardtool.backends.lora import merge

        stack = instance.adapters.resolve(tuple(adapters.items()))
        merge(module, [(use.adapter.value, use.scale) for use in stack])


class GuidedVelocity:
    """v_u + w·(v_c − v_u) where t ∈ [lo, hi] and w ≠ 1, else v_c; `empty` is the null condition's (states, mask)."""

    def __init__(self, model, cfg, empty, guidance: float, interval: tuple[float, float], device):
        self.model, self.cfg, self.guidance, self.interval = model, cfg, guidance, interval
        self.empty = tuple(torch.as_tensor(a, device=device) for a in empty)

    def __call__(self, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        v = self.model(x_t, t * 1000, text, mask)
        low, high = self.interval
        guided = ((t >= low - 1e-9) & (t <= high + 1e-9)).nonzero().flatten() if self.guidance != 1 else []
        if len(guided):
            empty, empty_mask = (a[None].expand(len(guided), *a.shape) for a in self.empty)
            v_uncond = self.model(x_t[guided], t[guided] * 1000, empty.to(text.dtype), empty_mask)
            v = v.clone()
            v[guided] = self.cfg(v_uncond, v[guided], self.guidance).to(v.dtype)
        return v
