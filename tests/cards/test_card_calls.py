"""`cardtool.merge`, `compose`, `extract_lora`, `export` and `import_diffusers`: each call writes the card its
command writes (the same weights and the same recorded command), and arguments of a type the command line could
not give are BadInput naming them before anything is written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from test_compose import adapter_card
from typer.testing import CliRunner

import cardtool
from cardtool.cli import app
from cardtool.core.cards.loader import load_card

torch.set_num_threads(1)


def files(folder: Path) -> dict[str, bytes]:
    """Every file of a card folder, its manifest's recorded command and paths aside."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in (".safetensors", ".json")}


def command(*args: str) -> None:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output


def test_each_call_writes_the_card_its_command_writes(examples, tmp_path):
    base, tuned = str(examples / "tiny-base"), str(examples / "tiny-rl")
    adapter_card(examples, "tiny-base", "tiny-a", "alpha", 1)
    made = {
        "merge": (cardtool.merge([(base, 0.25), (tuned, np.float32(0.75))], card_id="soup",
                                 out=tmp_path / "call-merge").card,
                  ("cards", "merge", f"{base}=0.25", f"{tuned}=0.75", "--id", "soup")),
        "compose": (cardtool.compose(base, examples / "tiny-a", card_id="served", out=tmp_path / "call-compose"),
                    ("cards", "compose", base, str(examples / "tiny-a"), "--id", "served")),
        "extract": (cardtool.extract_lora(base, tuned, rank=np.int64(2), card_id="rl-lora",
                                          out=tmp_path / "call-extract").card,
                    ("cards", "extract-lora", base, tuned, "--rank", "2", "--id", "rl-lora")),
    }
    exported = cardtool.export(tuned, tmp_path / "call-export")
    command("cards", "export", tuned, "--out", str(tmp_path / "cli-export"))
    made["import"] = (cardtool.import_diffusers(tmp_path / "call-export", base=base, card_id="back",
                                                out=tmp_path / "call-import"),
                      ("cards", "import", str(tmp_path / "call-export"), "--base", base, "--id", "back"))
    for name, (card, args) in made.items():
        command(*args, "--out", str(tmp_path / f"cli-{name}"))
        typed = load_card(tmp_path / f"cli-{name}")
        assert card.manifest.recipe.command == typed.manifest.recipe.command == shlex.join(["cardtool", *args]), name
        assert files(card.folder) == files(typed.folder) and files(card.folder), name
    assert exported.folder == tmp_path / "call-export"
    assert files(tmp_path / "call-export") == files(tmp_path / "cli-export")
    weights = (load_card(tmp_path / "call-merge").weights_file("transformer"),
               *(load_card(examples / c).weights_file("transformer") for c in ("tiny-base", "tiny-rl")))
    from safetensors.numpy import load_file

    soup, a, b = (load_file(str(w)) for w in weights)
    assert np.allclose(soup["blocks.0.attn1.to_q.weight"],
                       0.25 * a["blocks.0.attn1.to_q.weight"] + 0.75 * b["blocks.0.attn1.to_q.weight"], atol=1e-6)


@pytest.mark.parametrize(("call", "message"), [
    (lambda b, t, o: cardtool.merge("tiny-base", card_id="soup", out=o), "cards must be a list"),
    (lambda b, t, o: cardtool.merge([b, 3], card_id="soup", out=o), "cards must be a card id or path, got 3"),
    (lambda b, t, o: cardtool.merge([(b, "0.5"), t], card_id="soup", out=o), r"a \(card, weight\) pair, got"),
    (lambda b, t, o: cardtool.merge([(b, True), t], card_id="soup", out=o), r"a \(card, weight\) pair, got"),
    (lambda b, t, o: cardtool.merge([(b, 0.5, 1), t], card_id="soup", out=o), r"a \(card, weight\) pair, got"),
    (lambda b, t, o: cardtool.merge([b, t], card_id=7, out=o), "card_id must be the new card's id"),
    (lambda b, t, o: cardtool.merge([b, t], card_id="soup", out=o, overwrite="yes"), "overwrite must be True or"),
    (lambda b, t, o: cardtool.merge([b, t], card_id="soup", out=3), "out must be a path"),
    (lambda b, t, o: cardtool.merge([b, "a\0"], card_id="soup", out=o), "cards holds a NUL byte"),
    (lambda b, t, o: cardtool.compose(b, 3, card_id="s", out=o), "adapter_cards must be a list"),
    (lambda b, t, o: cardtool.compose(None, [t], card_id="s", out=o), "base must be a card id or path"),
    (lambda b, t, o: cardtool.extract_lora(b, t, rank=2.0, card_id="x", out=o), "rank must be a whole number"),
    (lambda b, t, o: cardtool.extract_lora(b, t, rank=True, card_id="x", out=o), "rank must be a whole number"),
    (lambda b, t, o: cardtool.extract_lora(b, t, rank=0, card_id="x", out=o), "--rank must be a whole number, at"),
    (lambda b, t, o: cardtool.extract_lora(b, t, rank=2, card_id="x", adapter=1, out=o), "adapter must be text"),
    (lambda b, t, o: cardtool.extract_lora(b, [t], rank=2, card_id="x", out=o), "tuned must be a card id or path"),
    (lambda b, t, o: cardtool.export(b, None), "out must be a path"),
    (lambda b, t, o: cardtool.export(b, o, format=None), "format must be a format's name"),
    (lambda b, t, o: cardtool.export(b, o, format="onnx"), "unknown export format 'onnx'"),
    (lambda b, t, o: cardtool.import_diffusers(3, base=b, card_id="x", out=o), "source must be a path"),
    (lambda b, t, o: cardtool.import_diffusers(o, base=b, card_id="x", out=o, variant=16), "variant must be text"),
])
def test_an_argument_the_command_line_could_not_give_is_bad_input(examples, tmp_path, call, message):
    with pytest.raises(cardtool.BadInput, match=message):
        call(str(examples / "tiny-base"), str(examples / "tiny-rl"), tmp_path / "made")
    assert not (tmp_path / "made").exists()


def test_diff_is_its_commands_json_document(examples, tmp_path):
    base, tuned = str(examples / "tiny-base"), str(examples / "tiny-rl")
    result = CliRunner().invoke(app, ["cards", "diff", base, tuned, "--top", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = cardtool.diff(Path(base), tuned, top=np.int64(2))
    assert report == json.loads(result.stdout) and len(report["weights"][0]["largest"]) == 2
    for top, message in ((-1, "--top must be from 0 to 1000, got -1"), (1001, "--top must be from 0 to 1000"),
                         (2.0, "top must be a whole number"), (None, "top must be a whole number")):
        with pytest.raises(cardtool.BadInput, match=message):
            cardtool.diff(base, tuned, top=top)
    with pytest.raises(cardtool.BadInput, match="b must be a card id or path"):
        cardtool.diff(base, 3)


def test_a_call_names_the_card_it_would_replace_and_replaces_it_only_when_told(examples, tmp_path):
    base, tuned = str(examples / "tiny-base"), str(examples / "tiny-rl")
    cardtool.merge([base, tuned], card_id="soup", out=tmp_path / "soup")
    with pytest.raises(cardtool.BadInput, match="already exists"):
        cardtool.merge([(base, 0.9), (tuned, 0.1)], card_id="soup", out=tmp_path / "soup")
    assert cardtool.merge([(base, 0.9), (tuned, 0.1)], card_id="soup", out=tmp_path / "soup",
                          overwrite=True).weights == [0.9, 0.1]


@pytest.mark.parametrize("name", ["merge", "compose", "extract_lora", "export", "import_diffusers", "diff"])
def test_a_call_without_an_option_does_what_its_command_without_it_does(name):
    """Each keyword's default is its option's (`format` is `--format`, the command's `fmt`)."""
    import inspect

    from cardtool.cli import cards

    command = getattr(cards, f"{'import' if name == 'import_diffusers' else name}_command")
    options = {{"fmt": "format"}.get(k, k): p.default for k, p in inspect.signature(command).parameters.items()}
    keywords = {k: p.default for k, p in inspect.signature(getattr(cardtool, name)).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert keywords and {k: options[k] for k in keywords} == keywords
    assert set(keywords) <= {"out", "overwrite", "adapter", "variant", "format", "top"}
