"""What an `hf-encoder` source's tokenizer files must be for transformers to tokenize every prompt into ids its
encoder has embeddings for, checked with the `tokenizers` library that reads tokenizer.json for transformers (Rust:
no torch, no transformers, so `cards validate` stays light). A tokenizer.json that does not parse or cannot encode,
a tokenizer class that reads another kind of vocabulary than the file holds (transformers 5 then tokenizes into
[UNK]s, or fails), a special token outside the vocabulary (transformers adds it as a new id past the embeddings:
an IndexError when it is used) — each fails validation instead of the first `generate`.
`tests/components/test_tokenizer_files.py` holds the class table to the installed transformers.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from cardtool.backends.hf_encoder_fields import BOOL, NONE, STR, fits
from cardtool.files import file_stamp, is_regular_file, read_json_object, read_small_file

__all__ = ["CLASSES", "GENERIC", "MODEL_CLASSES", "PROBES", "special_tokens", "tokenizer_problems",
           "tokenizer_files_problems"]

# a tokenizer_class (its "Fast" twin alike) → the tokenizer.json model it reads; the generic classes read any model
CLASSES = {"Bert": "WordPiece", "DistilBert": "WordPiece", "Electra": "WordPiece", "MPNet": "WordPiece",
           "Roberta": "BPE", "GPT2": "BPE",
           "XLMRoberta": "Unigram", "Camembert": "Unigram", "DebertaV2": "Unigram", "Albert": "Unigram"}
GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")
# the class transformers picks from config.json's model_type when tokenizer_config.json names none
MODEL_CLASSES = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "camembert": "Camembert",
                 "mpnet": "MPNet", "electra": "Electra", "deberta-v2": "DebertaV2", "albert": "Albert"}
# text no vocabulary holds whole: words split to pieces, characters to the unknown token, and nothing at all
PROBES = ("a bag", "An Ankle-Boot, size 42: ☃ 😀 ü ß 中文 qzxjv \t", "")
_STANDARD = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token", "bos_token", "eos_token")
_LISTS = ("additional_special_tokens", "extra_special_tokens")
_FLAGS = ("special", "lstrip", "rstrip", "normalized", "single_word")  # an added token's switches
_TOKENIZER_FIELDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("do_lower_case", "tokenize_chinese_chars", "do_basic_tokenize", "add_prefix_space",
                     "clean_up_tokenization_spaces", "split_special_tokens"), (BOOL,)),
    "model_input_names": ("list[str]",),
    "strip_accents": (BOOL, NONE), "tokenizer_class": (STR, NONE),
    **dict.fromkeys(_STANDARD, (STR, "dict", NONE)),
}
_LIMIT = 64 << 20  # real tokenizer.json files, even of 250,000-token vocabularies, are tens of megabytes at most


def tokenizer_problems(settings: dict, file: str = "tokenizer_config.json") -> list[str]:
    """Why transformers would refuse a parsed tokenizer_config.json (or special_tokens_map.json, whose keys it takes
    as the same settings): its switches must be booleans, its sides left or right, its tokens text."""
    problems = [f"{file}'s {key} is {settings[key]!r}; transformers wants "
                + " or ".join(kinds) for key, kinds in _TOKENIZER_FIELDS.items()
                if key in settings and not fits(settings[key], kinds)]
    problems += [f"{file}'s {key} is {settings[key]!r}; it is left or right"
                 for key in ("padding_side", "truncation_side") if settings.get(key, "right") not in ("left", "right")]
    if file == "tokenizer_config.json":  # read from this file alone: the tokenizer's class arguments, its code
        if settings.get("init_inputs", []) != []:
            problems.append(f"{file}'s init_inputs is {settings['init_inputs']!r}; the tokenizer's arguments come "
                            "from its files")
        if "auto_map" in settings and not isinstance(settings["auto_map"], dict):
            problems.append(f"{file}'s auto_map is {settings['auto_map']!r}; transformers wants a mapping")
    return problems[:3]


def tokenizer_files_problems(source: Path, settings: dict) -> list[str]:
    """Why the tokenizer in `source` would fail to tokenize a prompt for the encoder config.json `settings`
    describes — tokenizer_config.json's settings first, then the files; empty when it will not. Remembered per folder
    and file versions: every card on the built-in encoder shares one check."""
    return list(_checked(*_key(source, settings))[0])


def special_tokens(source: Path, settings: dict) -> int | None:
    """How many special tokens the tokenizer in `source` adds to a prompt ([CLS] … [SEP]: 2); None where its files
    have a problem or are not read here."""
    return _checked(*_key(source, settings))[1]


def _key(source: Path, settings: dict) -> tuple:
    names = ("tokenizer.json", "vocab.txt", "special_tokens_map.json", "tokenizer_config.json")
    versions = tuple(_version(source / name) for name in names)
    model_type, vocab_size = settings.get("model_type"), settings.get("vocab_size")
    return (str(source), versions, model_type if isinstance(model_type, str) else None,
            vocab_size if isinstance(vocab_size, int) else None)


def _version(path: Path) -> tuple | None:
    try:
        return file_stamp(path)
    except (OSError, ValueError):
        return None


@functools.lru_cache(maxsize=32)
def _checked(source: str, versions: tuple, model_type, vocab_size) -> tuple[tuple[str, ...], int | None]:
    """The problems, and how many special tokens the tokenizer adds to a prompt (None: not known here)."""
    folder = Path(source)
    config, reason = _settings(folder / "tokenizer_config.json")
    special, reason = (config, reason) if reason else _settings(folder / "special_tokens_map.json")
    if reason:
        return (reason,), None
    kind, problems = _class_reads(config, model_type)
    if problems:
        return tuple(problems), None
    if is_regular_file(folder / "tokenizer.json"):
        vocab, specials, problems = _tokenizer_json(folder / "tokenizer.json", kind, vocab_size)
    elif is_regular_file(folder / "vocab.txt"):
        vocab, problems = _vocab_txt(folder / "vocab.txt", kind, special.get("unk_token", config.get("unk_token")))
        specials = 2  # the WordPiece classes' [CLS] … [SEP] (<s> … </s> for MPNet)
    else:
        if importlib.util.find_spec("sentencepiece") is None:
            problems = [f"{folder} holds a sentencepiece model alone, which transformers reads only with the "
                        "sentencepiece package; save the tokenizer with transformers to write its tokenizer.json"]
        return tuple(problems), None  # transformers converts it: nothing here reads it
    if problems:
        return tuple(problems), None
    for file, tokens in (("special_tokens_map.json", special), ("tokenizer_config.json", config)):
        problems += _special_problems(file, tokens, vocab)
    problems += _added_problems(config.get("added_tokens_decoder"), vocab)
    if isinstance(vocab_size, int) and vocab:
        token, top = max(vocab.items(), key=lambda item: item[1])
        if top >= vocab_size:
            problems.append(f"the tokenizer has token id {top} ({token!r}); the encoder's embeddings hold "
                            f"{vocab_size} (config.json's vocab_size)")
    return tuple(problems[:3]), specials


def _settings(path: Path) -> tuple[dict, str]:
    """tokenizer_config.json or special_tokens_map.json (transformers takes both as the tokenizer's settings): the
    object, or the first reason transformers would refuse it; an absent file is no settings."""
    if not path.exists():
        return {}, ""
    settings, reason = read_json_object(path)
    problems = [reason] if reason else tokenizer_problems(settings, path.name)
    return ({}, problems[0]) if problems else (settings, "")


def _class_reads(config: dict, model_type) -> tuple[str | None, list[str]]:
    """The tokenizer.json model the tokenizer's class reads (None: any), or why the class cannot be used."""
    name = config.get("tokenizer_class")
    if name is None:
        return CLASSES.get(MODEL_CLASSES.get(model_type, ""), None), []
    if name in GENERIC:
        return None, []
    family = name.removesuffix("Fast").removesuffix("Tokenizer")
    if family not in CLASSES or not name.endswith(("Tokenizer", "TokenizerFast")):
        known = ", ".join([f"{f}Tokenizer" for f in CLASSES] + list(GENERIC))
        return None, [f"tokenizer_config.json's tokenizer_class {name!r} is not a tokenizer of the encoders cardtool "
                      f"loads ({known})"]
    return CLASSES[family], []


def _tokenizer_json(path: Path, kind: str | None, vocab_size: int | None) -> tuple[dict, int | None, list[str]]:
    """tokenizer.json's vocabulary (token → id, added tokens included) and the number of special tokens it adds to a
    prompt, or why transformers could not use it: its pipeline as the file gives it (what the generic classes run;
    transformers sets padding and truncation itself) must encode text into ids the encoder has embeddings for."""
    from tokenizers import Tokenizer

    text, reason = read_small_file(path, limit=_LIMIT)
    if reason:
        return {}, None, [reason]
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the Rust parser raises a bare Exception naming what it could not read
        return {}, None, [f"{path} is not a tokenizer transformers can read: {str(e)[:200]}"]
    model = type(tokenizer.model).__name__
    if kind is not None and model != kind:
        return {}, None, [f"{path} holds a {model} model, and its tokenizer class reads {kind}: transformers "
                          "would tokenize prompts into unknown tokens or fail"]
    unknown = getattr(tokenizer.model, "unk_token", None)
    if model in ("WordPiece", "WordLevel") and tokenizer.model.token_to_id(str(unknown)) is None:
        return {}, None, [f"{path}'s {model} model has no unknown token {unknown!r} in its vocabulary: a word it "
                          "cannot split would fail to encode"]
    tokenizer.no_padding()
    tokenizer.no_truncation()
    try:
        encodings = [tokenizer.encode(probe) for probe in PROBES]  # not encode_batch: no thread pool for a few
    except Exception as e:  # noqa: BLE001 - as above
        return {}, None, [f"{path} cannot encode text such as {PROBES[1]!r}: {str(e)[:200]}"]
    top = max(max(e.ids, default=0) for e in encodings)
    if vocab_size is not None and top >= vocab_size:  # its post-processor's special tokens, say
        return {}, None, [f"{path} encodes text into id {top}; the encoder's embeddings hold {vocab_size} "
                          "(config.json's vocab_size)"]
    return tokenizer.get_vocab(with_added_tokens=True), len(encodings[-1].ids), []  # the empty probe's


def _vocab_txt(path: Path, kind: str | None, unknown) -> tuple[dict, list[str]]:
    """A WordPiece vocab.txt as transformers reads it (a token a line; a repeated one keeps its last line), or why a
    tokenizer cannot be built from it."""
    if kind != "WordPiece":
        return {}, [f"{path.parent} has no tokenizer.json, and its tokenizer class reads "
                    f"{kind or 'a tokenizer.json'}, not a WordPiece vocab.txt"]
    text, reason = read_small_file(path, limit=_LIMIT)
    if reason:
        return {}, [reason]
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vocab = {token: i for i, token in enumerate(lines[:-1] if text.endswith(("\n", "\r")) else lines)}
    unknown = unknown.get("content") if isinstance(unknown, dict) else unknown
    if (unknown or "[UNK]") not in vocab:
        return {}, [f"{path} has no unknown token {unknown or '[UNK]'!r}: a word it cannot split would fail to "
                    "encode"]
    return vocab, []


def _special_problems(file: str, tokens: dict, vocab: dict) -> list[str]:
    """Every special token `file` names must be text in the vocabulary: transformers adds any other as a new token
    whose id is past the encoder's embeddings."""
    named = [(key, value) for key, value in tokens.items() if key.endswith("_token") and key not in _LISTS
             and (key in _STANDARD or isinstance(value, (str, dict)))]  # other values of other keys are not tokens
    for key in _LISTS:
        value = tokens.get(key)
        if isinstance(value, dict) and key == "extra_special_tokens":
            named += [(f"{key}.{name}", token) for name, token in value.items()]
        elif isinstance(value, list):
            named += [(f"{key}[{i}]", token) for i, token in enumerate(value)]
        elif value is not None:
            return [f"{file}'s {key} is {value!r}; it lists tokens"]
    for key, value in named:
        if value is None:
            continue
        text = value.get("content") if isinstance(value, dict) else value
        if not isinstance(text, str):
            return [f'{file}\'s {key} is {value!r}; a token is text or {{"content": text, …}}']
        if text not in vocab:
            return [f"{file}'s {key} {text!r} is not in the tokenizer's vocabulary: transformers would add it as a "
                    "new token, past the encoder's embeddings"]
    return []


def _added_problems(added, vocab: dict) -> list[str]:
    """tokenizer_config.json's added_tokens_decoder: {id: {"content": text, its switches: booleans}}, each token in
    the vocabulary (transformers gives any other a new id past the embeddings, whatever id the file says)."""
    if added is None:
        return []
    if not isinstance(added, dict):
        return [f"tokenizer_config.json's added_tokens_decoder is {added!r}; it maps ids to tokens"]
    for key, token in added.items():
        if not key.isdecimal() or not isinstance(token, dict) or not isinstance(token.get("content"), str) or any(
                not isinstance(token.get(flag, False), bool) for flag in _FLAGS):
            return [f"tokenizer_config.json's added_tokens_decoder holds {key!r}: {token!r}; it maps ids to "
                    '{"content": text, …} with switches true or false']
        if token["content"] not in vocab:
            return [f"tokenizer_config.json adds {token['content']!r}, which is not in the tokenizer's vocabulary: "
                    "transformers would give it a new id, past the encoder's embeddings"]
    return []
