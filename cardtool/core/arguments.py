"""The checks the Python API's calls make of their arguments: each of the type the command line's parser
guarantees its option, or BadInput naming it before any work (not a TypeError deep in a run); and the command
line a call equals, which the card it makes records."""

from __future__ import annotations

import numbers
import os
from pathlib import Path

from cardtool.errors import BadInput
from cardtool.paths import unnamable
from cardtool.shell_words import shell_join


def command_line(name: str, positional: list[str], options: list[tuple[str, object]]) -> str:
    """The command line a call equals: what shapes the card — the recipe, its overrides and options, the data —
    those not given left out (`--set` as `--set=K=V`, which a value starting with a dash needs); not where it is
    written or whether it is evaluated."""
    words = ["cardtool", name, *positional]
    for option, value in options:
        if option == "--set":
            words.append(f"--set={value}")
        elif value is not None:
            words += [option, str(value)]
    return shell_join(words)


def check(*, texts: dict, paths: dict, flags: dict, whole: dict, callbacks: dict, optional_whole: dict | None = None,
          command=None) -> None:
    """Each argument of the type the command line's parser guarantees its option."""
    optional_whole = optional_whole or {}
    for name, value in texts.items():
        if value is not None and not isinstance(value, str):
            raise BadInput(f"{name} must be text (or None), got {value!r}"[:300])
    for name, value in paths.items():
        if value is not None:  # an empty one is the run's to refuse, naming its option (`--data ''`)
            path(name, value, "a path (or None)", empty=True)
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise BadInput(f"{name} must be True or False, got {value!r}"[:300])
    for name, value in [*whole.items(), *((k, v) for k, v in optional_whole.items() if v is not None)]:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise BadInput(f"{name} must be a whole number{' (or None)' if name in optional_whole else ''}, got "
                           f"{value!r}"[:300])
    for name, value in callbacks.items():
        if value is not None and not callable(value):
            raise BadInput(f"{name} must be a function (or None), got {value!r}"[:300])
    if command is not None and not isinstance(command, str):
        raise BadInput(f"command must be text (or None: the command line the call equals), got {command!r}"[:300])


def card_ref(name: str, value) -> str:
    """A card named by id, folder or manifest."""
    path(name, value, "a card id or path")
    return os.fspath(value)  # as given: `./x` is a folder where `x` may be an id


def optional_card_ref(name: str, value) -> str | None:
    """A card, or none (None or '', as `--held-out-judge ''` says none)."""
    return None if value is None or value == "" else card_ref(name, value)


def path(name: str, value, what: str = "a path", empty: bool = False) -> Path:
    """A path the operating system can be given: text or a path object, without what no file name holds (a NUL
    byte, a lone surrogate: `paths.unnamable`), which Python's file calls refuse with a bare ValueError; not empty
    unless `empty`."""
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str) or \
            (os.fspath(value) == "" and not empty):
        raise BadInput(f"{name} must be {what}, got {value!r}"[:300])
    held = unnamable(value)
    if held is not None:
        raise BadInput(f"{name} holds {held}, which no file name can: {value!r}"[:300])
    return Path(value)


def as_int(value) -> int | None:
    """A whole number as Python's int (numpy's integers pass the checks, and the runs compare with int)."""
    return None if value is None else int(value)


def maybe_path(value) -> Path | None:
    return None if value is None else Path(value)


def maybe_text(value) -> str | None:
    return None if value is None else os.fspath(value)


def sequence(name: str, value, what: str = "a list of strings (or one string)") -> list:
    if not isinstance(value, (list, tuple)):
        raise BadInput(f"{name} must be {what}, got {type(value).__name__}")
    return list(value)


def override_items(value) -> list[str]:
    """`overrides`: KEY.PATH=VALUE strings, as `--set` takes them; one string is one override."""
    items = [value] if isinstance(value, str) else sequence("overrides", value)
    for item in items:
        if not isinstance(item, str):
            raise BadInput(f"overrides must be KEY.PATH=VALUE strings, got {item!r}"[:300])
    return items
