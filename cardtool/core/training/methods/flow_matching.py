"""`--method pretrain | finetune`: flow-matching training of the Wan DiT on VAE latents (rectified flow as in
SD3 / Wan2.1): x_t = (1 − t)·x0 + t·ε with logit-normal t, velocity target ε − x0, the condition dropped
to the empty prompt 10% of the time so CFG works, EMA weights for sampling. `pretrain` starts a new DiT
beside a trained VAE card; `finetune` continues a text-to-image card's DiT."""

from __future__ import annotations

import numpy as np
import torch
from pydantic import ValidationError

from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import WanDiT
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.loader import load_card, package_path
from cardtool.core.cards.loops import FlowDenoiseDefaults
from cardtool.core.data import Split
from cardtool.core.prompts import TEXT_ENCODER, training_prompts
from cardtool.core.sampling.denoise import DenoiseLoop
from cardtool.core.sampling.instance import ModelInstance
from cardtool.core.sampling.text_cache import filled_warning
from cardtool.core.training.methods.frozen import merge_default_stack
from cardtool.core.training.methods.vae import latents
from cardtool.core.training.recipes import Recipe, field_problems, loss_number, only_keys
from cardtool.core.training.trainer import Task
from cardtool.core.transforms import transform
from cardtool.errors import BadInput

__all__ = ["FlowMatchingTask"]


class FlowMatchingTask(Task):
    LOSS_KEYS: tuple[str, ...] = ("condition_dropout",)  # the recipe's loss: settings
    DATA_KEYS: tuple[str, ...] = ("folder", "transform", "loop")  # and data: settings (loop: the card's defaults)

    def __init__(self, recipe: Recipe, platform: Platform, train: Split, test: Split):
        only_keys(recipe, "loss", self.LOSS_KEYS)
        only_keys(recipe, "data", self.DATA_KEYS)
        self.dropout = loss_number(recipe, "condition_dropout", 0.1, 0.0, 1.0)
        self.loop_defaults = loop_defaults(recipe) if "loop" in self.DATA_KEYS else None
        if len(recipe.parents) != 1:
            raise BadInput(f"{recipe.method} needs exactly one parent card (a VAE card to pretrain beside, or the "
                           "text-to-image card to fine-tune); set parents: [CARD]")
        self.recipe, self.device = recipe, platform.torch_device
        self.parent = load_card(locate(recipe.parents[0]))
        self.check_parent()
        parent = ModelInstance(self.parent, platform, "float32")
        served = self.parent.manifest.loops.get("denoise")  # how the parent samples: what a card continued keeps
        torch.manual_seed(recipe.train.seed)
        if recipe.method == "pretrain":
            self.config = WanDiTConfig.from_card(recipe.model)
            self.dit = WanDiT(self.config, platform).to(self.device)
        else:
            spec = self.parent.manifest.components.get("transformer")
            if spec is None:
                raise BadInput(f"{recipe.method}: parent card '{self.parent.id}' has no transformer to continue")
            changed = sorted(k for k, v in recipe.model.items() if spec.config.get(k) != v)
            if changed and recipe.method == "finetune":
                raise BadInput(f"finetune keeps the architecture of '{self.parent.id}'; the recipe changes "
                               f"model.{', model.'.join(changed)} (leave model: empty)")
            self.config = WanDiTConfig.from_card(spec.config)
            self.dit = WanDiT(self.config, platform).to(self.device)
            self.dit.load_state_dict(parent.component("transformer").state_dict())
            if self.loop_defaults is not None:  # it samples as the card it continues, unless data.loop says otherwise
                merge_default_stack(parent, self.dit, served.defaults.get("adapters") if served else None)
                self.loop_defaults = loop_defaults(recipe, inherited_defaults(served))
        self.vae_name = next((n for n, c in self.parent.manifest.components.items() if c.kind == "vae"), None)
        if self.vae_name is None:
            raise BadInput(f"parent card '{self.parent.id}' has no VAE component")
        self.vae = vae = parent.component(self.vae_name)
        self._check_latent_shape(latents(vae, train.images[:1], self.device)[0].shape[1:])
        # a card continued (fine-tuned, or given an adapter) learns on the features its own text encoder makes
        encoder = None if recipe.method == "pretrain" or served is None else DenoiseLoop(parent).text_encoder
        self.text_spec = dict(TEXT_ENCODER) if encoder is None else _carried(self.parent, encoder, recipe.method)
        self._text(platform, train, test, None if encoder is None else parent.component(encoder))
        self.images = transform(recipe.data.get("transform", "none"), train.images)
        self.mean, self.std = latents(vae, self.images, self.device)
        self.test_images = transform(recipe.data.get("transform", "none"), test.images[:2000])
        self.test_mean, _ = latents(vae, self.test_images, self.device)

    def check_parent(self) -> None:
        """What the recipe asks of its parent card that its manifest and weights headers can answer: checked before
        its weights load and the data are encoded (minutes on Fashion-MNIST), not after."""
        return None

    def _check_latent_shape(self, shape) -> None:
        """The DiT fits the VAE's latents (C, frames, H, W): it reads and predicts C channels, its patch tiles them."""
        c = self.config
        for name in ("in_channels", "out_channels"):
            if getattr(c, name) != shape[0]:
                raise BadInput(f"model.{name} is {getattr(c, name)}, but the VAE of '{self.parent.id}' makes "
                               f"{shape[0]}-channel latents; set model.{name}={shape[0]}")
        if any(size % p for size, p in zip(shape[1:], c.patch, strict=True)):
            raise BadInput(f"model.patch {list(c.patch)} does not tile the VAE's latents (frames, height, width = "
                           f"{', '.join(map(str, shape[1:]))}); each must divide its size, e.g. [1, 2, 2]")

    def _text(self, platform: Platform, train: Split, test: Split, encoder=None) -> None:
        """Features of every training prompt (and the empty prompt), made by `encoder` (the continued card's) or the
        built-in text encoder — the one the written card's denoise loop will feed the DiT with. Class-labelled images
        draw from their class's phrasings (`labels` index the classes); captioned ones each have their own caption
        (`labels` index the distinct captions, one phrasing each)."""
        from cardtool.backends.registry import COMPONENTS

        if train.captions is None:
            prompts = training_prompts()
            flat, self.per_class = [p for options in prompts for p in options], len(prompts[0])
            labels, test_labels = train.labels, test.labels[:2000]
        else:
            captions = (*train.captions, *test.captions[:2000])
            flat, self.per_class = list(dict.fromkeys(captions)), 1
            where = {caption: i for i, caption in enumerate(flat)}
            rows = np.array([where[c] for c in captions], dtype=np.int64)
            labels, test_labels = rows[:len(train)], rows[len(train):]
        self.labels, self.test_labels = torch.from_numpy(labels), torch.from_numpy(test_labels)
        if encoder is None:
            build = COMPONENTS.resolve(TEXT_ENCODER["impl"], platform)[1]
            encoder = build(TEXT_ENCODER["config"], None, package_path(TEXT_ENCODER["source"]), platform, "float32")
        flat.append("")
        parts = [encoder(flat[i:i + 512]) for i in range(0, len(flat), 512)]  # thousands of captions, a part at once
        self.text, self.mask = (torch.cat([part[k] for part in parts]) for k in (0, 1))
        if self.text.shape[-1] != self.config.text_dim:
            raise BadInput(f"model.text_dim is {self.config.text_dim}, but the text encoder gives "
                           f"{self.text.shape[-1]}-wide token states; set model.text_dim={self.text.shape[-1]}")
        self.empty = len(flat) - 1
        # the prompts whose tokens fill every position the encoder reads: words past them train nothing
        full = self.mask.all(dim=1).tolist()
        self.filled = filled_warning([p for p, cut in zip(flat, full, strict=True) if cut],
                                     self.mask.shape[1], "caption" if train.captions is not None else "prompt")

    def modules(self):
        return {"transformer": self.dit}

    def loss_settings(self) -> dict[str, float]:
        return {"condition_dropout": self.dropout}

    def dataset_size(self) -> int:
        return len(self.labels)

    def _conditions(self, labels, generator, dropout: float):
        choice = torch.randint(0, self.per_class, (len(labels),), generator=generator)
        index = labels * self.per_class + choice
        drop = torch.rand(len(labels), generator=generator) < dropout
        index = torch.where(drop, torch.full_like(index, self.empty), index).to(self.device)
        return self.text[index], self.mask[index]

    def _loss(self, x0, labels, generator, dropout, **adapters):
        text, mask = self._conditions(labels, generator, dropout)
        t = torch.sigmoid(torch.randn(len(x0), generator=generator)).to(self.device)  # logit-normal (SD3)
        noise = torch.randn(x0.shape, generator=generator).to(self.device)
        tb = t[:, None, None, None, None]
        v = self.dit((1 - tb) * x0 + tb * noise, t * 1000, text, mask, **adapters)
        return (v.float() - (noise - x0)).pow(2).mean()

    def adapters(self, idx, test: bool = False) -> dict:
        """The adapter arguments of the DiT's forward for examples `idx` (an adapter method's own)."""
        return {}

    def loss(self, indices, generator):
        idx = torch.from_numpy(indices)
        eps = torch.randn(self.mean[idx].shape, generator=generator).to(self.device)
        x0 = self.mean[idx] + self.std[idx] * eps  # a posterior sample, fresh each time
        return self._loss(x0, self.labels[idx], generator, self.dropout, **self.adapters(idx)), {}

    @torch.no_grad()
    def finish(self, dit) -> dict:
        """Flow-matching loss of the final (EMA) weights on (up to) 2,000 held-out test latents, fixed noise: the mean
        over latents, in chunks of 500 weighted by their size (an image folder's last chunk may be short)."""
        self.dit, trained = dit, self.dit
        generator = torch.Generator().manual_seed(12345)
        starts = range(0, len(self.test_mean), 500)
        losses = [float(self._loss(self.test_mean[i:i + 500], self.test_labels[i:i + 500], generator, 0.0,
                                   **self.adapters(torch.arange(i, min(i + 500, len(self.test_mean))), test=True)))
                  for i in starts]
        self.dit = trained
        sizes = [min(500, len(self.test_mean) - i) for i in starts]
        return {"test_flow_loss": round(float(np.average(losses, weights=sizes)), 5)}

    def card_components(self) -> dict:
        vae = self.parent.manifest.components[self.vae_name]
        return {"text_encoder": self.text_spec,
                "vae": {"kind": "vae", "impl": vae.impl, "config": dict(vae.config), "weights": "vae.safetensors"},
                "transformer": {"kind": "dit", "impl": "wan-dit", "config": self.config.to_card(),
                                "weights": "transformer.safetensors"}}

    def card_copies(self) -> dict:
        return {"vae.safetensors": self.parent.weights_file(self.vae_name)}

    def card_loop(self) -> dict:
        return {"kind": "flow_denoise", "uses": ["text_encoder", "vae", "transformer"], "defaults": self.loop_defaults}


def _carried(card, name: str, method: str) -> dict:
    """The parent's text encoder as the new card declares it: by its package source, which resolves anywhere. One
    whose files are in the parent's folder cannot be carried to a card of its own (an adapter card extends its parent
    and declares none)."""
    spec = card.manifest.components[name]
    if method == "finetune" and (spec.weights is not None or spec.source is None or
                                 not spec.source.startswith("package:")):
        raise BadInput(f"finetune writes a card of its own, and the text encoder of '{card.id}' ('{name}') is in "
                       "its folder; give it a package: source, or train an adapter (lora), which extends the card")
    return spec.model_dump(mode="json", exclude_none=True)


def inherited_defaults(loop) -> dict:
    """A fine-tuned card's starting loop defaults: its parent's denoise `loop`'s (if any), less its adapter stack
    (merged into the weights it continues: the new card declares no adapters)."""
    return {k: v for k, v in (loop.defaults if loop is not None else {}).items() if k != "adapters"}


def loop_defaults(recipe: Recipe, inherited: dict | None = None) -> dict:
    """The card's denoise-loop defaults: `data.loop` over `inherited` (a fine-tuned card's parent's) over the built-in
    ones, checked against the loop's schema now — found only when the card is written, a mistake would cost the whole
    run."""
    loop = recipe.data.get("loop", {})
    if not isinstance(loop, dict):
        raise BadInput(f"{recipe.method} recipe: data.loop must map loop settings (steps, guidance, …) to values, "
                       f"got {loop!r}")
    defaults = {"steps": 20, "guidance": 4.0, "shift": 1.0, "solver": "euler", **(inherited or {}), **loop}
    try:
        FlowDenoiseDefaults.model_validate(defaults)
    except ValidationError as e:
        raise BadInput(f"{recipe.method} recipe: {field_problems(e, 'data.loop')}") from None
    return defaults
