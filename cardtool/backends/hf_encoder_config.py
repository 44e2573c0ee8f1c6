"""The `hf-encoder` configuration and what its `source` folder must hold: a Hugging Face encoder with its
config.json, a tokenizer and safetensors weights (a pickle `pytorch_model.bin` is never loaded)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field

from cardtool.backends.component_config import ComponentConfig
from cardtool.backends.hf_encoder_fields import field_problems, positions
from cardtool.backends.hf_tokenizer_files import special_tokens, tokenizer_files_problems
from cardtool.files import is_regular_file, read_json_object

__all__ = ["HFEncoderConfig"]

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "spiece.model", "tokenizer.model")


class HFEncoderConfig(ComponentConfig):
    needs: ClassVar[str] = "source"
    max_length: Annotated[int, Field(strict=True, ge=1, le=4096)] = 32

    def source_problems(self, source: Path) -> list[str]:
        """Why `source` cannot serve as this encoder; empty when it can. Reads config.json, the tokenizer's files and
        model.safetensors' header."""
        settings, reason = _encoder_settings(source)
        if reason:
            return [reason]
        problems = field_problems(settings)
        if not is_regular_file(source / "model.safetensors"):
            problems.append(f"{source} holds no model.safetensors (only safetensors weights are loaded)")
        if not any(is_regular_file(source / name) for name in TOKENIZER_FILES):
            problems.append(f"{source} holds no tokenizer ({', '.join(TOKENIZER_FILES)})")
        if not problems:
            problems += tokenizer_files_problems(source, settings)
        if not problems:
            problems += _config_against_weights(source, settings)
        return problems

    def setting_problems(self, source: Path) -> list[tuple[tuple[str, ...], str, str]]:
        """max_length within the encoder's positions, and past the special tokens its tokenizer adds to a prompt:
        shorter than those, a prompt is not truncated at all, and prompts of other lengths cannot be batched (at
        exactly their number every prompt is the same text states)."""
        settings, _ = _encoder_settings(source)
        limit, specials = positions(settings), special_tokens(source, settings)
        if limit is not None and self.max_length > limit:
            return [(("max_length",), f"max_length {self.max_length} is beyond the encoder's {limit} positions",
                     f"set max_length to at most {limit}")]
        if specials is not None and self.max_length <= specials:
            return [(("max_length",), f"max_length {self.max_length} leaves no token for the prompt: the tokenizer "
                     f"adds {specials} special tokens to each", f"set max_length to at least {specials + 1}")]
        return []

    def facts(self, source: Path | None = None) -> dict:
        settings, reason = _encoder_settings(source) if source is not None else ({}, "")
        hidden = settings.get("hidden_size")
        return {"text_dim": hidden} if isinstance(hidden, int) and not reason else {}


_LAYER = re.compile(r"(?:^|\.)(?:layer|layers|h|block|blocks)\.(\d+)\.")
# tensor name ending → the config sizes its (rows, columns) are, in the Hugging Face encoders' naming; "width" is the
# embeddings' width: hidden_size, or embedding_size where the type projects narrower embeddings up to the layers
_SHAPED = {"word_embeddings.weight": ("vocab_size", "width"),
           "embed_tokens.weight": ("vocab_size", "width"),
           "position_embeddings.weight": ("max_position_embeddings", "width"),
           "token_type_embeddings.weight": ("type_vocab_size", "width"),
           "intermediate.dense.weight": ("intermediate_size", "hidden_size")}
_FACTORED = ("electra", "albert")  # embeddings embedding_size wide (transformers' default 128)
# the ending of layer 0's query weight, by model_type (the others name it as BERT does): another type's weights lack it
_QUERY = {"mpnet": "layer.0.attention.attn.q.weight", "deberta-v2": "layer.0.attention.self.query_proj.weight",
          "albert": "albert_layers.0.attention.query.weight"}
_BERT_QUERY = "layer.0.attention.self.query.weight"


def _config_against_weights(source: Path, settings: dict) -> list[str]:
    """Where config.json disagrees with model.safetensors' header — found here, from the header alone, rather than
    when transformers builds the model the config describes: 100,000 layers took 23 GB and minutes to fail, weights
    of another encoder type fail to load."""
    from cardtool.core.cards.weight_files import read_header

    header, reason = read_header(source / "model.safetensors")
    if reason:
        return []  # reported as the source's weights problem
    model_type = settings.get("model_type")
    query = _QUERY.get(model_type, _BERT_QUERY)
    if not any(name.endswith(query) for name in header):
        return [f"config.json's model_type is {model_type!r}, but model.safetensors holds no …{query}: the weights "
                "are not that encoder's"]
    width = "embedding_size" if model_type in _FACTORED else "hidden_size"
    sizes = {**settings, "width": settings.get(width, 128)}
    if not isinstance(sizes["width"], int) or isinstance(sizes["width"], bool) or sizes["width"] < 1:
        return [f"config.json's {width} is {sizes['width']!r}; it is a whole number of at least 1"]
    problems = []
    heads = settings.get("num_attention_heads")
    if heads is None:  # the weights' shapes are the same for any count: transformers would take its class's default
        problems.append("config.json does not give num_attention_heads")
    elif isinstance(heads, int) and (heads < 1 or settings["hidden_size"] % heads):
        problems.append(f"config.json's hidden_size {settings['hidden_size']} is not a multiple of its "
                        f"num_attention_heads {heads}")
    layers = {match[1] for name in header if (match := _LAYER.search(name))}
    declared = settings.get("num_hidden_layers")
    if layers and declared is None:
        problems.append(f"config.json does not give num_hidden_layers; model.safetensors holds {len(layers)} layers")
    elif layers and isinstance(declared, int) and declared != len(layers):
        problems.append(f"config.json's num_hidden_layers is {declared}; model.safetensors holds {len(layers)} layers")
    reported: set[str] = set()
    for name, (_, shape) in sorted(header.items()):
        keys = next((keys for ending, keys in _SHAPED.items() if name.endswith(ending)), None)
        if keys is None or len(shape) != 2:
            continue
        for key, size in zip(keys, shape, strict=True):
            if key != "width" and key not in settings and key not in reported:
                reported.add(key)  # transformers would build it at its class's default size (BERT's 3072, say)
                problems.append(f"config.json does not give {key}; model.safetensors' {name} is {list(shape)}")
            elif isinstance(sizes.get(key), int) and sizes[key] != size and key not in reported:
                reported.add(key)  # once, with the first tensor that shows it: not once per layer
                named = width if key == "width" else key
                problems.append(f"config.json's {named} is {sizes[key]}"
                                f"{' (its default)' if named not in settings else ''}; model.safetensors' {name} is "
                                f"{list(shape)}")
    return problems[:3]


def _encoder_settings(source: Path) -> tuple[dict, str]:
    settings, reason = read_json_object(source / "config.json")
    if not reason and not isinstance(settings.get("hidden_size"), int):
        reason = f"{source / 'config.json'} does not give the encoder's hidden_size"
    return ({}, reason) if reason else (settings, "")
