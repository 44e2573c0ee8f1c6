"""Recipes: YAML plus dotted overrides, validated strictly."""

from __future__ import annotations

import math
import re

import pydantic
import pytest
from helpers import REPO

from cardtool.backends.lora_targets import DEFAULT_TARGETS
from cardtool.core.training.lora_settings import MAX_RANK, lora_overrides, lora_settings
from cardtool.core.training.recipes import Recipe, apply_overrides, load_recipe, loss_number
from cardtool.errors import BadInput


def test_overrides_parse_values_as_yaml():
    data = apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr=3e-4", "train.ema=0.99", "parents=[a, b]",
                                                    "card.id=x"])
    assert data == {"optim": {"lr": 3e-4}, "train": {"ema": 0.99}, "parents": ["a", "b"], "card": {"id": "x"}}
    # the later of two overrides of one key wins, as in a script that appends its own to a common list
    assert apply_overrides({}, ["optim.lr=1", "optim.steps=5", "optim.lr=2"]) == {"optim": {"lr": 2, "steps": 5}}


def test_what_a_recipe_omits_has_defaults_a_resume_relies_on():
    """A run's fingerprint, which --resume matches, covers every setting, defaults included: a default changed
    between versions would refuse every run in flight as made by a different recipe, and silently change what each
    recipe that omits it trains."""
    recipe = Recipe.model_validate({"method": "vae", "card": {"id": "x"}})
    assert recipe.hyperparameters() == {
        "data": {}, "model": {}, "loss": {},
        "optim": {"lr": 3e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "warmup": 0, "grad_clip": 1.0,
                  "batch_size": 128, "steps": 1000},
        "train": {"seed": 0, "precision": "float32", "ema": 0.0, "checkpoint_every": 200, "log_every": 50}}
    assert recipe.fingerprint() == "80163b15502ab70c"
    assert Recipe.model_validate({**recipe.model_dump(), "train": {"parallel": "fsdp"}}).fingerprint() == \
        recipe.fingerprint(), "how the ranks share the work is not part of it"


def test_shipped_recipes_load():
    for name in ("fashion-vae", "fashion-classifier", "fashion-base"):
        recipe = load_recipe(REPO / "examples" / "recipes" / f"{name}.yaml")
        assert recipe.card.id == name


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lrr=1", "optim.lrr: Extra inputs are not permitted"),
    ("optim.lr=-1", "optim.lr: Input should be greater than 0"),
    ("optim.lr", "expected KEY.PATH=VALUE"),
    ("train.precision=float8", "train.precision"),
    ("optim.weight_decay=.inf", r"optim.weight_decay: a non-finite number \(inf\)"),  # trains to NaN
    ("optim.betas=[0.9, 1.0]", "optim.betas.1: Input should be less than 1"),  # AdamW refuses it at the first step
    ("method=[lora]", "method: Input should be 'vae'"),  # not a name to look up among the other commands' methods
    # what the card it makes could not record is refused before the run, not when the card is written after it
    ("loss.kl_weight=100000000000000000000", "loss.kl_weight: an integer of 68 bits with its sign, beyond 64"),
    ("data.extra=[1, .inf]", r"data.extra.1: a non-finite number \(inf\)"),
    ("card.id=" + "a" * 129, "card.id: String should have at most 128 characters"),
    ("data.when=2026-12-01", "data.when: a date value"),
    # a scalar torch cannot convert to the float32 tensors it meets (AdamW's lr raised a RuntimeError)
    ("optim.lr=1e308", r"optim.lr = 1e\+308: beyond float32's range"),
    ("model.channels=[16, -3.5e+38]", r"model.channels.1 = -3.5e\+38: beyond float32's range"),
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(BadInput, match=message):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", [override])


def test_a_refused_value_is_blamed_on_the_set_that_gave_it_not_on_the_recipe_file(tmp_path):
    vae = REPO / "examples" / "recipes" / "fashion-vae.yaml"
    with pytest.raises(BadInput, match=r"^--set 'optim.steps=1.5': optim.steps: .*fractional"):
        load_recipe(vae, ["optim.steps=2", "optim.steps=1.5"])
    with pytest.raises(BadInput, match=r"^--set 'optim.lr=1e39': optim.lr = 1e\+39: beyond"):
        load_recipe(vae, ["optim.lr=1e39"])
    with pytest.raises(BadInput, match=r"^--set 'optim=\{lr: -1\}', --set 'optim.steps=0': optim.lr: .*; optim.steps"):
        load_recipe(vae, ["optim={lr: -1}", "optim.steps=0"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(re.sub(r"(?m)^  steps: .*$", "  steps: 1.5", vae.read_text()))
    with pytest.raises(BadInput, match=f"^recipe {re.escape(str(bad))}: optim.steps"):  # the file's, a --set aside
        load_recipe(bad, ["optim.lr=0.001"])
    with pytest.raises(BadInput, match=f"^recipe {re.escape(str(bad))}: optim.lr: .*; optim.steps"):  # one of two
        load_recipe(bad, ["optim.lr=-1"])


@pytest.mark.parametrize(("section", "values", "message"), [
    # pydantic's lax mode read a boolean as a number and a number or a word as a boolean: each trained
    ("optim", {"steps": True}, "optim.steps: takes a number, not true or false (got True)"),
    ("train", {"ema": False}, "train.ema: takes a number, not true or false"),
    ("optim", {"betas": [False, 0.9]}, "optim.betas: takes numbers, not true or false"),
    ("loss", {"student_steps": True}, "loss.student_steps: takes a number"),  # distilled a one-step student
    ("loss", {"gan": 1}, "loss.gan: must be true or false, got 1"),
    ("loss", {"gan": "yes"}, "loss.gan: must be true or false, got 'yes'"),
    ("loss", {"t_range": [0, True]}, "loss.t_range: takes numbers"),
    ("model", {"lora": {"rank": True}}, "model.lora.rank: takes a number"),
])
def test_a_boolean_is_no_number_and_a_number_no_boolean(section, values, message):
    from cardtool.core.training.distill import check_recipe

    recipe = {"method": "dmd2", "card": {"id": "s"}, "parents": ["t"], section: values}
    with pytest.raises(BadInput, match=re.escape(message)):
        check_recipe(load_recipe(None, method="dmd2", section=recipe))
    fine = {"optim": {"steps": 3, "lr": "3e-4"}, "train": {"ema": 0.5}, "loss": {"gan": True, "t_range": [0.1, 1]},
            "model": {"lora": {"rank": 2}}}[section]  # numbers as YAML reads them (3e-4 as text), booleans as such
    check_recipe(load_recipe(None, method="dmd2", section={**recipe, section: fine}))


def test_weight_decay_is_refused_where_adamw_would_zero_or_flip_the_weights():
    """AdamW multiplies each weight by 1 − lr·weight_decay a step: at lr·wd ≥ 1 (wd 1e30 trained to NaN at step 1)."""
    recipe = REPO / "examples" / "recipes" / "fashion-vae.yaml"
    assert load_recipe(recipe, ["optim.lr=1e-3", "optim.weight_decay=999"]).optim.weight_decay == 999
    for decay in ("1000", "1e30"):
        with pytest.raises(BadInput, match=r"optim: weight_decay .* lr × weight_decay = .* ≥ 1 a step"):
            load_recipe(recipe, ["optim.lr=1e-3", f"optim.weight_decay={decay}"])


def test_a_recipe_given_as_data_refuses_non_finite_settings():
    """The Python API's recipe sections skip the manifest reader; the schema itself refuses inf and NaN."""
    with pytest.raises(BadInput, match="optim.weight_decay: Input should be a finite number"):
        load_recipe(None, section={"method": "vae", "card": {"id": "x"}, "optim": {"weight_decay": math.inf}})
    with pytest.raises(BadInput, match="model.lora.alpha: Input should be a finite number"):
        lora_settings(load_recipe(None, section={"method": "lora", "card": {"id": "x"}, "model": {"lora": {
            "rank": 4, "alpha": math.nan}}}), "x", "base")
    vae = load_recipe(None, section={"method": "vae", "card": {"id": "x"}, "loss": {"kl_weight": math.inf}})
    with pytest.raises(BadInput, match="loss.kl_weight must be a finite number in"):
        loss_number(vae, "kl_weight", 1e-4, 0.0, math.inf)


def lora_of(model: dict):
    return lora_settings(load_recipe(None, section={"method": "lora", "card": {"id": "x"}, "model": model}), "rl",
                         "fashion-base")


def test_model_lora_validates_its_rank_alpha_and_targets_and_nothing_else_may_stand_beside_it():
    assert lora_of({}) is None
    four = lora_of({"lora": {"rank": 4}})
    assert (four.rank, four.alpha, four.targets) == (4, 4.0, DEFAULT_TARGETS)  # alpha = rank: α/r = 1
    assert lora_of({"lora": {"rank": 1024, "alpha": 0.5, "targets": ["attn1.to_q"]}}).alpha == 0.5
    assert lora_of({"lora": {"rank": 1}}).rank == 1
    for bad, where in (({"rank": 0}, "rank: Input should be greater than or equal to 1"),
                       ({"rank": 1025}, "rank: Input should be less than or equal to 1024"),
                       ({"rank": 4, "alpha": 0}, "alpha: Input should be greater than 0"),
                       ({"rank": 4, "alpha": math.inf}, "alpha: Input should be a finite number"),
                       ({"rank": 4, "targets": []}, "targets: Tuple should have at least 1 item"),
                       ({"rank": 4, "dropout": 0.1}, "dropout: Extra inputs are not permitted")):
        with pytest.raises(BadInput, match=f"^rl recipe: model.lora.{where}"):
            lora_of({"lora": bad})
    with pytest.raises(BadInput, match=r"keeps the architecture of 'fashion-base'.*got model.dim, model.heads"):
        lora_of({"lora": {"rank": 4}, "heads": 2, "dim": 64})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        four.rank = 8


def test_method_flag_must_agree_with_the_recipe():
    with pytest.raises(BadInput, match="is for method 'vae', not 'classifier'"):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", method="classifier")


def test_fingerprint_follows_every_setting():
    path = REPO / "examples" / "recipes" / "fashion-vae.yaml"
    assert load_recipe(path).fingerprint() == load_recipe(path).fingerprint()
    assert load_recipe(path).fingerprint() != load_recipe(path, ["optim.steps=5"]).fingerprint()


def test_hostile_recipes_and_overrides_are_bad_input(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("a: &a [x, x, x]\nb: &b [*a, *a, *a]\nmethod: vae\nmodel: {x: [*b, *b, *b]}\n")
    with pytest.raises(BadInput, match=r"bomb.yaml:2:\d+: YAML alias \*a: aliases are not allowed \(fix: write the "
                                       r"value out in full\)"):  # not how cards derive
        load_recipe(bomb)
    with pytest.raises(BadInput, match="not a regular file"):
        load_recipe("/dev/zero")
    with pytest.raises(BadInput, match="YAML aliases are not allowed"):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", ["model.channels=&a [*a]"])
    with pytest.raises(BadInput, match="value is not YAML"):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", ["optim.lr=!!int abc"])


def test_lora_takes_every_rank_from_1_to_the_bound_and_says_so_of_itself():
    assert lora_overrides(None) == []
    for rank in (1, MAX_RANK):  # both ends are ranks a LoRA can have
        assert lora_overrides(rank) == [f"model.lora.rank={rank}"]
        assert lora_overrides(rank, [f"model.lora.rank={rank}"]) == [f"model.lora.rank={rank}"]
    for rank in (0, MAX_RANK + 1, True, 2.0):
        with pytest.raises(BadInput, match=f"^--lora must be a whole number from 1 to {MAX_RANK}, got {rank!r}$"):
            lora_overrides(rank)
