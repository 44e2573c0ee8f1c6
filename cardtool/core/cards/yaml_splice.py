"""Writing `recipe.metrics` into a YAML manifest's text in place: the rest of the file — its comments, its flow-style
mappings, its order and spacing, what a person wrote by hand — stays as it was, byte for byte."""

from __future__ import annotations

import yaml

__all__ = ["with_metrics"]


def with_metrics(text: str, metrics: dict) -> str | None:
    """`text` with its recipe's `metrics:` block replaced by `metrics` (added at the end of the recipe where it has
    none, or a `recipe:` at the end of the file where there is none); None where the layout is not one this edits
    (a flow-style recipe, tabs, several documents …) or the result would not read back as the same data with the
    metrics replaced — the caller then writes the whole manifest out."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    if not isinstance(root, yaml.MappingNode) or root.flow_style or not isinstance(data, dict):
        return None
    recipe = _entry(root, "recipe")
    if recipe is None:
        spliced = text + ("" if text.endswith("\n") or not text else "\n") + "recipe:\n" + _block(metrics, 2) + "\n"
    elif not isinstance(recipe[1], yaml.MappingNode) or recipe[1].flow_style or not recipe[1].value:
        return None
    else:
        column = recipe[1].value[0][0].start_mark.column
        entry = _entry(recipe[1], "metrics")
        if entry is None:  # a new last entry of the recipe, on the line after its last value
            end = _line_end(text, _last_index(recipe[1]))
            spliced = text[:end] + "\n" + _block(metrics, column) + text[end:]
        else:  # from the key to the end of its value's last line (a comment after it on that line goes with it)
            start, end = entry[0].start_mark.index, _line_end(text, _last_index(entry[1]))
            spliced = text[:start] + _block(metrics, column)[column:] + text[end:]
    expected = {**data, "recipe": {**(data.get("recipe") or {}), "metrics": metrics}}
    try:
        return spliced if yaml.safe_load(spliced) == expected else None
    except yaml.YAMLError:
        return None


def _entry(mapping: yaml.MappingNode, key: str) -> tuple | None:
    return next(((k, v) for k, v in mapping.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)


def _last_index(node) -> int:
    """Where the last character written for `node` ends: its last leaf's end (a block collection's own end mark is
    the next token's start, past any comment or blank line between)."""
    while isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and not node.flow_style and node.value:
        last = node.value[-1]
        node = last[1] if isinstance(node, yaml.MappingNode) else last
    return node.end_mark.index


def _line_end(text: str, index: int) -> int:
    """The end of the line holding the character before `index` (a block scalar ends after its newline: that one)."""
    if index > 0 and text[index - 1] == "\n":
        return index - 1
    newline = text.find("\n", index)
    return len(text) if newline < 0 else newline


def _block(metrics: dict, column: int) -> str:
    """`metrics:` and its mapping in block style, each line indented by `column`, without a final newline."""
    dumped = yaml.safe_dump({"metrics": metrics}, sort_keys=False, allow_unicode=True, width=110)
    return "\n".join(" " * column + line for line in dumped.rstrip("\n").split("\n"))
