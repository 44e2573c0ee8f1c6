"""What an `hf-encoder` source's config.json may hold, checked without importing transformers (validation stays light):
the encoder types cardtool loads, the JSON type of every field the BERT family's transformers config declares, and
the fields every encoder reads alike — so that a config transformers would refuse (a string where it wants a number,
an int where it wants a float), or one that builds something other than the encoder in the weights (a decoder,
cross-attention layers the weights lack), fails `cards validate` rather than the first `generate`.
`tests/components/test_encoder_fields.py` holds the table to the installed transformers' own annotations.
"""

from __future__ import annotations

__all__ = ["ACTIVATIONS", "BOOL", "ENCODERS", "FAMILY", "FIELDS", "FLOAT", "INT", "NONE", "STR", "field_problems",
           "fits", "positions"]

# model_type values whose AutoModel is a BERT-style encoder that returns last_hidden_state from input_ids and
# attention_mask (and token_type_ids), all configured by BertConfig's fields: checked field by field
FAMILY = ("bert", "roberta", "xlm-roberta", "camembert")
# every encoder loaded (each tested loading a tiny random model); the others' own fields are left to transformers
ENCODERS = (*FAMILY, "mpnet", "electra", "deberta-v2", "albert")
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "mpnet")  # positions counted from the padding id + 1
_GENERIC = ("output_hidden_states", "id2label", "auto_map", "is_decoder", "add_cross_attention", "pad_token_id",
            "vocab_size", "num_labels", "attn_implementation", "_attn_implementation", "base_model_tp_plan",
            "layer_types")  # fields every encoder's config reads alike
# transformers' activation names (ACT2CLS)
ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
               "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
               "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")

INT, FLOAT, BOOL, STR, NONE = "int", "float", "bool", "str", "null"
# field → the JSON types it may take (bool is not an int here, as in transformers' strict configs)
FIELDS: dict[str, tuple[str, ...]] = {
    "vocab_size": (INT,), "hidden_size": (INT,), "num_hidden_layers": (INT,), "num_attention_heads": (INT,),
    "intermediate_size": (INT,), "max_position_embeddings": (INT,), "type_vocab_size": (INT,),
    "hidden_act": (STR,), "hidden_dropout_prob": (FLOAT, INT), "attention_probs_dropout_prob": (FLOAT, INT),
    "initializer_range": (FLOAT,), "layer_norm_eps": (FLOAT,), "classifier_dropout": (FLOAT, INT, NONE),
    "pad_token_id": (INT, NONE), "bos_token_id": (INT, NONE), "eos_token_id": (INT, "list[int]", NONE),
    "use_cache": (BOOL,), "is_decoder": (BOOL,), "add_cross_attention": (BOOL,), "tie_word_embeddings": (BOOL,),
    # the fields every config has (PreTrainedConfig) are not checked by type in transformers; these few fail on load
    "output_hidden_states": (BOOL, INT, NONE), "id2label": ("dict", NONE), "auto_map": ("dict", STR, "list"),
    "position_embedding_type": (STR,), "num_labels": (INT,), "attn_implementation": (STR, NONE),
    "_attn_implementation": (STR, NONE), "base_model_tp_plan": ("dict", NONE),
    "layer_types": (NONE,),  # a per-layer attention kind: the encoders loaded here have none
}
_ATTENTION = ("eager", "sdpa")  # the attention implementations transformers runs on any machine
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
          "max_position_embeddings", "type_vocab_size")
_DTYPES = ("float32", "float16", "bfloat16", "float64")  # a string dtype names a torch float type


def _kind(value) -> str:
    if value is None:
        return NONE
    for kind, types in ((BOOL, bool), (INT, int), (FLOAT, float), (STR, str), ("dict", dict)):
        if isinstance(value, types):
            return kind
    return type(value).__name__


def fits(value, kinds: tuple[str, ...]) -> bool:
    """Whether `value` is of one of `kinds`; "list[int]" is a list of ints, "list" any list."""
    if isinstance(value, list):
        return "list" in kinds or any(k.startswith("list[") and all(_kind(v) == k[5:-1] for v in value) for k in kinds)
    return _kind(value) in kinds


def _whole(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def field_problems(settings: dict) -> list[str]:
    """Why transformers would refuse `settings` (a parsed config.json) or build another model from it than a frozen
    encoder of the weights; empty when it loads as one."""
    model_type = settings.get("model_type")
    if model_type not in ENCODERS:
        return [f"config.json's model_type is {model_type!r}; cardtool loads the encoders {', '.join(ENCODERS)}"]
    checked = FIELDS if model_type in FAMILY else {k: FIELDS[k] for k in _GENERIC}
    problems = []
    for key, kinds in checked.items():
        if key in settings and not fits(settings[key], kinds):
            problems.append(f"config.json's {key} is {settings[key]!r}; transformers wants {' or '.join(kinds)}")
    if problems:
        return problems[:3]
    for key in _SIZES:
        if key in checked and key in settings and settings[key] < 1:
            problems.append(f"config.json's {key} is {settings[key]}; it must be at least 1")
    if model_type in FAMILY and settings.get("hidden_act", "gelu") not in ACTIVATIONS:
        problems.append(f"config.json's hidden_act {settings['hidden_act']!r} is not an activation transformers has "
                        f"({', '.join(ACTIVATIONS)})")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
        if key in checked and settings.get(key) is not None and not 0 <= settings[key] <= 1:
            problems.append(f"config.json's {key} is {settings[key]}; a dropout probability is between 0 and 1")
    if "layer_norm_eps" in checked and "layer_norm_eps" in settings and not 0 < settings["layer_norm_eps"] < 1:
        problems.append(f"config.json's layer_norm_eps is {settings['layer_norm_eps']}; it must lie in (0, 1)")
    vocab = settings.get("vocab_size")
    for key in ("pad_token_id", "bos_token_id") if model_type in FAMILY else ("pad_token_id",):
        if isinstance(settings.get(key), int) and isinstance(vocab, int) and not 0 <= settings[key] < vocab:
            problems.append(f"config.json's {key} {settings[key]} is not a token of its {vocab}-token vocabulary")
    for key in ("is_decoder", "add_cross_attention"):
        if settings.get(key):  # a causal mask, or layers the encoder's weights do not hold (randomly initialised)
            problems.append(f"config.json's {key} is true; a text encoder is an encoder alone")
    for key in ("attn_implementation", "_attn_implementation"):
        if isinstance(settings.get(key), str) and settings[key] not in _ATTENTION:
            problems.append(f"config.json's {key} {settings[key]!r} is not one of {', '.join(_ATTENTION)}")
    if isinstance(settings.get("id2label"), dict) and not all(_whole(key) for key in settings["id2label"]):
        problems.append(f"config.json's id2label {settings['id2label']!r} is not keyed by label numbers")
    for key in ("dtype", "torch_dtype"):
        if isinstance(settings.get(key), (str, list)) and settings[key] not in _DTYPES:  # a list fails when printed
            problems.append(f"config.json's {key} {settings[key]!r} is not one of {', '.join(_DTYPES)}")
    # transformers before 5 build relative-distance weights for the others, randomly initialised if the file lacks them
    if model_type in FAMILY and settings.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"config.json's position_embedding_type is {settings['position_embedding_type']!r}; "
                        "cardtool loads absolute position embeddings")
    return problems[:3]


def positions(settings: dict) -> int | None:
    """How many tokens the encoder can take: RoBERTa's family and MPNet number positions from the padding id + 1."""
    limit = settings.get("max_position_embeddings")
    if not isinstance(limit, int):
        return None
    if settings.get("model_type") not in _OFFSET_POSITIONS:
        return limit
    pad = settings.get("pad_token_id")
    return limit - (pad if isinstance(pad, int) else 1) - 1
