"""Recipes: YAML plus dotted overrides, validated strictly."""

from __future__ import annotations

import pytest
from helpers import REPO

from cardtool.core.training.recipes import apply_overrides, load_recipe
from cardtool.errors import BadInput


def test_overrides_parse_values_as_yaml():
    data = apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr=3e-4", "train.ema=0.99", "parents=[a, b]",
                                                    "card.id=x"])
    assert data == {"optim": {"lr": 3e-4}, "train": {"ema": 0.99}, "parents": ["a", "b"], "card": {"id": "x"}}


def test_shipped_recipes_load():
    for name in ("fashion-vae", "fashion-classifier", "fashion-base"):
        recipe = load_recipe(REPO / "examples" / "recipes" / f"{name}.yaml")
        assert recipe.card.id == name


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lrr=1", "optim.lrr: Extra inputs are not permitted"),
    ("optim.lr=-1", "optim.lr: Input should be greater than 0"),
    ("optim.lr", "expected KEY.PATH=VALUE"),
    ("train.precision=float8", "train.precision"),
])
def test_bad_overrides_name_the_field(override, message):
    with pytest.raises(BadInput, match=message):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", [override])


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
    with pytest.raises(BadInput, match=r"bomb.yaml:2:\d+: YAML alias \*a: aliases are not allowed"):
        load_recipe(bomb)
    with pytest.raises(BadInput, match="not a regular file"):
        load_recipe("/dev/zero")
    with pytest.raises(BadInput, match="YAML aliases are not allowed"):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", ["model.channels=&a [*a]"])
    with pytest.raises(BadInput, match="value is not YAML"):
        load_recipe(REPO / "examples" / "recipes" / "fashion-vae.yaml", ["optim.lr=!!int abc"])
