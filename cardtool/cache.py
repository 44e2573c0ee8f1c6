"""Where cardtool keeps what it can recompute: encoded prompts, weights digests."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """CARDTOOL_CACHE, else $XDG_CACHE_HOME/cardtool, else ~/.cache/cardtool."""
    if os.environ.get("CARDTOOL_CACHE"):
        return Path(os.environ["CARDTOOL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cardtool"
