"""JSON that Python's parser refuses beyond the grammar — nested deeper than it recurses (`[[[[…`, a few hundred
kilobytes), an integer past int()'s 4,300 digits — in any file or record a user hands cardtool is malformed input like
any other: a clear refusal or the documented fallback, never a RecursionError or ValueError traceback. Each reader of
outside JSON is tried here."""

from __future__ import annotations

import json

import pytest
import torch

from cardtool.errors import BadInput
from cardtool.files import parse_json, read_json_object

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = '{"r": ' + "1" * 5000 + "}"
BEYOND = pytest.mark.parametrize("text", [DEEP, HUGE], ids=["deep", "huge-int"])


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def test_parse_json_reads_json_and_calls_what_it_cannot_hold_malformed():
    assert parse_json('{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
    assert parse_json(b"[[[]]]") == [[[]]]
    assert parse_json("1" * 4300) == int("1" * 4300)
    for text in (DEEP, DEEP.encode(), '{"a": ' * 50_000):
        with pytest.raises(json.JSONDecodeError, match="nested too deeply|Expecting"):
            parse_json(text)
    with pytest.raises(json.JSONDecodeError, match=r"exceeds the limit \(4300 digits\)"):
        parse_json(HUGE)


@BEYOND
def test_such_a_config_file_is_not_json(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    value, reason = read_json_object(tmp_path / "config.json")
    assert value == {} and reason.startswith(f"{tmp_path / 'config.json'} is not JSON: ")


def test_a_config_file_is_read_up_to_one_mebibyte(tmp_path):
    padded = '{"a": 1}'.ljust(1 << 20)  # JSON allows the trailing spaces
    (tmp_path / "config.json").write_text(padded)
    assert read_json_object(tmp_path / "config.json") == ({"a": 1}, "")
    (tmp_path / "config.json").write_text(padded + " ")
    too_large = f"{tmp_path / 'config.json'} is larger than 1048576 bytes"
    assert read_json_object(tmp_path / "config.json") == ({}, too_large)


@BEYOND
def test_a_lora_whose_peft_metadata_is_such_states_no_rank_from_it(text):
    from cardtool.backends.lora_targets import rank_and_alpha

    assert rank_and_alpha({"lora_adapter_metadata": text}) == {}
    assert rank_and_alpha({"lora_adapter_metadata": text, "rank": "4"}) == {"rank": "4"}
    assert rank_and_alpha({"lora_adapter_metadata": '{"r": 8, "lora_alpha": 16}'}) == {"rank": "8", "alpha": "16"}


@BEYOND
def test_a_checkpoint_whose_optimizer_groups_are_such_is_refused(text):
    from cardtool.backends.training import check_optimizer_tensors

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="param_groups is not JSON"):
        check_optimizer_tensors(optimizer, {}, text)


@pytest.mark.parametrize("index", ["²", "1", "x"])
def test_a_checkpoint_whose_optimizer_state_names_no_parameter_is_refused(index):
    from cardtool.backends.training import check_optimizer_tensors, optimizer_tensors

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    _, groups = optimizer_tensors(optimizer)
    with pytest.raises(ValueError, match=f"^'optim.{index}.step' names no parameter of this optimizer$"):
        check_optimizer_tensors(optimizer, {f"optim.{index}.step": torch.tensor(1.0)}, groups)


@pytest.mark.parametrize("step", [float("inf"), float("nan"), -1.0, 2.5, True])
def test_a_checkpoint_whose_optimizer_step_is_no_count_is_refused(step):
    from cardtool.backends.training import check_optimizer_tensors, optimizer_tensors

    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter])
    parameter.grad = torch.ones(2)
    optimizer.step()
    tensors, groups = optimizer_tensors(optimizer)
    check_optimizer_tensors(optimizer, tensors, groups)
    with pytest.raises(ValueError, match="^'optim.0.step' is not a count of steps$"):
        check_optimizer_tensors(optimizer, {**tensors, "optim.0.step": torch.tensor(step)}, groups)


def test_a_checkpoint_whose_recipe_is_deep_names_no_changes():
    from cardtool.core.training.trainer import recipe_changes

    assert recipe_changes(DEEP, {"optim.lr": 1e-3}) == ""
    assert recipe_changes('{"a": ' * 900 + "1" + "}" * 900, {"optim.lr": 1e-3}) == ""  # parses, but too deep to walk
    assert recipe_changes('{"optim.lr": 0.01}', {"optim.lr": 0.001}) == " (optim.lr was 0.01, now 0.001)"


@BEYOND
def test_resuming_from_such_an_eval_report_is_refused(tmp_path, text):
    from cardtool.core.evaluation.resume import previous_rows

    (tmp_path / "eval.json").write_text(text)
    with pytest.raises(BadInput, match=r"cannot resume from .*eval.json: it is not JSON \((nested too deeply|exceeds)"):
        previous_rows(tmp_path / "eval.json", {})


@BEYOND
def test_such_a_digest_memo_counts_as_empty(tmp_path, monkeypatch, text):
    from cardtool.core.cards import weight_files

    monkeypatch.setenv("CARDTOOL_CACHE", str(tmp_path))
    monkeypatch.setattr(weight_files, "_memo", None)
    (tmp_path / "digests.json").write_text(text)
    assert weight_files._digest_memo() == {}


@BEYOND
def test_an_image_folder_whose_captions_hold_such_a_line_is_refused(tmp_path, text):
    from cardtool.core.image_folder import load_captioned

    (tmp_path / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "a bag"}\n' + text + "\n")
    with pytest.raises(BadInput, match=r"metadata.jsonl:2: not a JSON object \((nested too deeply|exceeds)"):
        load_captioned("train", tmp_path, 28)


@BEYOND
def test_a_diffusers_folder_with_such_a_config_or_shard_index_is_refused(tmp_path, examples, text):
    from cardtool.core.cards.diffusers_import import import_diffusers

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(text)
    (model / "diffusion_pytorch_model.safetensors.index.json").write_text("{}")
    with pytest.raises(BadInput, match="config.json is not JSON: (nested too deeply|exceeds)"):
        import_diffusers(model, str(examples / "tiny-base"), "imported", out=tmp_path / "card")
    (model / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    (model / "diffusion_pytorch_model.safetensors.index.json").write_text(text)
    with pytest.raises(BadInput, match="index.json: not a safetensors index"):
        import_diffusers(model, str(examples / "tiny-base"), "imported", out=tmp_path / "card")
