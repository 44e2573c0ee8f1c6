"""A command line as the text a card records (`recipe.command`): one a shell runs again to the same bytes."""

from __future__ import annotations

import os
import shlex


def shell_join(words) -> str:
    """`words` quoted for a POSIX shell and joined, as `shlex.join` — except a word holding a byte that is not
    UTF-8 (a Linux file name may hold any byte; Python holds it as U+DC80–U+DCFF) or a character a terminal acts
    on, which shlex would leave in the text (where a manifest cannot hold it): that word is written in ANSI-C
    quoting, `$'caf\\xe9'`, which bash, zsh and ksh read back to the same bytes."""
    return " ".join(_quoted(str(word)) for word in words)


def _quoted(word: str) -> str:
    try:
        raw = os.fsencode(word)  # the bytes the command line held
    except UnicodeEncodeError:  # a lone surrogate no byte decodes to (only a Python caller can give one)
        raw = word.encode("utf-8", "surrogatepass")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.isprintable():
        return shlex.quote(text)
    out = []
    for char in raw.decode("utf-8", "surrogateescape"):
        if char in "\\'":
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        else:  # each byte of it: an undecoded byte, or a control character's one
            out.extend(f"\\x{b:02x}" for b in char.encode("utf-8", "surrogateescape"))
    return "$'" + "".join(out) + "'"
