"""Schema errors as located problems: pydantic's error locations mapped to the manifest's fields and
positions, with a fix for each (a close key name, the keys allowed at that place)."""

from __future__ import annotations

import difflib
import types
import typing

from pydantic import BaseModel, ValidationError

from cardtool.core.cards.schema import CardManifest
from cardtool.core.cards.source import FieldPath, Source
from cardtool.errors import Problem

__all__ = ["locate_problem", "schema_problems"]


def locate_problem(sources, path: FieldPath, message: str, fix: str = "", *, key: bool = False,
                   missing: bool = False) -> Problem:
    """A problem located in whichever manifest (the card's own or one it extends) declares `path` — for a `missing`
    key, the mapping it is missing from: a parent's own `recipe`, which is never inherited, is not where the card's is
    missing."""
    for n in range(len(path) - (1 if missing else 0), 0, -1):
        for source in sources:
            if path[:n] in source.keys:
                return source.problem(path, message, fix, key=key)
    return sources[0].problem(path, message, fix, key=key)


def schema_problems(error: ValidationError, data: dict, sources: tuple[Source, ...],
                    root: type[BaseModel] = CardManifest) -> list[Problem]:
    """One located problem per pydantic error, in the manifest that declares the field (`root`: the model that
    was validated, a card's or a workflow's)."""
    problems = []
    for e in error.errors():
        path = _data_path(e["loc"], data)
        kind = e["type"]
        if kind == "extra_forbidden":
            problems.append(locate_problem(sources, path, "unknown key", _extra_fix(e["loc"], root), key=True))
        elif kind == "missing":
            fix = f"add '{path[-1]}'"
            if path == ("recipe",) and "extends" in data:
                fix += " (a derived card states its own recipe; recipe is never inherited)"
            problems.append(locate_problem(sources, path, "required field is missing", fix, key=True, missing=True))
        elif kind in ("union_tag_invalid", "union_tag_not_found"):
            expected = (e.get("ctx") or {}).get("expected_tags", "'lora', 'controlnet'")
            message = f"unknown or missing adapter kind; expected {expected}"
            problems.append(locate_problem(sources, path + ("kind",), message, "set kind to one of the expected values",
                                           key=kind == "union_tag_not_found"))
        else:
            problems.append(locate_problem(sources, path, _value_message(e), "correct the value"))
    return problems


def _data_path(loc: tuple, data) -> FieldPath:
    """The field path in the manifest data for a pydantic error location (which also names union tags)."""
    path, node = [], data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif i != len(loc) - 1 or part == "[key]":
            continue  # a union tag or a key-validation step, not a field of the file
        path.append(str(part))
    return tuple(path)


def _value_message(e: dict) -> str:
    if e["type"] == "value_error":  # a model's own rule: its message says what is wrong with the whole
        return e["msg"].removeprefix("Value error, ")
    pattern = (e.get("ctx") or {}).get("pattern", "")
    value, hint = e.get("input"), ""
    if "0-9a-f" in pattern:
        message = "not a sha256 digest (64 lowercase hex characters)"
        if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value.lower()):
            hint = " (upper-case letters: write it in lower case, as sha256sum does)"
    elif pattern:
        message = "a name must start with a letter or digit and use only letters, digits, '.', '_' and '-'"
    else:
        message = e["msg"]
    shown = type(value).__name__ if isinstance(value, (dict, list)) else repr(value)
    return f"{message}, got {shown[:80]}{hint}"


def _extra_fix(loc: tuple, root: type[BaseModel]) -> str:
    allowed = _allowed_keys(loc[:-1], root)
    if not allowed:
        return "remove it"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f"did you mean '{close[0]}'?"
    return f"remove it; allowed here: {', '.join(allowed)}"


def _allowed_keys(loc: tuple, root: type[BaseModel]) -> list[str]:
    """The keys the schema allows at a pydantic error location, found by walking the model types."""
    kind = root
    for part in loc:
        kind = _strip(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            field = next((f for n, f in kind.model_fields.items() if (f.alias or n) == part), None)
            if field is None:
                return []
            kind = field.annotation
        elif typing.get_origin(kind) in (dict, list):
            kind = typing.get_args(kind)[-1]
        elif typing.get_origin(kind) in (typing.Union, types.UnionType):
            kind = next((m for m in typing.get_args(kind) if _tag(m) == part), None)
        else:
            return []
    kind = _strip(kind)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return [f.alias or n for n, f in kind.model_fields.items()]
    return []


def _strip(kind):
    while typing.get_origin(kind) is typing.Annotated:
        kind = typing.get_args(kind)[0]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(kind) if m is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return kind


def _tag(model) -> str | None:
    if isinstance(model, type) and issubclass(model, BaseModel) and "kind" in model.model_fields:
        args = typing.get_args(model.model_fields["kind"].annotation)
        return args[0] if args else None
    return None
