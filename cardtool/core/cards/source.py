"""Reading a manifest file (YAML or TOML, one schema) into data plus the line:column of every field."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.errors import CardValidationError, Problem

__all__ = ["MANIFEST_NAMES", "Source", "display_path", "read_source"]

MANIFEST_NAMES = ("card.yaml", "card.toml")

FieldPath = tuple[str, ...]
Mark = tuple[int, int]  # 1-based (line, column)


def display_path(path: Path) -> str:
    """A path as a person would type it: relative to the working directory when it lies below it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else str(path)
    except ValueError:  # another drive on Windows
        return str(path)


@dataclass
class Source:
    """A parsed manifest: its data and where each field's key and value stand in the file."""

    file: Path
    data: dict
    keys: dict[FieldPath, Mark] = field(default_factory=dict)
    values: dict[FieldPath, Mark] = field(default_factory=dict)

    def mark(self, path: FieldPath, *, key: bool = False) -> Mark:
        """The position of `path`, or of its nearest ancestor present in the file."""
        table = self.keys if key else self.values
        for n in range(len(path), 0, -1):
            if path[:n] in table:
                return table[path[:n]]
        return (1, 1)

    def problem(self, path: FieldPath, message: str, fix: str = "", *, key: bool = False) -> Problem:
        line, col = self.mark(path, key=key)
        return Problem(display_path(self.file), line, col, ".".join(path), message, fix)


def read_source(file: Path) -> Source:
    """Parse `file` (card.yaml or card.toml); any parse failure is a located CardValidationError."""
    shown = display_path(file)
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CardValidationError.at(shown, 1, 1, "", f"not UTF-8 text ({e.reason})", "save it as UTF-8")
    except OSError as e:
        raise CardValidationError.at(shown, 1, 1, "", f"cannot read: {e.strerror}", "check the path")
    source = _read_toml(file, text) if file.suffix == ".toml" else _read_yaml(file, text)
    if not isinstance(source.data, dict):
        kind = type(source.data).__name__ if source.data is not None else "an empty document"
        raise CardValidationError.at(shown, 1, 1, "", f"a manifest is a mapping of fields, got {kind}",
                                     "start from examples/cards/tiny-base/card.yaml")
    return source


# --- YAML --------------------------------------------------------------------------------------------

def _read_yaml(file: Path, text: str) -> Source:
    import yaml

    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise CardValidationError.at(display_path(file), line, col, "", f"YAML: {e.problem or e.context}",
                                     "fix the YAML syntax at this position")
    except (yaml.YAMLError, RecursionError, ValueError, TypeError) as e:
        raise CardValidationError.at(display_path(file), 1, 1, "", f"YAML: {e}", "fix the YAML syntax")
    source = Source(file, data)
    duplicates: list[Problem] = []
    if root is not None:
        _walk_yaml(root, (), source, duplicates)
    if duplicates:
        raise CardValidationError(duplicates)
    return source


def _walk_yaml(node, path: FieldPath, source: Source, duplicates: list[Problem]) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            name = str(key_node.value)
            if name == "<<":  # YAML merge key: the merged fields keep their own positions
                continue
            sub = path + (name,)
            if sub in source.keys:
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                duplicates.append(Problem(display_path(source.file), line, col, ".".join(sub),
                                          "duplicate key", "keep one of the duplicate keys"))
                continue
            source.keys[sub] = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
            source.values[sub] = (value_node.start_mark.line + 1, value_node.start_mark.column + 1)
            _walk_yaml(value_node, sub, source, duplicates)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            sub = path + (str(i),)
            source.keys[sub] = source.values[sub] = (item.start_mark.line + 1, item.start_mark.column + 1)
            _walk_yaml(item, sub, source, duplicates)


# --- TOML --------------------------------------------------------------------------------------------

_KEY_PART = r'[A-Za-z0-9_-]+|"[^"\n]*"|\'[^\'\n]*\''
_DOTTED = rf"(?:{_KEY_PART})(?:\s*\.\s*(?:{_KEY_PART}))*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?")
_ASSIGN = re.compile(rf"^\s*({_DOTTED})\s*=\s*")
_INLINE_KEY = re.compile(rf"[{{,]\s*({_DOTTED})\s*=\s*")
_TOML_AT = re.compile(r"at line (\d+), column (\d+)")


def _split_key(dotted: str) -> FieldPath:
    return tuple(p.strip("\"'") for p in re.findall(_KEY_PART, dotted))


def _read_toml(file: Path, text: str) -> Source:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        at = _TOML_AT.search(str(e))
        line, col = (int(at.group(1)), int(at.group(2))) if at else (1, 1)
        message = _TOML_AT.sub("", str(e)).strip(" ()")
        raise CardValidationError.at(display_path(file), line, col, "", f"TOML: {message}",
                                     "fix the TOML syntax at this position")
    source = Source(file, data)
    _scan_toml(text, source)
    return source


def _scan_toml(text: str, source: Source) -> None:
    """Record key positions line by line (tomllib keeps none): table headers, assignments and the
    first level of inline tables. Fields it cannot place fall back to their nearest ancestor."""
    table: FieldPath = ()
    array_counts: dict[FieldPath, int] = {}
    in_multiline = False
    for lineno, line in enumerate(text.splitlines(), start=1):
        toggles = (line.count('"""') + line.count("'''")) % 2
        if in_multiline:
            in_multiline = not toggles
            continue
        in_multiline = bool(toggles)
        header = _HEADER.match(line)
        if header:
            table = _split_key(header.group(2))
            if header.group(1) == "[[":
                index = array_counts.get(table, 0)
                array_counts[table] = index + 1
                source.keys.setdefault(table, (lineno, header.start(2) + 1))
                table = table + (str(index),)
            source.keys[table] = source.values[table] = (lineno, header.start(2) + 1)
            continue
        assign = _ASSIGN.match(line)
        if not assign:
            continue
        path = table + _split_key(assign.group(1))
        source.keys[path] = (lineno, assign.start(1) + 1)
        source.values[path] = (lineno, assign.end() + 1)
        rest = line[assign.end():]
        if rest.startswith("{"):
            for inner in _INLINE_KEY.finditer(rest):
                depth = rest.count("{", 0, inner.start() + 1) - rest.count("}", 0, inner.start() + 1)
                if depth != 1:
                    continue
                sub = path + _split_key(inner.group(1))
                source.keys.setdefault(sub, (lineno, assign.end() + inner.start(1) + 1))
                source.values.setdefault(sub, (lineno, assign.end() + inner.end() + 1))
