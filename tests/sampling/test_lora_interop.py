"""LoRA files interoperate with diffusers and PEFT both ways: a LoRA cardtool writes loads with diffusers'
`load_lora_adapter` on WanTransformer3DModel, and one PEFT trains on diffusers' model (saved by diffusers' Wan
pipeline, `transformer.`-prefixed) serves from a card; the outputs agree within 1e-5."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from cardtool.backends.lora import LoraPlan, linear_names, write_lora
from cardtool.backends.lora_targets import DEFAULT_TARGETS, matching
from cardtool.backends.platform import Platform
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.core.cards.loader import load_card
from cardtool.core.sampling.instance import ModelInstance

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

CARD = """\
schema: cardtool/v1
id: tiny-lora
extends: {base}
adapters:
  x: {{kind: lora, target: transformer, weights: adapters/{file}, rank: {rank}, alpha: {alpha}}}
recipe: {{method: lora, parents: [tiny-base]}}
"""


def diffusers_model(card):
    config = WanDiTConfig.from_card(card.manifest.components["transformer"].config, "wan-dit")
    model = diffusers.WanTransformer3DModel(**config.to_diffusers()).eval()
    model.load_state_dict({k: v.float() for k, v in load_file(str(card.weights_file("transformer"))).items()},
                          strict=True)
    return model


def adapter_card(folder, base, file, rank, alpha):
    (folder / "card.yaml").write_text(CARD.format(base=os.path.relpath(base.folder, folder), file=file, rank=rank,
                                                  alpha=alpha))
    return ModelInstance(load_card(folder), Platform("cpu", "generic"))


def inputs():
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(2, 4, 1, 8, 8, generator=generator), torch.tensor([700.0, 150.0]),
            torch.randn(2, 16, 384, generator=generator))


def ours(instance, name="x"):
    dit = instance.component("transformer")
    lora = instance.adapters.get(name).value
    with torch.no_grad():
        return dit(*inputs(), lora=LoraPlan([((lora, 1.0),)], [0, 0], dit.ops.lora_bgmv, "cpu"))


def test_a_cardtool_lora_loads_in_diffusers_with_the_same_output(examples, tmp_path):
    base = load_card(examples / "tiny-base")
    layers = linear_names(ModelInstance(base, Platform("cpu", "generic")).component("transformer"))
    generator = torch.Generator().manual_seed(0)
    names = matching(sorted(layers), DEFAULT_TARGETS)
    a = {n: torch.randn(4, layers[n].in_features, generator=generator) / 4 for n in names}
    b = {n: torch.randn(layers[n].out_features, 4, generator=generator) / 4 for n in names}
    write_lora(tmp_path / "adapters" / "x.safetensors", a, b, rank=4, alpha=8)
    instance = adapter_card(tmp_path, base, "x.safetensors", 4, 8)
    theirs = diffusers_model(base)
    theirs.load_lora_adapter(str(tmp_path / "adapters"), weight_name="x.safetensors", prefix=None,
                             adapter_name="x", local_files_only=True)
    with torch.no_grad():
        expected = theirs(*inputs(), return_dict=False)[0]
        plain = instance.component("transformer")(*inputs())
    got = ours(instance)
    assert (got - plain).abs().max() > 0.05, "the LoRA changes the output"
    assert (got - expected).abs().max() <= 1e-5


def test_a_peft_lora_trained_on_diffusers_serves_from_a_card(examples, tmp_path):
    base = load_card(examples / "tiny-base")
    theirs = diffusers_model(base)
    config = peft.LoraConfig(r=3, lora_alpha=6, init_lora_weights=False,  # random B: the adapter does something
                             target_modules=["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"])
    torch.manual_seed(2)
    theirs.add_adapter(config, adapter_name="p")
    state = peft.get_peft_model_state_dict(theirs, adapter_name="p")
    diffusers.WanPipeline.save_lora_weights(tmp_path / "adapters", transformer_lora_layers=state,
                                            transformer_lora_adapter_metadata=config.to_dict())
    instance = adapter_card(tmp_path, base, "pytorch_lora_weights.safetensors", 3, 6)
    with torch.no_grad():
        expected = theirs(*inputs(), return_dict=False)[0]
    assert (ours(instance) - expected).abs().max() <= 1e-5
