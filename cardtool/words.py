"""How a count reads in a message: one plural rule for the command line and the core alike."""

from __future__ import annotations

__all__ = ["counted"]


def counted(number: int, noun: str) -> str:
    """'1 image', '2 images'."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
