"""Which linear layers of the DiT a LoRA may adapt: glob patterns over state-dict module names (light: no torch)."""

from __future__ import annotations

import fnmatch

__all__ = ["DEFAULT_TARGETS", "matching"]

# attention q/k/v/o (self and cross) and the FFN of every block
DEFAULT_TARGETS = ("blocks.*.attn1.to_q", "blocks.*.attn1.to_k", "blocks.*.attn1.to_v", "blocks.*.attn1.to_out.0",
                   "blocks.*.attn2.to_q", "blocks.*.attn2.to_k", "blocks.*.attn2.to_v", "blocks.*.attn2.to_out.0",
                   "blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2")


def matching(names, patterns) -> list[str]:
    """The names that match any of the glob patterns (`blocks.*.attn1.to_q`)."""
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


PREFIX = "transformer."  # diffusers' pipelines save a transformer's LoRA under this prefix


def module_key(tensor: str, prefixed: bool) -> str:
    """A LoRA tensor's name relative to the DiT: without diffusers' pipeline prefix when the file uses it."""
    return tensor.removeprefix(PREFIX) if prefixed else tensor


def uses_prefix(tensors) -> bool:
    """Whether every tensor of a LoRA file carries diffusers' `transformer.` pipeline prefix."""
    names = list(tensors)
    return bool(names) and all(n.startswith(PREFIX) for n in names)


def rank_and_alpha(metadata: dict[str, str]) -> dict[str, str]:
    """The rank and alpha a LoRA file's header states: our plain fields, else diffusers' `lora_adapter_metadata`
    (PEFT LoraConfig fields `r` and `lora_alpha`, with or without the pipeline prefix)."""
    from cardtool.files import parse_json

    out = {k: metadata[k] for k in ("rank", "alpha") if k in metadata}
    try:
        config = parse_json(metadata.get("lora_adapter_metadata", "{}"))
    except ValueError:
        config = {}
    if isinstance(config, dict):
        config = {k.removeprefix(PREFIX): v for k, v in config.items()}
        for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha")):
            if ours not in out and isinstance(config.get(theirs), (int, float)):
                out[ours] = str(config[theirs])
    return out
