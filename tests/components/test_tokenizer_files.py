"""An hf-encoder source's tokenizer files are checked at validation with the `tokenizers` library (transformers is
not imported): each refusal is a tokenizer transformers fails to load or encode with, or that tokenizes into ids
past the encoder's embeddings or as another kind of vocabulary; what validates encodes."""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from helpers import copy_encoder

from cardtool.backends.hf_encoder import HFTextEncoder
from cardtool.backends.hf_encoder_config import HFEncoderConfig
from cardtool.backends.hf_encoder_fields import ENCODERS
from cardtool.backends.hf_tokenizer_files import CLASSES, GENERIC, MODEL_CLASSES, PROBES, tokenizer_files_problems
from cardtool.errors import RunFailed

torch.set_num_threads(1)
os.environ["HF_HUB_OFFLINE"] = "1"
TEXTS = ["a bag", "an ankle boot", "a sneaker with laces", "a dress", "a shirt", "trouser pullover coat sandal"] * 20


@functools.lru_cache
def _tokenizer(kind: str):
    """A tiny trained tokenizer of `kind` (WordPiece, BPE, Unigram) and its special tokens, saved as transformers
    saves the encoders' tokenizers of that kind."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if kind == "WordPiece":
        specials = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                    "mask_token": "[MASK]"}
        tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=100, special_tokens=list(specials.values()),
                                            show_progress=False)
    else:
        specials = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>", "cls_token": "<s>", "sep_token": "</s>"}
        order = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        if kind == "BPE":
            tokenizer = Tokenizer(models.BPE())
            tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=order, show_progress=False,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        else:
            tokenizer = Tokenizer(models.Unigram())
            tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
            trainer = trainers.UnigramTrainer(vocab_size=100, special_tokens=order, unk_token="<unk>",
                                              show_progress=False)
    tokenizer.train_from_iterator(TEXTS, trainer)
    first, last = (specials["cls_token"], specials["sep_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{first} $A {last}", special_tokens=[(t, tokenizer.token_to_id(t)) for t in (first, last)])
    return tokenizer, specials


def _folder(tmp_path, kind: str, tokenizer_class: str | None):
    tokenizer, specials = _tokenizer(kind)
    folder = tmp_path / f"{kind}-{tokenizer_class}"
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**specials, **({"tokenizer_class": tokenizer_class} if tokenizer_class else {})}))
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 300}))
    return folder


@pytest.mark.parametrize("kind", ["WordPiece", "BPE", "Unigram"])
def test_the_class_table_is_how_transformers_reads_each_kind_of_tokenizer(tmp_path, kind):
    """A class the table says reads `kind` encodes every probe with transformers; one it says reads another kind fails
    there or tokenizes the probes otherwise than the file does (the generic class reads the file as it is)."""
    from transformers import AutoTokenizer

    def ids(tokenizer_class):
        tokenizer = AutoTokenizer.from_pretrained(_folder(tmp_path, kind, tokenizer_class), local_files_only=True)
        return [tokenizer(text)["input_ids"] for text in PROBES]

    reference = ids(GENERIC[0])
    assert all(ids(name) == reference for name in GENERIC[1:])
    for family, reads in CLASSES.items():
        folder = _folder(tmp_path, kind, f"{family}Tokenizer")
        problems = tokenizer_files_problems(folder, {"model_type": "bert", "vocab_size": 300})
        assert any("tokenizer class reads" in p for p in problems) == (reads != kind), (family, problems)
        if reads == kind:
            assert all(max(row) < 300 for row in ids(f"{family}Tokenizer")), family
        else:
            try:
                assert ids(f"{family}Tokenizer") != reference, family
            except (TypeError, ValueError):
                pass  # transformers cannot build this class from the file at all


def test_an_encoder_without_a_tokenizer_class_reads_as_its_model_type_says(tmp_path):
    assert set(MODEL_CLASSES.values()) <= set(CLASSES) and set(MODEL_CLASSES) == set(ENCODERS)
    for kind in ("WordPiece", "BPE"):  # bert's tokenizer reads WordPiece: a BPE file under it would be misread
        problems = tokenizer_files_problems(_folder(tmp_path, kind, None), {"model_type": "bert", "vocab_size": 300})
        assert any("tokenizer class reads" in p for p in problems) == (kind == "BPE"), (kind, problems)


def _edit(folder, name, change):
    path = folder / name
    if change is None:
        path.unlink()
    elif callable(change):
        path.write_text(change(path.read_text()))
    else:
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def _without_lines(*tokens):
    return lambda text: "".join(line for line in text.splitlines(keepends=True) if line.strip() not in tokens)


# (files changed, what validation says, what transformers would do: fail, give an id past the embeddings, or lose the
# prompt's words)
REFUSED = [
    ({"tokenizer.json": lambda _: "{}"}, "tokenizer.json is not a tokenizer transformers can read", "fails"),
    ({"tokenizer.json": lambda t: t.replace('"[UNK]":100,', "").replace('"[UNK]": 100,', "")},
     "model has no unknown token '[UNK]'", "fails"),
    ({"special_tokens_map.json": {"pad_token": "<nope>"}}, "pad_token '<nope>' is not in the tokenizer's vocabulary",
     "past"),
    ({"special_tokens_map.json": {"unk_token": "<nope>"}}, "unk_token '<nope>' is not in", "fails"),
    ({"special_tokens_map.json": {"additional_special_tokens": ["[UNK]", "<new>"]}},
     "additional_special_tokens[1] '<new>' is not in", "past"),
    ({"special_tokens_map.json": {"additional_special_tokens": "[UNK]"}}, "additional_special_tokens is '[UNK]'; it "
     "lists tokens", "fails"),
    ({"special_tokens_map.json": {"mask_token": {"content": 5}}}, "a token is text", "fails"),
    ({"special_tokens_map.json": lambda _: "{"}, "special_tokens_map.json is not JSON", "fails"),
    ({"special_tokens_map.json": {"padding_side": 0}}, "special_tokens_map.json's padding_side is 0; it is left or "
     "right", "fails"),  # transformers takes its keys as the tokenizer's settings, as tokenizer_config.json's
    ({"tokenizer_config.json": {"extra_special_tokens": {"image": "<img>"}}}, "extra_special_tokens.image '<img>'",
     "past"),
    ({"tokenizer_config.json": {"foo_token": "<foo>"}}, "foo_token '<foo>' is not in", "past"),
    ({"tokenizer_config.json": {"added_tokens_decoder": {"0": {"content": "<new>"}}}}, "adds '<new>', which is not in",
     "past"),  # whatever the id the file gives it
    ({"tokenizer_config.json": {"added_tokens_decoder": {"0": {"content": "[PAD]", "lstrip": 5}}}},
     "with switches true or false", "fails"),
    ({"tokenizer_config.json": {"auto_map": None}}, "auto_map is None; transformers wants a mapping", "fails"),
    ({"tokenizer_config.json": {"init_inputs": "x"}}, "init_inputs is 'x'", "fails"),
    ({"special_tokens_map.json": {"split_special_tokens": "x"}}, "split_special_tokens is 'x'", "fails"),
    ({"tokenizer_config.json": {"tokenizer_class": "T5Tokenizer"}}, "tokenizer_class 'T5Tokenizer' is not a "
     "tokenizer of the encoders cardtool loads", "fails"),
    ({"tokenizer_config.json": {"tokenizer_class": "XLMRobertaTokenizerFast"}}, "holds a WordPiece model, and its "
     "tokenizer class reads Unigram", "fails"),
    ({"tokenizer.json": None, "vocab.txt": _without_lines("[UNK]")}, "vocab.txt has no unknown token '[UNK]'",
     "fails"),
    ({"tokenizer.json": None, "vocab.txt": lambda t: t + "".join(f"extra{i}\n" for i in range(3))},
     "the tokenizer has token id 30524 ('extra2'); the encoder's embeddings hold 30522", "past"),
    ({"tokenizer.json": lambda t: t.replace('"ids":[101]', '"ids":[50000]'),
      "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"}},  # the generic class runs the file's
     "tokenizer.json encodes text into id 50000; the encoder's embeddings hold 30522", "past"),  # post-processor
    ({"tokenizer.json": None, "tokenizer_config.json": {"tokenizer_class": "RobertaTokenizer"}},
     "has no tokenizer.json, and its tokenizer class reads BPE", "lost"),
    ({"tokenizer.json": lambda _: json.dumps({  # a BPE model whose unknown token is missing: it parses, then fails
        "version": "1.0", "added_tokens": [], "pre_tokenizer": {"type": "Whitespace"},
        "model": {"type": "BPE", "unk_token": "<unk>", "vocab": {"a": 0, "b": 1}, "merges": []}}),
      "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"}},
     "tokenizer.json cannot encode text such as 'An Ankle-Boot, size 42: ☃ 😀 ü ß 中文 qzxjv \\t': Unk token `<unk>` "
     "not found in the vocabulary", "fails"),
]


@pytest.mark.parametrize(("changes", "message", "consequence"), REFUSED)
def test_a_tokenizer_transformers_would_fail_with_fails_validation(tmp_path, changes, message, consequence):
    folder = copy_encoder(tmp_path / "encoder")
    for name, change in changes.items():
        _edit(folder, name, change)
    problems = HFEncoderConfig(max_length=16).source_problems(folder)
    assert any(message in p for p in problems), problems
    prompt = ["extra2 <new> <img> <foo> <nope> a bag ☃"]
    if consequence == "lost":  # a BPE class over no merges: every word is dropped, the prompt is [CLS] [SEP]
        assert HFTextEncoder(folder, 16, "cpu", torch.float32)(prompt)[1].sum() == 2
        return
    with pytest.raises(Exception) as failure:  # noqa: PT011 - transformers raises many kinds
        HFTextEncoder(folder, 16, "cpu", torch.float32)(prompt)
    if consequence == "past":
        assert isinstance(failure.value, RunFailed) and "the encoder's embeddings hold 30522" in str(failure.value)


@pytest.mark.parametrize("changes", [
    {},
    {"special_tokens_map.json": None},
    {"tokenizer.json": None},  # vocab.txt read as BERT's WordPiece
    {"vocab.txt": None},
    {"tokenizer_config.json": {"tokenizer_class": "BertTokenizerFast"}},
    {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast"}},
    {"special_tokens_map.json": {"cls_token": None, "pad_token": {"content": "[PAD]", "lstrip": False},
                                 "additional_special_tokens": ["[MASK]"], "add_bos_token": True, "foo_token": 5}},
    {"tokenizer_config.json": {"model_input_names": ["input_ids"], "added_tokens_decoder": {"7": {"content": "[PAD]"}},
                               "auto_map": {}}},  # the mask is asked for, whatever the names
    {"tokenizer.json": lambda t: t.replace('"pad_id":0', '"pad_id":99999')},  # transformers pads with its own id
])
def test_tokenizers_that_validate_encode(tmp_path, changes):
    folder = copy_encoder(tmp_path / "encoder")
    for name, change in changes.items():
        _edit(folder, name, change)
    assert HFEncoderConfig(max_length=16).source_problems(folder) == []
    states, mask = HFTextEncoder(folder, 16, "cpu", torch.float32)(list(PROBES))
    assert states.shape == (3, 16, 384) and torch.isfinite(states).all() and mask[:2].any(dim=1).all()


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.txt"])
def test_a_max_length_must_leave_a_token_for_the_prompt(tmp_path, files):
    """MiniLM's tokenizer adds [CLS] and [SEP]: at max_length 1 it could not truncate and prompts of different
    lengths failed to batch (a torch.cat error in `generate` of a card that validated); at 2 every prompt was the
    same text states. 3 encodes a prompt's first token, in both of the files transformers reads."""
    folder = copy_encoder(tmp_path / "encoder")
    if files == "vocab.txt":
        (folder / "tokenizer.json").unlink(missing_ok=True)
    for length in (1, 2):
        assert HFEncoderConfig(max_length=length).setting_problems(folder) == [
            (("max_length",), f"max_length {length} leaves no token for the prompt: the tokenizer adds 2 special "
             "tokens to each", "set max_length to at least 3")]
    config = HFEncoderConfig(max_length=3)
    assert config.source_problems(folder) == config.setting_problems(folder) == []
    states, mask = HFTextEncoder(folder, 3, "cpu", torch.float32)(["a bag", "", "an ankle boot"])
    assert states.shape == (3, 3, 384) and mask.tolist() == [[True] * 3, [True, True, False], [True] * 3]
    with pytest.raises(RunFailed, match=r"cannot fit a prompt in max_length 1 \(it made 2 tokens\)"):
        HFTextEncoder(folder, 1, "cpu", torch.float32)([""])  # the guard behind validation


def test_an_id_past_the_embeddings_is_a_clear_failure_not_an_index_error(tmp_path):
    """The guard behind validation: a tokenizer given a token after loading (as a plugin might) fails naming it."""
    encoder = HFTextEncoder(copy_encoder(tmp_path / "encoder"), 16, "cpu", torch.float32)
    encoder.tokenizer.add_tokens(["<new>"])
    encoder(["a bag"])
    with pytest.raises(RunFailed, match=r"gives token id 30522 \('<new>'\); the encoder's embeddings hold 30522"):
        encoder(["a <new> bag"])
    encoder.types = 0  # as if the token-type embeddings held none: the type every token gets is past them
    with pytest.raises(RunFailed, match="gives token type 0; the encoder's embeddings hold 0"):
        encoder(["a bag"])


def test_a_sentencepiece_model_alone_needs_the_package_that_reads_it(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        pytest.skip("sentencepiece is installed here: transformers can convert the model")
    folder = copy_encoder(tmp_path / "encoder")
    for name in ("tokenizer.json", "vocab.txt"):
        (folder / name).unlink()
    (folder / "spiece.model").write_bytes(b"a sentencepiece model")
    problems = HFEncoderConfig(max_length=16).source_problems(folder)
    assert any("holds a sentencepiece model alone" in p for p in problems), problems


def test_a_tokenizer_edited_in_place_is_checked_again_and_a_config_without_vocab_size_skips_that_check(tmp_path):
    """The check is remembered per file version: an edit (another size and time) is seen by the next validation.
    An encoder config.json without vocab_size cannot bound the ids, and says nothing of them."""
    folder = copy_encoder(tmp_path / "encoder")
    settings = json.loads((folder / "config.json").read_text())
    for files in ("tokenizer.json", "vocab.txt"):  # the second: the WordPiece vocabulary alone
        assert (folder / "tokenizer.json").exists() == (files == "tokenizer.json")
        assert tokenizer_files_problems(folder, settings) == []
        [past] = tokenizer_files_problems(folder, {**settings, "vocab_size": 100})
        assert "the encoder's embeddings hold 100 (config.json's vocab_size)" in past
        assert tokenizer_files_problems(folder, {k: v for k, v in settings.items() if k != "vocab_size"}) == []
        (folder / "tokenizer.json").unlink(missing_ok=True)
    _edit(folder, "tokenizer_config.json", {"tokenizer_class": "RobertaTokenizer"})
    assert tokenizer_files_problems(folder, settings) != [], "the edited file was read again"


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.txt"])
def test_the_embeddings_bound_the_ids_exactly_and_unreadable_files_are_problems(tmp_path, files):
    """MiniLM's largest id is 30521: 30522 embeddings hold it, 30521 do not — from either file transformers reads.
    A file that is not UTF-8 is a problem, not a crash; without any unk_token setting the vocabulary's [UNK] is it."""
    folder = copy_encoder(tmp_path / "encoder")
    if files == "vocab.txt":
        (folder / "tokenizer.json").unlink()
    settings = json.loads((folder / "config.json").read_text())
    assert tokenizer_files_problems(folder, {**settings, "vocab_size": 30522}) == []
    assert any("30521" in p and "hold 30521" in p for p in tokenizer_files_problems(folder, {**settings,
                                                                                             "vocab_size": 30521}))
    if files == "tokenizer.json":  # the ids the probes encode into, bounded as exactly (their post-processor's too)
        from tokenizers import Tokenizer

        top = max(max(e.ids) for e in Tokenizer.from_file(str(folder / files)).encode_batch(list(PROBES)))
        assert any(f"encodes text into id {top}; the encoder's embeddings hold {top}" in p
                   for p in tokenizer_files_problems(folder, {**settings, "vocab_size": top}))
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        _edit(folder, name, lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "unk_token"}))
    assert tokenizer_files_problems(folder, settings) == []
    _edit(folder, "tokenizer_config.json", {"added_tokens_decoder": [0, 1]})
    assert any("added_tokens_decoder is [0, 1]; it maps ids to tokens" in p
               for p in tokenizer_files_problems(folder, settings))
    _edit(folder, "tokenizer_config.json", {"added_tokens_decoder": {}})
    (folder / files).write_bytes(b"\xff\xfe[PAD]\n")
    assert any(f"{files} is not UTF-8 text" in p for p in tokenizer_files_problems(folder, settings))
