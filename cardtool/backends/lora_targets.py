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
