"""Reading a manifest file (YAML or TOML, one schema) into data plus the line:column of every field."""

from __future__ import annotations

import hashlib
import math
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cardtool.errors import CardValidationError, Problem, raise_if_the_machines
from cardtool.paths import unnamable

__all__ = ["CONTROL_CHARACTERS", "MANIFEST_NAMES", "Source", "display_path", "peek_id", "plain_value_problems",
           "read_source"]

MANIFEST_NAMES = ("card.yaml", "card.toml")

FieldPath = tuple[str, ...]
Mark = tuple[int, int]  # 1-based (line, column)


def display_path(path: Path) -> str:
    """A path as a person would type it: relative to the working directory when it lies below it."""
    try:
        return os.path.relpath(path) if Path(path).resolve().is_relative_to(Path.cwd()) else str(path)
    except (ValueError, OSError, RuntimeError):  # another drive on Windows; a symlink loop
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


MAX_BYTES = 1 << 20  # a manifest is a page of settings, not a data file
MAX_DEPTH = 32  # nesting of mappings and lists
_JSON_SCALARS = (str, int, float, bool, type(None))
# control characters but tab and newline: text from elsewhere could otherwise carry terminal escape sequences
# (colours, a window title, hyperlinks, a carriage return over the line) into what cardtool prints
CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_cache: dict[tuple[str, bytes], Source] = {}
_CACHE_ENTRIES = 256  # the most recently used manifests a process keeps parsed (one that writes cards parses new ones)


_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
               (b"PK\x03\x04", "a zip archive (a pickle checkpoint?)"), (b"\x1f\x8b", "a gzip file"),
               (b"\x80", "a pickle"))


def _binary_kind(raw: bytes) -> str | None:
    """What a file that is not UTF-8 is, by its first bytes, where that is clear: an image, an archive, a pickle,
    safetensors weights (an 8-byte header length, then the JSON header)."""
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "a WebP image"
    if len(raw) > 9 and raw[8:10] in (b'{"', b"{ ") and int.from_bytes(raw[:8], "little") < len(raw):
        return "safetensors weights"
    return next((kind for signature, kind in _SIGNATURES if raw.startswith(signature)), None)


def read_source(file: Path) -> Source:
    """Parse `file` (card.yaml or card.toml); any problem is a located CardValidationError. Linear in the
    input: bounded size and nesting, no YAML aliases, only the plain YAML types. The result is cached per
    (path, content) and must not be modified."""
    shown = display_path(file)
    held = unnamable(file)
    if held is not None:
        raise CardValidationError.at(ascii(str(file))[1:-1], 1, 1, "", f"a path holding {held}, which no file name can",
                                     "give the file's path")
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            raise CardValidationError.at(shown, 1, 1, "", "not a regular file",
                                         "give a YAML or TOML file (a card, a recipe, a workflow)")
        if info.st_size > MAX_BYTES:
            raise _too_large(shown, f"{info.st_size} bytes")
        with file.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:  # grown since the stat, or a file that states no size (as /proc's do)
            raise _too_large(shown, "more bytes than its size stated")
        # keyed by content, not mtime: a manifest rewritten within one clock tick must not parse as its old self
        key = (str(file), hashlib.blake2b(raw, digest_size=16).digest())
        if key in _cache:
            _cache[key] = _cache.pop(key)  # the most recently used last
            return _cache[key]
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark (some editors write one) is no content
    except UnicodeDecodeError as e:
        kind = _binary_kind(raw)
        if kind:  # not text gone wrong: another kind of file given where a manifest is read
            fix = "give a YAML or TOML file (a card, a recipe, a workflow)" + (
                "; `cardtool generate --like IMAGE` makes an image again from the settings it records"
                if kind.endswith("image") else "")
            raise CardValidationError.at(shown, 1, 1, "", f"not a YAML or TOML file: it is {kind}", fix)
        raise CardValidationError.at(shown, 1, 1, "", f"not UTF-8 text ({e.reason})", "save it as UTF-8")
    except OSError as e:
        raise_if_the_machines(e)
        raise CardValidationError.at(shown, 1, 1, "", f"cannot read: {e.strerror}", "check the path")
    source = _read_toml(file, text) if file.suffix == ".toml" else _read_yaml(file, text)
    if not isinstance(source.data, dict):
        kind = type(source.data).__name__ if source.data is not None else "an empty document"
        raise CardValidationError.at(shown, 1, 1, "", f"a manifest is a mapping of fields, got {kind}",
                                     "start from an example: examples/cards/tiny-base/card.yaml (a card), "
                                     "examples/recipes/ (a recipe), examples/workflows/ (a workflow)")
    problems = _value_problems(source, source.data, ())
    if problems:
        raise CardValidationError(problems[:20])
    while len(_cache) >= _CACHE_ENTRIES:
        _cache.pop(next(iter(_cache)))  # the least recently used
    _cache[key] = source
    return source


def _too_large(shown: str, size: str) -> CardValidationError:
    return CardValidationError.at(shown, 1, 1, "", f"{size}: larger than the {MAX_BYTES}-byte limit for a manifest",
                                  "keep large results in files beside the card")


def plain_value_problems(value, dotted: str) -> list[str]:
    """Why `value`, given on a command line for field `dotted`, could not stand in a manifest (the rules below):
    a recipe's settings are written into the card it makes, so refuse them before the run, not after it."""
    path = tuple(dotted.split("."))
    return [f"{p.field}: {p.message} (fix: {p.fix})" for p in _value_problems(Source(Path(), {}), value, path)]


def _value_problems(source: Source, value, path: FieldPath) -> list[Problem]:
    """Manifests hold JSON's kinds of values only, printable as JSON: text keys, finite numbers, integers within
    64 bits, text without lone surrogates or control characters (tab and newline aside); nested at most
    MAX_DEPTH deep — the top-level mapping the first level, as in YAML's event stream (_check_events)."""
    if len(path) > MAX_DEPTH or (isinstance(value, (dict, list)) and len(path) == MAX_DEPTH):
        return [source.problem(path, f"nested deeper than {MAX_DEPTH} levels", "flatten the structure")]
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(source.problem(path, f"a key that is not text ({type(key).__name__})",
                                               "quote the key"))
                continue
            if CONTROL_CHARACTERS.search(key):
                problems.append(source.problem(path, f"a key holding a control character: {key[:60]!r}",
                                               "remove it"))
                continue
            problems += _value_problems(source, item, path + (key,))
        return problems
    if isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _value_problems(source, item, path + (str(i),))]
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return [source.problem(path, "text holding a lone surrogate (not encodable as UTF-8)",
                                   "remove the \\uD800-\\uDFFF escape")]
        control = CONTROL_CHARACTERS.search(value)
        if control:
            return [source.problem(path, f"text holding a control character (U+{ord(control[0]):04X}), which would "
                                   "drive the terminal that prints it", "remove it")]
        return []
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int) and not -(2**63) <= value < 2**63:  # a signed 64-bit integer's range
        return [source.problem(path, f"an integer of {value.bit_length() + 1} bits with its sign, beyond 64",
                               "use a smaller number")]
    if isinstance(value, float) and not math.isfinite(value):
        return [source.problem(path, f"a non-finite number ({value})", "use a finite number, or null for none")]
    if isinstance(value, _JSON_SCALARS):
        return []
    return [source.problem(path, f"a {type(value).__name__} value; manifests hold text, numbers, booleans, lists "
                           "and mappings", "quote it to make it text")]


# --- YAML --------------------------------------------------------------------------------------------

_PLAIN_TAGS = {f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "map", "seq")}


def _read_yaml(file: Path, text: str) -> Source:
    import yaml

    loader_class = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    shown = display_path(file)
    try:
        _check_events(yaml, text, shown, loader_class)
        loader = loader_class(text)
        try:
            root = loader.get_single_node()
            _check_scalars(yaml, loader, root, shown)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        if "nesting depth" in str(e.problem):  # PyYAML ≥ 6.0.4's own limit, met while it scans ahead of our check
            raise CardValidationError.at(shown, line, col, "", f"nested deeper than {MAX_DEPTH} levels",
                                         "flatten the structure") from None
        raise CardValidationError.at(shown, line, col, "", f"YAML: {e.problem or e.context}",
                                     "fix the YAML syntax at this position")
    except CardValidationError:
        raise
    except Exception as e:  # noqa: BLE001 - a constructor's own error (ValueError, KeyError …) is bad input too
        raise CardValidationError.at(shown, 1, 1, "", f"YAML: {type(e).__name__}: {str(e)[:200]}",
                                     "fix the YAML value")
    source = Source(file, data)
    duplicates: list[Problem] = []
    if root is not None:
        _walk_yaml(root, (), source, duplicates)
    if duplicates:
        raise CardValidationError(duplicates)
    return source


def _check_events(yaml, text: str, shown: str, loader_class) -> None:
    """Refuse aliases (their expansion can be exponential or cyclic) and nesting beyond MAX_DEPTH, from the
    event stream, before anything is composed or constructed."""
    depth = 0
    for event in yaml.parse(text, Loader=loader_class):
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            raise CardValidationError.at(shown, mark.line + 1, mark.column + 1, "",
                                         f"YAML alias *{event.anchor}: aliases are not allowed",
                                         "write the value out in full (a card that repeats another's can "
                                         "extend it instead)" if Path(shown).name in MANIFEST_NAMES else
                                         "write the value out in full")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                mark = event.start_mark
                raise CardValidationError.at(shown, mark.line + 1, mark.column + 1, "",
                                             f"nested deeper than {MAX_DEPTH} levels", "flatten the structure")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _check_scalars(yaml, loader, node, shown: str) -> None:
    """Only the plain types, each value valid for its tag (an explicit `!!int abc` would raise inside the
    constructor); timestamps, binary and sets are refused where they are not quoted."""
    stack = [node] if node is not None else []
    while stack:
        node = stack.pop()
        mark = node.start_mark
        if node.tag not in _PLAIN_TAGS:
            name = node.tag.rsplit(":", 1)[-1]
            raise CardValidationError.at(shown, mark.line + 1, mark.column + 1, "",
                                         f"YAML type {name!r} is not allowed",
                                         "use text, numbers, booleans, lists and mappings (quote dates)")
        if isinstance(node, yaml.ScalarNode):
            implicit = loader.resolve(yaml.ScalarNode, node.value, (True, False))
            as_float = node.tag.endswith(":float") and implicit.endswith(":int")  # !!float 1 is 1.0
            if node.tag != "tag:yaml.org,2002:str" and implicit != node.tag and not as_float:
                raise CardValidationError.at(shown, mark.line + 1, mark.column + 1, "",
                                             f"{node.value[:40]!r} is not a valid {node.tag.rsplit(':', 1)[-1]}",
                                             "correct the value or drop the tag")
            if node.tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") and len(node.value) > 400:
                raise CardValidationError.at(shown, mark.line + 1, mark.column + 1, "",
                                             f"a number written with {len(node.value)} characters",
                                             "use a smaller number")
        elif isinstance(node, yaml.MappingNode):
            stack += [part for pair in node.value for part in pair]
        else:
            stack += node.value


def _walk_yaml(node, path: FieldPath, source: Source, duplicates: list[Problem]) -> None:
    import yaml

    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            sub = path + (str(key_node.value),)  # a merge key (`<<`) never gets here: _check_scalars refused it
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


def peek_id(file: Path) -> str | None:
    """The `id` a manifest declares (None if it declares none, or not as text), read for finding a card by id: from
    a YAML file's event stream up to its top-level `id` key — a few events of a card that opens with its id — or a
    TOML file's plain parse, rather than the full read; the full read (read_source) for anything unusual (aliases,
    complex keys, large, unreadable or unparsable files), which raises its located error."""
    import yaml

    try:
        if 0 < file.stat().st_size <= MAX_BYTES:
            text = file.read_text(encoding="utf-8")
            if file.suffix == ".yaml":
                return _peek_yaml_id(text)
            # the id, also where the full read refuses a value elsewhere (a datetime, inf), as in YAML's event stream
            card_id = _toml().loads(text.removeprefix("\ufeff")).get("id")
            return card_id if isinstance(card_id, str) else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, yaml.YAMLError, _Unsure):
        pass  # TOML's decode error is a ValueError
    card_id = read_source(file).data.get("id")
    return card_id if isinstance(card_id, str) else None


class _Unsure(Exception):
    """The event stream holds something only the full read judges."""


def _peek_yaml_id(text: str) -> str | None:
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth, key = 0, None  # depth 1: the top-level mapping; key: the top-level key whose value comes next
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.AliasEvent):
            raise _Unsure
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if depth == 0 and not isinstance(event, yaml.MappingStartEvent):
                return None
            if depth == 1 and key is None:
                raise _Unsure  # a complex key
            depth += 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
            if depth == 1:
                key = None  # a nested value ended: the next event is a top-level key
            elif depth == 0:
                return None
        elif isinstance(event, yaml.ScalarEvent) and depth == 1:
            if key is None:
                key = event.value
                continue
            if key == "id":
                plain = event.implicit[0] and event.tag is None
                tag = loader.resolve(loader, yaml.ScalarNode, event.value, (True, False)) if plain else event.tag
                return event.value if tag in (None, "!", "tag:yaml.org,2002:str") else None
            key = None
        elif isinstance(event, yaml.ScalarEvent) and depth == 0:
            return None
    return None


# --- TOML --------------------------------------------------------------------------------------------

_KEY_PART = r'[A-Za-z0-9_-]+|"[^"\n]*"|\'[^\'\n]*\''
_DOTTED = rf"(?:{_KEY_PART})(?:\s*\.\s*(?:{_KEY_PART}))*"
_HEADER = re.compile(rf"^\s*(\[\[?)\s*({_DOTTED})\s*\]\]?")
_ASSIGN = re.compile(rf"^\s*({_DOTTED})\s*=\s*")
_INLINE_KEY = re.compile(rf"[{{,]\s*({_DOTTED})\s*=\s*")
_TOML_AT = re.compile(r"at line (\d+), column (\d+)")


def _split_key(dotted: str) -> FieldPath:
    return tuple(p.strip("\"'") for p in re.findall(_KEY_PART, dotted))


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib


def _read_toml(file: Path, text: str) -> Source:
    tomllib = _toml()
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        at = _TOML_AT.search(str(e))
        line, col = (int(at.group(1)), int(at.group(2))) if at else (1, 1)
        message = _TOML_AT.sub("", str(e)).strip(" ()")
        raise CardValidationError.at(display_path(file), line, col, "", f"TOML: {message}",
                                     "fix the TOML syntax at this position")
    except (RecursionError, ValueError) as e:  # nesting beyond the parser's recursion; an int beyond int()'s limit
        message = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:200]
        raise CardValidationError.at(display_path(file), 1, 1, "", f"TOML: {message}", "fix the TOML value")
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
            depths = _brace_depths(rest)
            for inner in _INLINE_KEY.finditer(rest):
                if depths[inner.start()] != 1:
                    continue
                sub = path + _split_key(inner.group(1))
                source.keys.setdefault(sub, (lineno, assign.end() + inner.start(1) + 1))
                source.values.setdefault(sub, (lineno, assign.end() + inner.end() + 1))


def _brace_depths(text: str) -> list[int]:
    """The `{}` nesting depth after each character, in one pass (the key scan must stay linear in the line)."""
    depths, depth = [], 0
    for char in text:
        depth += (char == "{") - (char == "}")
        depths.append(depth)
    return depths
