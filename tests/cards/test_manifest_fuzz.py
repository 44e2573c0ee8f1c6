"""Mutated manifests and truncated files: the loader raises only cardtool's own validation error."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path

import yaml
from helpers import EXAMPLE_CARDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cardtool.core.cards.loader import load_card
from cardtool.errors import CardValidationError

BASE = yaml.safe_load((EXAMPLE_CARDS / "tiny-base" / "card.yaml").read_text())
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from(["../x", "/etc/passwd", "w.pt", "tiny-base", "a\x00b", "x" * 300]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


@st.composite
def mutated(draw):
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(list(paths(data))))
        parent = data
        for part in where[:-1]:
            parent = parent[part]
        action = draw(st.sampled_from(["delete", "replace", "inject"]))
        if not where:
            continue
        if action == "delete" and isinstance(parent, dict):
            del parent[where[-1]]
        elif action == "replace":
            parent[where[-1]] = draw(junk)
        elif isinstance(parent[where[-1]], dict):
            parent[where[-1]][draw(st.text(min_size=1, max_size=8))] = draw(junk)
    return data


def in_copy(write, card="tiny-base"):
    """Run `write(folder)` on a fresh copy of an example card, then load it with checksums."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(EXAMPLE_CARDS, Path(tmp), dirs_exist_ok=True)
        folder = Path(tmp) / card
        write(folder)
        try:
            return load_card(folder, checksums=True)
        except CardValidationError as e:
            assert e.problems and all(p.line >= 1 and p.column >= 1 for p in e.problems)
            return e


@FUZZ
@given(mutated())
def test_mutated_manifests_raise_only_validation_errors(data):
    in_copy(lambda f: (f / "card.yaml").write_text(yaml.safe_dump(data, allow_unicode=True)))


@FUZZ
@given(st.integers(0, len((EXAMPLE_CARDS / "tiny-base" / "card.yaml").read_bytes()) - 1))
def test_truncated_manifests_raise_only_validation_errors(cut):
    in_copy(lambda f: (f / "card.yaml").write_bytes((f / "card.yaml").read_bytes()[:cut]))


@FUZZ
@given(st.integers(0, len((EXAMPLE_CARDS / "tiny-rl" / "card.toml").read_bytes()) - 1))
def test_truncated_toml_manifests_raise_only_validation_errors(cut):
    in_copy(lambda f: (f / "card.toml").write_bytes((f / "card.toml").read_bytes()[:cut]), card="tiny-rl")


@FUZZ
@given(st.sampled_from(["vae.safetensors", "transformer.safetensors", "adapters/invert.safetensors"]),
       st.floats(0, 0.999))
def test_truncated_weights_are_always_caught(name, fraction):
    def truncate(folder):
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * fraction)])

    assert isinstance(in_copy(truncate), CardValidationError)


@FUZZ
@given(st.binary(max_size=200))
def test_junk_bytes_as_a_manifest_raise_only_validation_errors(blob):
    in_copy(lambda f: (f / "card.yaml").write_bytes(blob))
