"""The `hf-encoder` configuration and what its `source` folder must hold: a Hugging Face encoder with its
config.json, a tokenizer and safetensors weights (a pickle `pytorch_model.bin` is never loaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, ClassVar

from pydantic import Field

from cardtool.backends.component_config import ComponentConfig
from cardtool.files import is_regular_file, read_small_file

__all__ = ["HFEncoderConfig"]

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "spiece.model", "tokenizer.model")


class HFEncoderConfig(ComponentConfig):
    needs: ClassVar[str] = "source"
    max_length: Annotated[int, Field(strict=True, ge=1, le=4096)] = 32

    def source_problems(self, source: Path) -> list[str]:
        """Why `source` cannot serve as this encoder; empty when it can. Reads only config.json."""
        settings, reason = _encoder_settings(source)
        if reason:
            return [reason]
        problems = []
        if not is_regular_file(source / "model.safetensors"):
            problems.append(f"{source} holds no model.safetensors (only safetensors weights are loaded)")
        if not any(is_regular_file(source / name) for name in TOKENIZER_FILES):
            problems.append(f"{source} holds no tokenizer ({', '.join(TOKENIZER_FILES)})")
        limit = settings.get("max_position_embeddings")
        if isinstance(limit, int) and self.max_length > limit:
            problems.append(f"max_length {self.max_length} is beyond the encoder's {limit} positions")
        return problems

    def facts(self, source: Path | None = None) -> dict:
        settings, reason = _encoder_settings(source) if source is not None else ({}, "")
        hidden = settings.get("hidden_size")
        return {"text_dim": hidden} if isinstance(hidden, int) and not reason else {}


def _encoder_settings(source: Path) -> tuple[dict, str]:
    text, reason = read_small_file(source / "config.json")
    if reason:
        return {}, reason
    try:
        settings = json.loads(text)
    except ValueError as e:
        return {}, f"{source / 'config.json'} is not JSON: {e}"
    if not isinstance(settings, dict) or not isinstance(settings.get("hidden_size"), int):
        return {}, f"{source / 'config.json'} does not give the encoder's hidden_size"
    return settings, ""
