"""`--method lora | controlnet`: an adapter trained with the flow-matching loss on a frozen text-to-image card's
DiT (ALGORITHMS.md, "LoRA and ControlNet for DiTs"). The data are the training images, optionally transformed
(`data.transform`: the effect a LoRA learns); a ControlNet learns to follow each image's control (its
`model.control` preprocessor, silhouette by default). Only the adapter's parameters train; the written card
`extends` the base and adds the adapter."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cardtool.backends.controlnet import ControlRows, WanControlNet
from cardtool.backends.lora import TrainableLora, lora_file
from cardtool.backends.lora_targets import DEFAULT_TARGETS, matching
from cardtool.backends.wan_config import CONTROLNET_BLOCKS
from cardtool.core.cards.adapters import block_count
from cardtool.core.cards.schema import Name
from cardtool.core.cards.weight_files import read_header
from cardtool.core.sampling.control import PREPROCESSORS
from cardtool.core.training.lora_settings import LORA_UNSHARDABLE, LoraSettings
from cardtool.core.training.methods.flow_matching import FlowMatchingTask
from cardtool.core.training.methods.vae import latents
from cardtool.core.training.recipes import Section, field_problems
from cardtool.errors import BadInput

__all__ = ["LoraTask", "ControlNetTask", "adapter_task"]

CONTROLS = tuple(p for p in PREPROCESSORS if p != "none")  # a ControlNet learns to follow a control image


class _LoraModel(LoraSettings):
    """A lora recipe's `model:`: the adapter's name in the card (default: the card id) and its LoRA."""

    adapter: Name | None = None
    rank: int = Field(8, ge=1, le=1024)


class _ControlNetModel(Section):
    """A controlnet recipe's `model:`: the adapter's name, the base blocks it copies and its control preprocessor."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    adapter: Name | None = None
    blocks: int = Field(CONTROLNET_BLOCKS, ge=1)
    control: Literal[CONTROLS] = "silhouette"  # type: ignore[valid-type]


def _scales(recipe) -> torch.Tensor | None:
    """`loss.scales`: the adapter scales a LoRA trains at, each in (0, 1]; None (scale 1 only) when unset."""
    value = recipe.loss.get("scales")
    if value is None:
        return None
    if not isinstance(value, list) or not value or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1 for v in value):
        raise BadInput(f"lora recipe: loss.scales must be a list of numbers in (0, 1], got {value!r}")
    if recipe.data.get("transform", "none") == "none":
        raise BadInput("lora recipe: loss.scales mixes transformed and plain images; set data.transform")
    return torch.tensor([float(v) for v in value])


class _AdapterTask(FlowMatchingTask):
    DATA_KEYS = ("folder", "transform")  # an adapter card keeps its base's loop
    KEYS: tuple[str, ...] = ()  # the recipe's model: settings
    MODEL: type[BaseModel]  # their schema
    HOLDS = ""  # the attribute holding the adapter that trains
    unshardable = LORA_UNSHARDABLE

    def __init__(self, recipe, platform, train, test):
        unknown = sorted(set(recipe.model) - set(self.KEYS))
        if unknown:
            raise BadInput(f"{recipe.method} recipe: unknown model.{', model.'.join(unknown)}; "
                           f"its settings: {', '.join(self.KEYS)}")
        try:  # before the base is loaded, let alone trained on: the card written at the end must validate
            self.settings = self.MODEL.model_validate(recipe.model)
        except ValidationError as e:
            raise BadInput(f"{recipe.method} recipe: {field_problems(e, 'model')}") from None
        self.name = self.settings.adapter or recipe.card.id
        super().__init__(recipe, platform, train, test)
        self.dit.requires_grad_(False).eval()

    def check_parent(self) -> None:
        if self.parent.manifest.adapters.get(self.name) is not None:
            raise BadInput(f"'{self.parent.id}' already declares an adapter '{self.name}'; set model.adapter")

    def base_tensors(self) -> dict[str, tuple[int, ...]]:
        """The base transformer's tensor shapes, from its weights file's header ({} without one: the base's own
        loading then says what is wrong)."""
        spec = self.parent.manifest.components.get("transformer")
        if spec is None or spec.weights is None:
            return {}
        header, _ = read_header(self.parent.folder / spec.weights)
        return {name: shape for name, (_, shape) in header.items()}

    @torch.no_grad()
    def finish(self, adapter) -> dict:
        """The held-out flow loss of the frozen DiT with the final (EMA) adapter in place of the trained one."""
        trained = getattr(self, self.HOLDS)
        setattr(self, self.HOLDS, adapter)
        metrics = super().finish(self.dit)
        setattr(self, self.HOLDS, trained)
        return metrics


class LoraTask(_AdapterTask):
    KEYS, HOLDS, MODEL = ("adapter", "rank", "alpha", "targets"), "lora", _LoraModel
    LOSS_KEYS = ("condition_dropout", "scales")

    def __init__(self, recipe, platform, train, test):
        self.scales = _scales(recipe)
        super().__init__(recipe, platform, train, test)
        self.rank, self.alpha = self.settings.rank, self.settings.alpha
        self.targets = list(self.settings.targets)
        torch.manual_seed(recipe.train.seed)
        self.lora = TrainableLora(self.dit, self.targets, self.rank, self.alpha)
        if self.scales is not None:  # the untransformed images too: a row at scale s keeps its own with 1 − s
            self.plain_mean, self.plain_std = latents(self.vae, train.images, self.device)

    def check_parent(self) -> None:
        super().check_parent()
        tensors = self.base_tensors()
        linear = [name.removesuffix(".weight") for name, shape in tensors.items()
                  if name.endswith(".weight") and len(shape) == 2]
        if tensors and not matching(linear, self.settings.targets):
            raise BadInput(f"lora recipe: model.targets: no linear layer of '{self.parent.id}' matches the LoRA "
                           f"targets {list(self.settings.targets)}"[:300])

    def modules(self):
        return {"lora": self.lora}

    def adapters(self, idx, test=False):
        return {"lora": self.lora}

    def loss(self, indices, generator):
        """With `loss.scales`, each example trains the LoRA at a scale s drawn from the list, on its image
        transformed with probability s: at scale s the adapter then samples the mixture (1 − s)·base + s·effect.
        For an all-or-nothing effect (a mirror) that is what a partial scale can mean; without it, half the
        delta learned for scale 1 draws half-turned garments."""
        if self.scales is None:
            return super().loss(indices, generator)
        idx = torch.from_numpy(indices)
        scales = self.scales[torch.randint(len(self.scales), (len(idx),), generator=generator)]
        moved = (torch.rand(len(idx), generator=generator) < scales).reshape(-1, 1, 1, 1, 1).to(self.device)
        mean = torch.where(moved, self.mean[idx], self.plain_mean[idx])
        std = torch.where(moved, self.std[idx], self.plain_std[idx])
        x0 = mean + std * torch.randn(mean.shape, generator=generator).to(self.device)
        return self._loss(x0, self.labels[idx], generator, self.dropout, lora=self.lora.at(scales.to(self.device))), {}

    def artifact(self, lora) -> tuple[dict, dict, dict]:
        """The card's adapter entry, its weights file and that file's header metadata."""
        rel = f"adapters/{self.name}.safetensors"
        tensors, metadata = lora_file(*lora.weights(), self.rank, self.alpha)
        entry = {"kind": "lora", "target": "transformer", "weights": rel, "rank": self.rank, "alpha": self.alpha,
                 **({"targets": self.targets} if self.targets != list(DEFAULT_TARGETS) else {})}
        return {self.name: entry}, {rel: tensors}, {rel: metadata}


class ControlNetTask(_AdapterTask):
    KEYS, HOLDS, MODEL = ("adapter", "blocks", "control"), "net", _ControlNetModel

    def __init__(self, recipe, platform, train, test):
        super().__init__(recipe, platform, train, test)
        self.blocks, self.control = self.settings.blocks, self.settings.control
        torch.manual_seed(recipe.train.seed)
        self.net = WanControlNet.from_base(self.dit, self.blocks, platform).train()
        vae = self.vae
        prepare = PREPROCESSORS[self.control]
        self.controls, _ = latents(vae, prepare(self.images), self.device)
        self.test_controls, _ = latents(vae, prepare(self.test_images), self.device)

    def modules(self):
        return {"controlnet": self.net}

    def check_parent(self) -> None:
        super().check_parent()
        depth = block_count(self.base_tensors())
        if depth and self.settings.blocks > depth:
            raise BadInput(f"controlnet recipe: model.blocks {self.settings.blocks} exceeds the {depth} blocks of "
                           f"'{self.parent.id}'")

    def adapters(self, idx, test=False):
        controls = (self.test_controls if test else self.controls)[idx]
        rows = torch.arange(len(idx), device=self.device)
        return {"control": [ControlRows(self.net, rows, controls, torch.ones(len(idx), device=self.device))]}

    def artifact(self, net) -> tuple[dict, dict, dict]:
        rel = f"adapters/{self.name}.safetensors"
        entry = {"kind": "controlnet", "target": "transformer", "weights": rel, "control": self.control,
                 "config": {"blocks": self.blocks}}
        return {self.name: entry}, {rel: net.state_dict()}, {}


def adapter_task(recipe, platform, train, test):
    return (LoraTask if recipe.method == "lora" else ControlNetTask)(recipe, platform, train, test)
