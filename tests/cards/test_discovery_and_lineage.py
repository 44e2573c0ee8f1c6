"""Cards are found by path or id in the documented order; lineage walks parents to the roots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import EXAMPLE_CARDS, TINY_DIT, write_card

from cardtool.core.cards import discovery
from cardtool.core.cards.catalog import list_cards, validate_paths
from cardtool.core.cards.discovery import locate
from cardtool.core.cards.lineage import lineage
from cardtool.core.cards.loader import load_card
from cardtool.errors import AmbiguousCard, BadInput, CardNotFound, CardValidationError

ONE = """
schema: cardtool/v1
id: {id}
description: "{description}"
components:
  transformer: {{kind: dit, impl: wan-dit, weights: dit.safetensors, config: {tiny}}}
recipe:
  method: {method}
  parents: {parents}
"""


def make(root, folder, id, description="", method="pretrain", parents="[]"):
    manifest = ONE.format(id=id, description=description, method=method, parents=parents,
                          tiny=str(TINY_DIT).replace("'", ""))
    return write_card(root / folder, manifest, weights=("dit.safetensors",), kinds={"dit.safetensors": "dit"})


@pytest.fixture
def builtin(tmp_path, monkeypatch):
    folder = tmp_path / "builtin"
    folder.mkdir()
    monkeypatch.setattr(discovery, "builtin_dir", lambda: folder)
    return folder


def test_search_order_is_path_then_cwd_cards_then_cardtool_path_then_builtin(tmp_path, builtin, monkeypatch):
    make(builtin, "a", "only-builtin")
    make(tmp_path / "extra", "b", "only-on-path")
    make(tmp_path / "cards", "c", "only-in-cwd")
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "extra"))
    assert locate("only-builtin") == builtin / "a" / "card.yaml"
    assert locate("only-on-path") == tmp_path / "extra" / "b" / "card.yaml"
    assert locate("only-in-cwd").resolve() == (tmp_path / "cards" / "c" / "card.yaml").resolve()
    assert [s.origin for s in list_cards()] == ["./cards", "CARDTOOL_PATH", "builtin"]
    # an explicit path wins over any id, even a folder named like a card id
    make(tmp_path, "only-builtin", "explicit")
    assert load_card("only-builtin").id == "explicit"


def test_unusable_search_path_entries_are_searched_as_empty(tmp_path, builtin, monkeypatch):
    make(tmp_path / "extra", "b", "on-path")
    (tmp_path / "a-file").write_text("not a folder")
    unusable = ["", "x" * 5000, str(tmp_path / "missing"), str(tmp_path / "a-file"), "/dev/null"]  # 5000: ENAMETOOLONG
    monkeypatch.setenv("CARDTOOL_PATH", os.pathsep.join([*unusable, str(tmp_path / "extra")]))
    assert locate("on-path") == tmp_path / "extra" / "b" / "card.yaml"
    assert [s.id for s in list_cards()] == ["on-path"]
    with pytest.raises(BadInput) as info:  # a mistyped entry is said to be one where the id is not found
        locate("nope")
    assert "missing (CARDTOOL_PATH: no such folder), a-file (CARDTOOL_PATH: not a folder), /dev/null (CARDTOOL_PATH: " \
           "not a folder), extra (CARDTOOL_PATH)," in str(info.value)


def test_two_cards_with_one_id_is_an_error_naming_both(tmp_path, builtin, monkeypatch):
    make(tmp_path / "cards", "x", "twin")
    make(builtin, "y", "twin")
    with pytest.raises(AmbiguousCard) as info:
        locate("twin")
    assert "card id 'twin' is declared twice: cards/x (./cards) and builtin/y (builtin)" in str(info.value)
    make(tmp_path / "cards", "z", "single")
    listed = {s.path: s for s in list_cards()}  # listed as the lookup finds them: two cards, neither usable by id
    assert [(p.file, p.field, p.message) for p in listed["cards/x"].problems] == [
        ("cards/x/card.yaml", "id", "card id 'twin' is also declared by builtin/y: looking it up finds two cards")]
    assert not listed["builtin/y"].valid and listed["cards/z"].valid
    # validating a folder of cards: siblings sharing an id are invalid (any search of their folder finds both)
    make(tmp_path / "cards", "w", "twin")
    results = {r.path: r for r in validate_paths(["cards"])}
    assert [str(p) for p in results["cards/x"].problems] == [
        "cards/x/card.yaml:2:5: id: card id 'twin' is also declared by cards/w beside it: looking it up finds two "
        "cards (fix: give each card its own id)"]
    assert not results["cards/w"].valid and results["cards/z"].valid
    twice = validate_paths(["cards/x", "cards/x", str(builtin / "y")])
    assert all(r.valid for r in twice), "one folder twice, and a twin that is no sibling"


def test_a_sibling_named_by_id_is_the_cards_own_family_whatever_else_declares_it(tmp_path, builtin, monkeypatch):
    """A family copied into ./cards, and its original on CARDTOOL_PATH: each card's `extends` and parents are its own
    siblings ("declared twice" before, for every card of the original); by id alone the id is still ambiguous."""
    shutil.copytree(EXAMPLE_CARDS, tmp_path / "cards", ignore=shutil.ignore_patterns("*.py"))
    family = shutil.copytree(EXAMPLE_CARDS, tmp_path / "elsewhere", ignore=shutil.ignore_patterns("*.py"))
    monkeypatch.setenv("CARDTOOL_PATH", str(family))
    chain = lineage(load_card(family / "tiny-distilled")).chain()
    assert [(n.id, n.folder) for n in chain] == [(name, family / name)
                                                 for name in ("tiny-base", "tiny-rl", "tiny-distilled")]
    assert validate_paths([str(family / "tiny-distilled")])[0].valid
    with pytest.raises(AmbiguousCard, match="card id 'tiny-rl' is declared twice"):
        locate("tiny-rl")


def test_the_same_folder_reached_twice_is_one_card(tmp_path, builtin, monkeypatch):
    make(tmp_path / "cards", "x", "once")
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "cards"))
    assert locate("once").name == "card.yaml"
    assert len(list_cards()) == 1


def test_a_staging_folder_a_killed_run_left_is_not_a_second_card(tmp_path, builtin, monkeypatch):
    make(tmp_path / "cards", "vae", "vae")
    shutil.copytree(tmp_path / "cards" / "vae", tmp_path / "cards" / ".vae.tmp-4242")  # killed while writing
    shutil.copytree(tmp_path / "cards" / "vae", tmp_path / "cards" / ".vae.old-4243")  # killed while swapping
    assert locate("vae").parent.name == "vae", "not 'declared twice'"
    assert [c.id for c in list_cards()] == ["vae"]


def test_unknown_id_lists_what_was_searched(builtin):
    with pytest.raises(CardNotFound) as info:
        locate("nope")
    assert "no card with id 'nope'; searched cards (./cards)" in str(info.value)
    assert "(builtin)" in str(info.value) and "did you mean" not in str(info.value)
    make(builtin, "a", "fashion-base")
    with pytest.raises(CardNotFound, match="did you mean 'fashion-base'"):  # a typo of a card that is there
        locate("fashion-bsae")


def test_a_card_with_bad_values_is_found_by_its_id_and_an_unreadable_one_is_named(tmp_path, builtin):
    """A TOML card holding a value manifests refuse (a datetime, inf) is found by its id, as a YAML one is, so its
    own problems are what the user sees — not "no card with id"; a manifest whose id cannot be read at all is named
    in the "no card" error, since the card asked for may be it."""
    make(tmp_path / "cards", "tb", "tb")
    text = (tmp_path / "cards" / "tb" / "card.yaml").read_text()
    (tmp_path / "cards" / "tb" / "card.yaml").unlink()
    toml = 'schema = "cardtool/v1"\nid = "tb"\ndescription = 2020-01-01 12:00:00\nguidance = inf\n'
    (tmp_path / "cards" / "tb" / "card.toml").write_text(toml)
    assert locate("tb") == tmp_path / "cards" / "tb" / "card.toml"
    (tmp_path / "cards" / "elsewhere").mkdir()  # found by the id it declares, not by its folder's name
    (tmp_path / "cards" / "elsewhere" / "card.toml").write_text(toml.replace('id = "tb"', 'id = "tc"'))
    assert locate("tc") == tmp_path / "cards" / "elsewhere" / "card.toml"
    (tmp_path / "cards" / "elsewhere" / "card.toml").write_text(toml.replace('id = "tb"', "id = 5"))
    with pytest.raises(CardNotFound):
        locate("5")
    with pytest.raises(CardValidationError, match="description: a datetime value"):
        load_card("tb")
    (tmp_path / "cards" / "tb" / "card.toml").unlink()
    (tmp_path / "cards" / "tb" / "card.yaml").write_text(text.replace("id: tb", "id: [tb"))
    with pytest.raises(CardNotFound, match=r"1 card folder there could not be read \(cards/tb; `cardtool cards "
                                           r"validate FOLDER` says why\)"):
        locate("tb")


def test_path_like_names_that_do_not_exist_are_bad_input(tmp_path, builtin):
    with pytest.raises(BadInput, match="no such card folder"):
        locate("./missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadInput, match="is not a card folder"):
        locate("./empty")
    with pytest.raises(CardNotFound, match=r"no card with id 'empty'; .*\(\./empty is a folder, not a card: it holds "
                                           r"no card.yaml or card.toml\.\)"):
        locate("empty")
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    for name, kind in (("pipe", "a pipe"), ("dangling", "a link to nothing")):
        with pytest.raises(CardNotFound, match=rf"no card with id '{name}'; .*\(\./{name} is {kind}, not a card\.\)"):
            locate(name)


def test_an_id_that_also_names_a_folder_here_that_is_no_card_finds_the_card(tmp_path, builtin):
    """`generate fashion-base --out fashion-base`, run twice: the second run read its own output folder as the
    card it was asked for ("fashion-base is not a card folder")."""
    make(builtin, "a", "base")
    (tmp_path / "base").mkdir()  # cwd is tmp_path
    assert locate("base") == builtin / "a" / "card.yaml"


def test_list_reports_invalid_cards_without_failing(tmp_path, builtin):
    make(tmp_path / "cards", "good", "good")
    write_card(tmp_path / "cards" / "bad", "id: [unclosed\n")
    summaries = {s.path: s for s in list_cards()}
    assert summaries["cards/good"].valid and summaries["cards/good"].method == "pretrain"
    assert not summaries["cards/bad"].valid and summaries["cards/bad"].problems[0].line == 2


def test_a_manifest_name_held_by_a_folder_pipe_or_dead_link_is_an_invalid_card(tmp_path, builtin):
    """Such a folder read as no card at all: `cards list` left it out, its id was "not found" and `cards validate`
    said it held no card.yaml — now each says what stands there."""
    kinds = {"dir": (Path.mkdir, "a folder"), "pipe": (os.mkfifo, "a pipe"),
             "dead": (lambda path: path.symlink_to("nowhere"), "a link to nothing")}
    for name, (make_it, _) in kinds.items():
        (tmp_path / "cards" / name).mkdir(parents=True)
        make_it(tmp_path / "cards" / name / "card.yaml")
    summaries = {s.path: s for s in list_cards()}
    results = {r.path: r for r in validate_paths([f"cards/{name}" for name in kinds])}
    for name, (_, kind) in kinds.items():
        expected = f"cards/{name}/card.yaml is not a file ({kind})"
        assert not summaries[f"cards/{name}"].valid and summaries[f"cards/{name}"].problems[0].message == expected
        assert [p.message for p in results[f"cards/{name}"].problems] == [expected]
    with pytest.raises(CardValidationError, match=r"is not a file \(a pipe\)"):
        load_card(tmp_path / "cards" / "pipe")
    with pytest.raises(CardNotFound, match="3 card folders there could not be read"):
        locate("pipe")


def test_builtin_dir_of_a_checkout_is_the_top_level_cards_folder(monkeypatch):
    monkeypatch.undo()  # the isolation fixture hides the built-in cards; look at the real lookup
    assert discovery.builtin_dir() == EXAMPLE_CARDS.parents[1] / "cards"


def test_builtin_dir_of_an_installed_wheel_is_inside_the_package(tmp_path, monkeypatch):
    """The wheel carries the cards at cardtool/cards (pyproject's force-include); a package with neither is None."""
    monkeypatch.undo()
    package = tmp_path / "site" / "cardtool"
    (package / "core" / "cards").mkdir(parents=True)
    monkeypatch.setattr(discovery, "__file__", str(package / "core" / "cards" / "discovery.py"))
    assert discovery.builtin_dir() is None and discovery.installed_dir() is None
    (package / "cards").mkdir()
    assert discovery.builtin_dir() == discovery.installed_dir() == package / "cards"


def test_lineage_walks_parents_to_the_root(examples):
    root = lineage(load_card(examples / "tiny-distilled"))
    assert [(n.id, n.method) for n in root.chain()] == [("tiny-base", "pretrain"), ("tiny-rl", "diffusion_nft"),
                                                        ("tiny-distilled", "dmd2")]
    assert root.to_json()["parents"][0]["parents"][0] == {"id": "tiny-base", "method": "pretrain",
                                                          "path": "examples/tiny-base", "missing": False,
                                                          "recorded": False, "repeated": False, "parents": []}


def test_lineage_with_two_parents_is_a_tree(tmp_path):
    make(tmp_path / "cards", "a", "a")
    make(tmp_path / "cards", "b", "b", method="lora")
    make(tmp_path / "cards", "m", "merged", method="finetune", parents="[a, b]")
    root = lineage(load_card("merged"))
    assert [p.id for p in root.parents] == ["a", "b"] and root.chain() is None


def test_parents_cycle_is_a_validation_error(tmp_path):
    make(tmp_path / "cards", "a", "a", parents="[b]")
    make(tmp_path / "cards", "b", "b", parents="[a]")
    with pytest.raises(CardValidationError) as info:
        lineage(load_card("a"))
    [problem] = info.value.problems
    assert (problem.file, problem.line, problem.field) == ("cards/b/card.yaml", 8, "recipe.parents.0")
    assert "parents form a cycle: a → b → a" in problem.message
    # a card made from one whose lineage is broken checks against that card itself, not a traceback
    from cardtool.core.cards.lineage import check_new_folder, check_new_id

    check_new_id("c", [load_card("a")], "fix")
    check_new_folder(tmp_path / "cards" / "c", [load_card("a")])
    with pytest.raises(BadInput, match="card id 'a' is its parent's"):
        check_new_id("a", [load_card("a")], "fix")
    with pytest.raises(BadInput, match="is the folder of 'a'"):
        check_new_folder(tmp_path / "cards" / "a", [load_card("a")])


def test_a_new_card_may_not_be_written_over_an_ancestors_folder(tmp_path):
    """Not only the parent's: a grandparent's weights are what the parent was made from (and by id, its lineage)."""
    from cardtool.core.cards.lineage import check_new_folder

    make(tmp_path / "cards", "root", "root")
    make(tmp_path / "cards", "mid", "mid", method="finetune", parents="[root]")
    make(tmp_path / "cards", "leaf", "leaf", method="finetune", parents="[mid]")
    with pytest.raises(BadInput, match="cards/root is the folder of 'root', which the new card is made from"):
        check_new_folder(tmp_path / "cards" / "root", [load_card("leaf")])
    check_new_folder(tmp_path / "cards" / "other", [load_card("leaf")])


def test_missing_parent_is_marked_and_fails_validation(tmp_path):
    make(tmp_path / "cards", "orphan", "orphan", parents="[gone]")
    root = lineage(load_card("orphan"))
    assert root.parents[0].missing and root.parents[0].id == "gone"
    [result] = validate_paths(["cards/orphan"])
    assert not result.valid
    assert str(result.problems[0]).startswith("cards/orphan/card.yaml:8:")
    assert "parent card 'gone' cannot be found" in str(result.problems[0])


def test_validate_a_folder_of_cards_and_bad_paths(tmp_path, monkeypatch):
    shutil.copytree(EXAMPLE_CARDS, tmp_path / "ex")
    results = validate_paths(["ex"], checksums=True)
    assert [(r.id, r.valid) for r in results] == [("tiny-base", True), ("tiny-distilled", True), ("tiny-judge", True),
                                                   ("tiny-rl", True)]
    with pytest.raises(BadInput, match="no card with id 'nowhere'"):
        validate_paths(["nowhere"])
    with pytest.raises(BadInput, match="no such card folder or manifest: ./nowhere"):
        validate_paths(["./nowhere"])
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "ex"))
    assert [(r.id, r.valid) for r in validate_paths(["tiny-rl"])] == [("tiny-rl", True)], "an id, as elsewhere"
    (tmp_path / "void").mkdir()
    with pytest.raises(BadInput, match=r"no card with id 'void'.*\./void is a folder, not a card: it holds no card"):
        validate_paths(["void"])
    with pytest.raises(BadInput, match="void holds no card"):
        validate_paths(["./void"])
    (tmp_path / "tiny-rl").mkdir()  # `generate tiny-rl --out tiny-rl` made it: the id is still the card's
    (tmp_path / "tiny-rl" / "tiny-rl-000.png").write_bytes(b"")
    assert [(r.id, r.valid) for r in validate_paths(["tiny-rl"])] == [("tiny-rl", True)]


def test_peek_id_reads_what_the_full_parse_reads(tmp_path):
    """Finding a card by id reads each manifest only up to its id: the id the full read gives (text, else None)
    for every manifest the full read accepts."""
    from cardtool.core.cards.source import peek_id, read_source

    texts = ["id: a\nx: 1\n", "x: {a: [1, 2]}\nid: b\n", "x:\n  id: inner\nid: outer\n", "id: 12\n", "id: '12'\n",
             "id: !!str 12\n", "id:\n  - x\n", "x: [a, {id: q}]\nid: z\n", "a: 1\n", "id: null\n", "id: yes\n",
             "id: &x a\ny: *x\n", "? [a]\n: b\nid: c\n", "id: |\n  block\n", "x: {id: q}\n", "id: \"é\"\n"]
    for n, text in enumerate(texts):
        file = tmp_path / str(n) / "card.yaml"
        file.parent.mkdir()
        file.write_text(text)
        try:
            full = read_source(file).data.get("id")
        except CardValidationError:
            continue  # aliases, complex keys: refused by the full read, which peek_id falls back to
        assert peek_id(file) == (full if isinstance(full, str) else None), text
    # manifests the full read refuses: not a mapping (no id), a duplicate key (the first id names the card, whose
    # load then reports the duplicate), broken YAML, a complex key or an alias before the id (the full read's located
    # error, not "no card with id c")
    for text, expected in (("- a\n", None), ("just text\n", None), ("id: a\nid: b\n", "a"),
                           ("id: [unclosed\n", CardValidationError), ("? [a]\n: b\nid: c\n", CardValidationError),
                           ("a: &x 1\nb: *x\nid: c\n", CardValidationError)):
        file = tmp_path / "odd" / "card.yaml"
        file.parent.mkdir(exist_ok=True)
        file.write_text(text)
        if expected is CardValidationError:
            with pytest.raises(CardValidationError):
                peek_id(file)
        else:
            assert peek_id(file) == expected, text


def test_a_broken_card_found_by_id_shows_its_own_error(tmp_path, builtin):
    write_card(builtin / "broken", "id: broken\nschema: cardtool/v1\ncomponents: {x: [unclosed\n")
    file = locate("broken")
    assert file == builtin / "broken" / "card.yaml"
    with pytest.raises(CardValidationError) as info:
        load_card(file)
    assert info.value.problems[0].message.startswith("YAML: did not find expected")


def test_an_export_keeps_its_lineage_where_its_parents_are_not(examples, tmp_path):
    """A card shared without its parents (an export) still validates and walks back to its roots: the export records
    the ancestors; a parent on disk is read from disk first."""
    from cardtool.core.cards.export import export_card

    export_card(str(examples / "tiny-distilled"), tmp_path / "shared" / "hf")
    shutil.rmtree(examples)  # the parents are nowhere now
    [result] = validate_paths([str(tmp_path / "shared" / "hf")], checksums=True)
    assert result.valid, result.problems
    chain = lineage(load_card(tmp_path / "shared" / "hf")).chain()
    assert [(n.id, n.method, n.recorded) for n in chain] == [
        ("tiny-base", "pretrain", True), ("tiny-rl", "diffusion_nft", True), ("tiny-distilled", "dmd2", False)]
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "shared" / "tiny-base")  # beside the export
    chain = lineage(load_card(tmp_path / "shared" / "hf")).chain()
    assert [(n.id, n.recorded, n.folder) for n in chain][0] == ("tiny-base", False, tmp_path / "shared" / "tiny-base")


@pytest.mark.parametrize(("ancestors", "message"), [
    ("[{id: up, method: pretrain}, {id: up, method: pretrain}]", "ancestor 'up' is recorded twice"),
    ("[{id: up, method: pretrain, parents: [low]}]", "parents form a cycle: low → up → low"),
    ("[{id: up, method: baking}]", "method"),
])
def test_recorded_ancestors_are_checked(tmp_path, ancestors, message):
    make(tmp_path / "cards", "low", "low", parents="[up]")
    manifest = tmp_path / "cards" / "low" / "card.yaml"
    manifest.write_text(manifest.read_text() + f"  ancestors: {ancestors}\n")
    [result] = validate_paths(["cards/low"])
    assert not result.valid and message in str(result.problems[0]), result.problems
    assert str(result.problems[0]).startswith("cards/low/card.yaml:")


def test_a_diamond_of_parents_is_walked_once_per_card(tmp_path):
    """Cards whose parents are both cards of the level below (a ladder of diamonds) have 2^levels paths to the root:
    the walk, the JSON and the check for missing parents visit each card once."""
    levels = 24
    for i in range(levels):
        for side in "ab":
            make(tmp_path / "cards", f"{side}{i}", f"{side}{i}", parents=f"[a{i - 1}, b{i - 1}]" if i else "[]")
    root = lineage(load_card("a23"))
    assert len(root.nodes()) == 2 * levels - 1 and root.chain() is None  # b23 is not above a23
    document = root.to_json()
    assert document["parents"][1]["parents"][0] == {"id": "a21", "method": "pretrain", "path": "cards/a21",
                                                    "missing": False, "recorded": False, "repeated": True,
                                                    "parents": []}
    [result] = validate_paths(["cards/a23"])
    assert result.valid
    from typer.testing import CliRunner

    from cardtool.cli import app

    wide = {"COLUMNS": "1000"}  # each card once, then "(above)"
    tree = CliRunner().invoke(app, ["cards", "lineage", "a23"], env=wide).stdout
    assert tree.count("(pretrain)") == 2 * levels - 1 and tree.count("(above)") == 2 * (levels - 2), tree


@pytest.mark.parametrize(("ancestors", "message"), [
    ([{"id": f"up{i}", "method": "pretrain", "parents": [f"up{i + 1}"]} for i in range(200)],
     "the lineage is deeper than 128 cards"),
    ([{"id": f"up{i}", "method": "pretrain"} for i in range(300)], "at most 256"),
])
def test_a_forged_record_of_ancestors_is_bounded(tmp_path, ancestors, message):
    import yaml

    make(tmp_path / "cards", "low", "low", parents="[up0]")
    manifest = tmp_path / "cards" / "low" / "card.yaml"
    manifest.write_text(manifest.read_text() + "  ancestors: " + yaml.safe_dump(ancestors, default_flow_style=True))
    [result] = validate_paths(["cards/low"])
    assert not result.valid and message in str(result.problems[0]), result.problems


@pytest.mark.parametrize(("recorded", "valid"), [(127, True), (128, False)])
def test_a_lineage_of_128_cards_is_the_deepest_walked(tmp_path, recorded, valid):
    """The card itself and 127 recorded ancestors make 128 cards; one more is deeper than MAX_DEPTH."""
    import yaml

    ancestors = [{"id": f"up{i}", "method": "pretrain", "parents": [f"up{i + 1}"] if i < recorded - 1 else []}
                 for i in range(recorded)]
    make(tmp_path / "cards", "low", "low", parents="[up0]")
    manifest = tmp_path / "cards" / "low" / "card.yaml"
    manifest.write_text(manifest.read_text() + "  ancestors: " + yaml.safe_dump(ancestors, default_flow_style=True))
    [result] = validate_paths(["cards/low"])
    assert result.valid is valid, result.problems
    assert valid or "the lineage is deeper than 128 cards" in str(result.problems[0])


def test_a_card_names_at_most_256_parents(tmp_path):
    """Each parent is looked up on every validation: 20,000 took 75 s to report as missing."""
    make(tmp_path / "cards", "many", "many", parents="[" + ", ".join(f"p{i}" for i in range(300)) + "]")
    [result] = validate_paths(["cards/many"])
    assert not result.valid and result.problems[0].field == "recipe.parents"
    assert "at most 256" in result.problems[0].message


def test_a_parent_id_two_cards_declare_is_a_problem_located_at_the_parent(tmp_path, builtin):
    make(tmp_path / "cards", "x", "twin")
    make(builtin, "y", "twin")
    child = make(tmp_path / "elsewhere", "c", "child", method="finetune", parents="[single, twin]")
    make(tmp_path / "elsewhere", "s", "single")
    with pytest.raises(CardValidationError) as info:
        lineage(load_card(child))
    [problem] = info.value.problems
    assert (problem.field, problem.line) == ("recipe.parents.1", 8)
    assert "card id 'twin' is declared twice: cards/x (./cards) and builtin/y (builtin)" in problem.message


def test_listing_or_validating_many_cards_that_extend_one_reads_each_manifest_header_a_bounded_number_of_times(
        tmp_path, monkeypatch):
    """Each card's `extends` is found by id: a fresh scan of every root per card read N² headers (300 cards
    extending one base took a minute to list)."""
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "family" / "tiny-base")
    for i in range(40):
        folder = tmp_path / "family" / f"c{i:02d}"
        folder.mkdir()
        (folder / "card.yaml").write_text(f"schema: cardtool/v1\nid: c{i:02d}\nextends: tiny-base\n"
                                          "recipe: {method: import, parents: [tiny-base]}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "family"))
    peeks = []
    monkeypatch.setattr(discovery, "peek_id", lambda file: peeks.append(file) or discovery.read_source(file).data["id"])
    listed = list_cards()
    assert sum(s.valid for s in listed if s.id.startswith("c")) == 40 and len(peeks) <= 3 * 41, len(peeks)
    peeks.clear()
    results = validate_paths([str(tmp_path / "family")])
    assert len(results) == 41 and all(r.valid for r in results) and len(peeks) <= 3 * 41, len(peeks)
    peeks.clear()
    locate("c00"), locate("c01")  # outside a bulk command every search reads the roots afresh: a new card is found
    assert len(peeks) >= 2 * 41


def test_a_search_inside_scans_once_is_read_once_and_a_card_written_after_the_block_is_found(tmp_path, monkeypatch):
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "family" / "tiny-base")
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "family"))
    with discovery.scans_once():
        assert locate("tiny-base").parent.name == "tiny-base"
        shutil.copytree(EXAMPLE_CARDS / "tiny-judge", tmp_path / "family" / "tiny-judge")
        with discovery.scans_once(), pytest.raises(CardNotFound):  # nested: the same reading
            locate("tiny-judge")
    assert locate("tiny-judge").parent.name == "tiny-judge"


def test_another_threads_search_is_not_answered_from_a_bulk_commands_reading(tmp_path, monkeypatch):
    import threading

    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "family" / "tiny-base")
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "family"))
    found = []
    with discovery.scans_once():
        locate("tiny-base")
        shutil.copytree(EXAMPLE_CARDS / "tiny-judge", tmp_path / "family" / "tiny-judge")  # the thread wrote it
        worker = threading.Thread(target=lambda: found.append(locate("tiny-judge").parent.name))
        worker.start()
        worker.join()
    assert found == ["tiny-judge"]


def test_a_long_lineage_reads_the_search_roots_once(tmp_path, monkeypatch):
    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "family" / "tiny-base")
    for i in range(30):
        folder = tmp_path / "family" / f"c{i:02d}"
        folder.mkdir()
        parent = f"c{i - 1:02d}" if i else "tiny-base"
        (folder / "card.yaml").write_text(f"schema: cardtool/v1\nid: c{i:02d}\nextends: tiny-base\n"
                                          f"recipe: {{method: import, parents: [{parent}]}}\n")
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "family"))
    card = load_card(tmp_path / "family" / "c29")
    peeks = []
    monkeypatch.setattr(discovery, "peek_id", lambda file: peeks.append(file) or discovery.read_source(file).data["id"])
    assert [node.id for node in lineage(card).chain()][:3] == ["tiny-base", "c00", "c01"]
    assert len(peeks) <= 3 * 31, len(peeks)  # a fresh scan per parent read 30 × 31


def _unreadable(folder_name: str, real):
    """`real` (a function of a path first), raising what the OS raises for a folder whose mode denies this user."""
    import errno

    def call(path, *args, **kwargs):
        if folder_name in Path(path).parts:
            raise PermissionError(errno.EACCES, "Permission denied", str(Path(path) / "card.yaml"))
        return real(path, *args, **kwargs)
    return call


def test_a_card_folder_this_user_may_not_read_fails_alone_not_every_search(tmp_path, monkeypatch):
    """Another user's private folder on a team disk on CARDTOOL_PATH ended `cards list`, `cards validate` of the
    folder and every lookup by id (`generate tiny-base`) with "Permission denied"."""
    from cardtool.core.cards import catalog

    for name in ("tiny-base", "private"):
        shutil.copytree(EXAMPLE_CARDS / ("tiny-judge" if name == "private" else name), tmp_path / "team" / name)
    monkeypatch.setenv("CARDTOOL_PATH", str(tmp_path / "team"))
    monkeypatch.setattr(discovery, "manifest_in", _unreadable("private", discovery.manifest_in))
    monkeypatch.setattr(catalog, "load_card", _unreadable("private", catalog.load_card))
    assert locate("tiny-base").parent.name == "tiny-base"
    with pytest.raises(CardNotFound, match=r"1 card folder there could not be read \(.*private"):
        locate("tiny-judge")
    listed = {s.path.rsplit("/", 1)[-1]: s for s in list_cards()}
    assert listed["tiny-base"].valid and "cannot read" in listed["private"].problems[0].message
    results = {r.path.rsplit("/", 1)[-1]: r for r in validate_paths([str(tmp_path / "team")])}
    assert results["tiny-base"].valid and not results["private"].valid
    assert results["private"].problems[0].message.endswith("card.yaml: Permission denied")


def test_without_the_right_to_read_a_folder_the_commands_go_on_with_the_others(tmp_path):
    """The same, for real: root without the capabilities that let it read any file (skipped where setpriv cannot
    drop them)."""
    import subprocess
    import sys

    shutil.copytree(EXAMPLE_CARDS / "tiny-base", tmp_path / "team" / "tiny-base")
    shutil.copytree(EXAMPLE_CARDS / "tiny-judge", tmp_path / "team" / "private")
    (tmp_path / "team" / "private").chmod(0)
    (tmp_path / "closed").mkdir(mode=0)  # a whole root this user may not list
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    try:
        probe = subprocess.run([*drop, "cat", str(tmp_path / "team" / "private" / "card.yaml")], capture_output=True)
    except OSError:
        pytest.skip("no setpriv here")
    if probe.returncode == 0 or b"Permission denied" not in probe.stderr:
        pytest.skip("this process reads the folder anyway (not root with droppable capabilities, or not Linux)")
    env = {**os.environ, "CARDTOOL_PATH": os.pathsep.join([str(tmp_path / "team"), str(tmp_path / "closed")])}
    try:
        listed = subprocess.run([*drop, sys.executable, "-m", "cardtool", "cards", "list", "--json"], env=env,
                                capture_output=True, text=True, cwd=tmp_path)
        checked = subprocess.run([*drop, sys.executable, "-m", "cardtool", "cards", "validate", "team", "--json"],
                                 env=env, capture_output=True, text=True, cwd=tmp_path)
        missing = subprocess.run([*drop, sys.executable, "-m", "cardtool", "cards", "show", "nowhere"], env=env,
                                 capture_output=True, text=True, cwd=tmp_path)
    finally:
        (tmp_path / "team" / "private").chmod(0o755)
        (tmp_path / "closed").chmod(0o755)
    assert missing.returncode == 2 and "closed (CARDTOOL_PATH: cannot be read, Permission denied)" in missing.stderr, \
        missing.stderr
    assert listed.returncode == 0, listed.stderr
    cards = {c["path"]: c for c in __import__("json").loads(listed.stdout)["cards"]}
    assert cards["team/tiny-base"]["valid"] and "Permission denied" in cards["team/private"]["problems"][0]["message"]
    assert checked.returncode == 1 and "Permission denied" in checked.stdout and '"valid": true' in checked.stdout


@pytest.mark.parametrize("long", ["x" * 5000, "{tmp}/" + "y" * 300])
def test_a_name_too_long_for_the_file_system_is_a_bad_input_from_the_api(long, tmp_path):
    """A name the file system refuses outright (a component over 255 bytes): said as such, not an OSError from the
    path check. A NUL byte is no card id found, as a script passing one reads."""
    with pytest.raises(BadInput, match="not a usable card name or path"):
        locate(long.format(tmp=tmp_path))
    with pytest.raises(CardNotFound, match="no card with id 'a\x00b'"):
        locate("a\x00b")


def test_a_path_that_is_there_but_no_file_or_folder_is_said_to_be_what_it_is(tmp_path):
    """A manifest path that is a pipe, a device or a link to nothing was "no such card folder or manifest"."""
    os.mkfifo(tmp_path / "card.yaml")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    for path, what in [(tmp_path / "card.yaml", "a pipe"), ("/dev/null", "a device or socket"),
                       (tmp_path / "gone", "a link to nothing")]:
        with pytest.raises(BadInput, match=f"is {what}, not a card folder or manifest file"):
            locate(str(path))
