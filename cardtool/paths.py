"""Paths a user writes where no shell expands them: `--out=~/x` (bash expands `~` only at a word's start or after the
`=` of a variable assignment), a quoted `~` in a CI file's or a Dockerfile's environment, a workflow's paths."""

from __future__ import annotations

import os

__all__ = ["home_expanded"]


def home_expanded(text: str) -> str:
    """`text` with a leading `~` or `~USER` made that home folder, as pip and huggingface_hub take their paths: left
    literal, it would make a folder named `~` in the working folder, a trap for a later `rm -rf ~`. As a shell does,
    the text is kept as written where there is no such user or no home folder."""
    return os.path.expanduser(text) if text.startswith("~") else text
