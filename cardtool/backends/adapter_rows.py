"""The torch side of one batch's adapters: the LoRA plan and ControlNet rows the Wan DiT's forward takes, made from
what the denoise loop decided per model row (which stack slot, which ControlNet with which control latent and scale);
the numpy reference's (`numpy_adapters.adapter_plan`) for its DiT."""

from __future__ import annotations

__all__ = ["adapter_arguments"]


def adapter_arguments(transformer, stacks: list[tuple], index: list[int], nets: dict[object, list[tuple]]) -> dict:
    """`lora` and `control` for the DiT's forward: `stacks` (per slot, (LoraWeights, scale) pairs) with each row's
    slot in `index` (−1: none); `nets` maps a ControlNet to its rows as (row, control latent, scale)."""
    if not hasattr(transformer, "parameters"):  # the numpy reference's DiT
        from cardtool.backends.numpy_adapters import adapter_plan

        return adapter_plan(stacks, index, nets)
    import torch

    from cardtool.backends.controlnet import ControlRows
    from cardtool.backends.lora import LoraPlan

    parameter = next(transformer.parameters())
    device, weights = parameter.device, parameter.dtype
    lora = LoraPlan(stacks, index, transformer.ops.lora_bgmv, device,
                    weights if weights == torch.float64 else torch.float32) if stacks else None
    control = [ControlRows(net, torch.tensor([r for r, _, _ in uses], device=device),
                           torch.cat([latent for _, latent, _ in uses]),
                           torch.tensor([scale for _, _, scale in uses], device=device))
               for net, uses in nets.items()]
    return {"lora": lora, "control": control or None}
