"""`extends` derives cards; TOML and YAML manifests mean the same thing; cycles are refused."""

from __future__ import annotations

import shutil

import pytest
import yaml
from helpers import write_card

from cardtool.core.cards.loader import load_card, merge_extends
from cardtool.core.cards.source import read_source
from cardtool.errors import CardValidationError


def test_merge_semantics_mappings_merge_null_removes_lists_replace():
    base = {"a": {"x": 1, "y": 2}, "b": [1, 2, 3], "c": "keep"}
    assert merge_extends(base, {"a": {"y": 3, "x": None}, "b": [9]}) == {"a": {"y": 3}, "b": [9], "c": "keep"}
    assert base == {"a": {"x": 1, "y": 2}, "b": [1, 2, 3], "c": "keep"}, "the base must not be modified"


def test_derived_card_replaces_transformer_and_recipe_and_inherits_the_rest(examples):
    base, rl, distilled = (load_card(examples / n) for n in ("tiny-base", "tiny-rl", "tiny-distilled"))
    assert rl.manifest.components["transformer"].weights == "transformer.safetensors"
    assert rl.manifest.components["transformer"].sha256 != base.manifest.components["transformer"].sha256
    assert rl.manifest.components["transformer"].config == base.manifest.components["transformer"].config
    assert rl.manifest.components["vae"].weights == "../tiny-base/vae.safetensors"
    assert rl.weights_file("vae").resolve() == (examples / "tiny-base" / "vae.safetensors").resolve()
    assert rl.manifest.recipe.method == "diffusion_nft" and rl.manifest.recipe.parents == ["tiny-base"]
    assert rl.manifest.loops == base.manifest.loops
    # two levels down: a grandparent's file still resolves, a loop default is overridden key by key
    assert distilled.weights_file("vae").resolve() == (examples / "tiny-base" / "vae.safetensors").resolve()
    assert distilled.manifest.loops["denoise"].defaults == {"steps": 4, "guidance": 1.0, "shift": 1.0,
                                                            "solver": "euler"}
    assert distilled.manifest.adapters == {}, "null removes the inherited adapter"
    assert distilled.manifest.recipe.assumes.steps == 4


def test_recipe_is_never_inherited(examples):
    text = (examples / "tiny-rl" / "card.toml").read_text()
    (examples / "tiny-rl" / "card.toml").write_text(text[: text.index("[recipe]")])
    with pytest.raises(CardValidationError) as info:
        load_card(examples / "tiny-rl")
    [problem] = info.value.problems
    assert problem.field == "recipe" and "recipe is never inherited" in problem.fix
    # in the card that lacks it, not at the parent's own recipe (which is no inherited one)
    assert (problem.file, problem.line, problem.column) == ("examples/tiny-rl/card.toml", 1, 1)


def test_toml_and_yaml_manifests_are_the_same_card(examples, tmp_path):
    data = yaml.safe_load((examples / "tiny-base" / "card.yaml").read_text())
    toml_text = _to_toml(data)
    twin = tmp_path / "twin"
    shutil.copytree(examples / "tiny-base", twin)
    (twin / "card.yaml").unlink()
    (twin / "card.toml").write_text(toml_text)
    assert load_card(twin, checksums=True).manifest == load_card(examples / "tiny-base").manifest


def test_a_byte_order_mark_is_no_content_in_toml_or_yaml(examples, tmp_path):
    original = (examples / "tiny-base" / "card.yaml").read_text()
    for name, text in (("card.toml", _to_toml(yaml.safe_load(original))), ("card.yaml", original)):
        twin = tmp_path / name
        shutil.copytree(examples / "tiny-base", twin)
        (twin / "card.yaml").unlink()
        (twin / name).write_bytes(b"\xef\xbb\xbf" + text.encode())  # as Windows editors save UTF-8
        assert load_card(twin).manifest == load_card(examples / "tiny-base").manifest
    broken = write_card(tmp_path / "t", '\ufeffschema = "cardtool/v1"\nid = \n', name="card.toml")
    with pytest.raises(CardValidationError) as info:
        load_card(broken)
    assert str(info.value).startswith("t/card.toml:2:6: TOML: "), "columns count what an editor shows"


def test_toml_errors_are_located_too(tmp_path):
    folder = write_card(tmp_path / "t", """
        schema = "cardtool/v1"
        id = "t"

        [components.vae]
        kind = "vae"
        impl = "conv-vae"
        weigths = "vae.safetensors"

        [recipe]
        method = "pretrain"
        assumes = { loop = "denoise", steps = 0 }

        [[recipe.ancestors]]
        id = "a"
        method = "pretrain"

        [[recipe.ancestors]]
        id = "b"
        method = "nonsense"
        """, name="card.toml")
    with pytest.raises(CardValidationError) as info:
        load_card(folder)
    assert [str(p).split(" (fix")[0].split(": Input should be '")[0] for p in info.value.problems] == [
        "t/card.toml:7:1: components.vae.weigths: unknown key",
        "t/card.toml:11:39: recipe.assumes.steps: Input should be greater than or equal to 1, got 0",
        "t/card.toml:19:10: recipe.ancestors.1.method"]  # the second table of the array


def test_toml_locations_skip_multiline_strings_and_find_keys_after_a_nested_inline_table(tmp_path):
    """tomllib keeps no positions: the line scan must not read a multi-line string's lines as keys, nor lose the
    keys of an inline table that follow a nested one."""
    folder = write_card(tmp_path / "t", """
        schema = "cardtool/v1"
        id = "t"
        description = \"\"\"looks like TOML,
        from its second line:
        [recipe.assumes]
        steps = 5
        \"\"\"

        [components.vae]
        kind = "vae"
        impl = "conv-vae"

        [recipe]
        method = "pretrain"
        assumes = { loop = "denoise", precision = { x = 1 }, steps = 0 }
        """, name="card.toml")
    with pytest.raises(CardValidationError) as info:
        load_card(folder)
    located = {str(p).split(": ")[1]: str(p).split(": ")[0] for p in info.value.problems}
    assert located["recipe.assumes.steps"] == "t/card.toml:15:62", located
    assert located["recipe.assumes.precision"] == "t/card.toml:15:43", located


def test_toml_locations_of_arrays_of_tables_and_of_keys_after_a_one_line_multiline_string(tmp_path):
    """Each [[table]] of an array is located at its own header, the array at its first; a string opened and closed
    with \"\"\" on one line leaves the next lines' keys to the scan."""
    (tmp_path / "card.toml").write_text('a = """one line"""\nb = 1\n\n[[c]]\nd = 1\n\n[[c]]\nd = 2\n')
    source = read_source(tmp_path / "card.toml")
    assert source.data == {"a": "one line", "b": 1, "c": [{"d": 1}, {"d": 2}]}
    assert source.mark(("b",), key=True) == (2, 1) and source.mark(("b",)) == (2, 5)
    assert source.mark(("c",), key=True) == (4, 3)
    assert [source.mark(("c", str(i))) for i in (0, 1)] == [(4, 3), (7, 3)]
    assert [source.mark(("c", str(i), "d")) for i in (0, 1)] == [(5, 5), (8, 5)]


def test_toml_syntax_error_is_located(tmp_path):
    folder = write_card(tmp_path / "t", 'schema = "cardtool/v1"\nid = \n', name="card.toml")
    with pytest.raises(CardValidationError) as info:
        load_card(folder)
    assert str(info.value).startswith("t/card.toml:2:6: TOML: ")


def test_extends_cycle_is_refused(examples):
    base = examples / "tiny-base" / "card.yaml"
    base.write_text(base.read_text().replace("id: tiny-base\n", "id: tiny-base\nextends: tiny-distilled\n"))
    with pytest.raises(CardValidationError) as info:
        load_card(examples / "tiny-base")
    last = str(info.value.problems[-1])
    assert last.startswith("examples/tiny-rl/card.toml:6:11: extends: extends forms a cycle: examples/tiny-base → "
                           "examples/tiny-distilled → examples/tiny-rl → examples/tiny-base"), last


def test_a_chain_of_extends_is_at_most_32_cards_deep_and_a_long_one_is_a_problem_not_a_crash(examples):
    """600 cards each extending the one before: Python's recursion gave out past about 480 (a RecursionError
    traceback); the chain now stops at 32 with a located problem."""
    for i in range(1, 600):
        folder = examples / f"c{i}"
        folder.mkdir()
        parent = "../tiny-base" if i == 1 else f"../c{i - 1}"
        (folder / "card.yaml").write_text(f"schema: cardtool/v1\nid: c{i}\nextends: {parent}\n"
                                          "recipe: {method: finetune, parents: [tiny-base]}\n")
    assert load_card(examples / "c32").id == "c32"  # tiny-base ← c1 ← … ← c32: 32 extends
    for deepest in ("c33", "c599"):
        with pytest.raises(CardValidationError) as info:
            load_card(examples / deepest)
        assert "extends goes more than 32 cards deep" in str(info.value.problems[-1]), info.value.problems[-1]
        # this card's line and the cause, not one line for each of the 32 cards between them
        parent = f"../c{int(deepest[1:]) - 1}"
        assert [p.message for p in info.value.problems[:-1]] == [f"extends '{parent}', which is invalid"]


def test_extends_an_unknown_card(examples):
    rl = examples / "tiny-rl" / "card.toml"
    rl.write_text(rl.read_text().replace('extends = "tiny-base"', 'extends = "no-such-card"'))
    with pytest.raises(CardValidationError) as info:
        load_card(examples / "tiny-rl")
    [problem] = info.value.problems
    assert (problem.file, problem.line, problem.field) == ("examples/tiny-rl/card.toml", 6, "extends")
    assert "cannot find the card it extends: no card with id 'no-such-card'" in problem.message


def test_extends_takes_a_path_relative_to_the_card_or_absolute_wherever_it_is_loaded_from(examples, tmp_path,
                                                                                        monkeypatch):
    """A value with a slash is a folder (relative to the card's own); one without, an id searched beside it."""
    shutil.move(examples / "tiny-base", examples / "tiny-rl" / "tiny-base")
    monkeypatch.chdir(tmp_path)
    rl = examples / "tiny-rl" / "card.toml"
    text = rl.read_text()
    for parent in ("tiny-base/", str(examples / "tiny-rl" / "tiny-base"), "./tiny-base"):
        rl.write_text(text.replace('extends = "tiny-base"', f'extends = "{parent}"'))
        vae = load_card(examples / "tiny-rl").weights_file("vae")
        assert vae == (examples / "tiny-rl" / "tiny-base" / "vae.safetensors").resolve(), parent
    rl.write_text(text)
    with pytest.raises(CardValidationError, match="no card with id 'tiny-base'"):
        load_card(rl.parent)


def test_problem_in_the_parent_is_reported_in_the_parent_file(examples):
    base = examples / "tiny-base" / "card.yaml"
    base.write_text(base.read_text().replace("impl: conv-vae", "impl: conv-vae\n    colour: red"))
    with pytest.raises(CardValidationError) as info:
        load_card(examples / "tiny-rl")
    files = [p.file for p in info.value.problems]
    assert files == ["examples/tiny-rl/card.toml", "examples/tiny-base/card.yaml"]
    assert info.value.problems[1].field == "components.vae.colour"


def test_a_problem_the_child_makes_of_a_field_the_parent_declares_is_located_in_the_parent(examples):
    """The child removes the text encoder its parent's loop uses: the loop's `uses` list, written in the parent's file,
    is where the problem is (the parent alone is valid, so only the merged card shows it)."""
    child = examples / "child"
    child.mkdir()
    (child / "card.yaml").write_text("schema: cardtool/v1\nid: child\nextends: tiny-base\ncomponents:\n"
                                     "  text_encoder: null\nrecipe: {method: finetune, parents: [tiny-base]}\n")
    with pytest.raises(CardValidationError) as info:
        load_card(child)
    [problem] = info.value.problems
    assert (problem.file, problem.field) == ("examples/tiny-base/card.yaml", "loops.denoise.uses.0")
    line = (examples / "tiny-base" / "card.yaml").read_text().splitlines()[problem.line - 1]
    assert "uses: [text_encoder" in line and problem.column == line.index("text_encoder") + 1


def _to_toml(data: dict) -> str:
    """A small TOML writer for the test: nested tables as [a.b] headers, leaves as TOML values."""
    import json

    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(v)

    lines, tables = [], []

    def walk(prefix, mapping):
        leaves = {k: v for k, v in mapping.items() if not isinstance(v, dict) or k in ("config", "defaults", "data",
                                                                                      "assumes")}
        if prefix:
            tables.append(f"\n[{prefix}]")
        for k, v in leaves.items():
            (tables if prefix else lines).append(f"{k} = {value(v)}")
        for k, v in mapping.items():
            if k not in leaves:
                walk(f"{prefix}.{k}" if prefix else k, v)

    walk("", data)
    return "\n".join(lines + tables) + "\n"
