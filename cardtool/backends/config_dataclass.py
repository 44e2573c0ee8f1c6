"""Component configs as frozen dataclasses read from a card's `config` mapping: unknown keys are errors."""

from __future__ import annotations

from dataclasses import asdict, fields

from cardtool.errors import BadInput

__all__ = ["config_from_card", "config_to_card"]


def config_from_card(cls, impl: str, config: dict):
    """`cls(**config)` with lists turned into the tuples the dataclass holds; unknown keys are refused."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise BadInput(f"{impl} config: unknown keys {unknown}; known: {sorted(known)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})


def config_to_card(config) -> dict:
    """The dataclass as a card's YAML-friendly mapping (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
