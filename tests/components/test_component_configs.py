"""Each implementation's config schema and the tensors it predicts without torch: the predicted names and
shapes are exactly the torch module's state dict, for many configs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cardtool.backends.cnn_config import FashionCNNConfig
from cardtool.backends.component_config import config_problems, short_repr
from cardtool.backends.conv_vae import ConvVAE
from cardtool.backends.platform import Platform
from cardtool.backends.training import FashionCNN
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.backends.wan_config import WanDiTConfig
from cardtool.backends.wan_dit import WanDiT
from cardtool.errors import BadInput


def shapes(module) -> dict:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 3), head_dim=st.sampled_from([2, 4, 8]), depth=st.integers(0, 2), ffn=st.integers(1, 9),
       channels=st.integers(1, 5), patch=st.tuples(st.just(1), st.integers(1, 3), st.integers(1, 3)),
       text_dim=st.integers(1, 9), freq_dim=st.integers(2, 9), norm=st.booleans())
def test_wan_dit_tensors_are_the_modules_state_dict(heads, head_dim, depth, ffn, channels, patch, text_dim, freq_dim,
                                                    norm):
    config = WanDiTConfig(dim=heads * head_dim, heads=heads, depth=max(depth, 1), ffn_dim=ffn, in_channels=channels,
                          out_channels=channels + 1, patch=patch, text_dim=text_dim, freq_dim=freq_dim,
                          cross_attn_norm=norm)
    assert config.tensors() == shapes(WanDiT(config, Platform("cpu", "generic")))


@pytest.mark.parametrize("channels", [(8,), (4, 8), (8, 16, 32), (16, 8, 24, 4)])
def test_conv_vae_tensors_are_the_modules_state_dict(channels):
    config = ConvVAEConfig(channels=channels, latent_channels=3, image_channels=2, padded_size=32)
    assert config.tensors() == shapes(ConvVAE(config))


def test_fashion_cnn_tensors_are_the_modules_state_dict():
    config = FashionCNNConfig(width=16, features=12, classes=7)
    assert config.tensors() == shapes(FashionCNN(**config.model_dump()))


@pytest.mark.parametrize(("config", "expected"), [
    ({"dim": "128"}, "dim: Input should be a valid integer, got '128'"),
    ({"dim": 64, "heads": 3}, "dim 64 must split into 3 heads"),
    ({"heads": 0}, "heads: Input should be greater than or equal to 1, got 0"),
    ({"depth": 1025}, "depth: Input should be less than or equal to 1024, got 1025"),
    ({"dim": 65537}, "dim: Input should be less than or equal to 65536, got 65537"),
    ({"patch": [1, 2]}, "patch: Tuple should have at most 3 items|patch.2: Field required"),
    ({"eps": float("nan")}, "eps: Input should be a finite number"),
    ({"depth": True}, "depth: Input should be a valid integer, got True"),
    ({"dim": 10**5000}, "an integer of 16610 bits"),
    ({"dmi": 64}, "dmi: unknown key.*did you mean 'dim'"),
    ({"dimension": 64}, "dimension: unknown key.*did you mean 'dim'"),  # too far for difflib, but a prefix
    ({"patch_size": [1, 2, 2]}, "patch_size: unknown key.*did you mean 'patch'"),
    ({"patch": [1, 2.0, 2]}, "patch.1: Input should be a valid integer, got 2.0"),
    ({"patch": [1, 17, 1]}, "patch.1: Input should be less than or equal to 16, got 17"),
    ({"patch": [0, 2, 2]}, "patch.0: Input should be greater than or equal to 1, got 0"),
    ({"freq_dim": 1}, "freq_dim: Input should be greater than or equal to 2, got 1"),  # half of it divides
    ({"freq_dim": 64.0}, "freq_dim: Input should be a valid integer, got 64.0"),
    ({"eps": 1.0}, "eps: Input should be less than 1, got 1.0"),
    ({"eps": "1e-6"}, "eps: Input should be a valid number, got '1e-6'"),  # floats are strict: YAML's '1e-6' is text
    ({"eps": True}, "eps: Input should be a valid number, got True"),
    ({"eps": None}, "eps: Input should be a valid number, got None"),
    ({"cross_attn_norm": 1}, "cross_attn_norm: Input should be a valid boolean, got 1"),
    ({"text_mask": "true"}, "text_mask: Input should be a valid boolean, got 'true'"),
])
def test_wan_dit_config_problems_name_the_field(config, expected):
    problems = config_problems(WanDiTConfig, config)
    text = "; ".join(f"{'.'.join(where)}: {message} ({fix})" for where, message, fix in problems)
    assert problems and __import__("re").search(expected, text), text


def test_from_card_names_the_implementation_or_else_the_schema():
    with pytest.raises(BadInput, match=r"^wan-dit config: heads: Input should be greater than or equal to 1, got 0 "):
        WanDiTConfig.from_card({"heads": 0}, "wan-dit")
    with pytest.raises(BadInput, match=r"^WanDiTConfig config: heads: "):
        WanDiTConfig.from_card({"heads": 0})


def test_a_config_that_is_no_mapping_is_one_problem_saying_so():
    problem = ((), "a config is a mapping, got a list", "write key: value pairs")
    assert config_problems(WanDiTConfig, [1, 2]) == [problem]


def test_wan_dit_sizes_at_their_bounds_validate():
    assert config_problems(WanDiTConfig, {"patch": [16, 1, 16]}) == []
    assert config_problems(WanDiTConfig, {"depth": 1024, "dim": 65536, "heads": 1024}) == []


def test_short_repr_never_converts_a_huge_integer():
    assert short_repr(10**10000).startswith("an integer of")
    assert short_repr(2**63 - 1) == str(2**63 - 1) and short_repr(2**63) == "an integer of 64 bits"
    assert short_repr("x" * 58) == repr("x" * 58) and short_repr("x" * 59) == repr("x" * 59)[:57] + "..."
    assert short_repr("x" * 1000).endswith("...") and short_repr([1, 2]) == "a list"
    assert (short_repr(None), short_repr(True), short_repr(0.5)) == ("None", "True", "0.5")


@pytest.mark.parametrize(("config", "expected"), [
    ({"width": 16.0}, "width: Input should be a valid integer, got 16.0"),
    ({"width": 520}, "width: Input should be less than or equal to 512, got 520"),
    ({"width": 12}, "width 12 must be a multiple of 8"),
    ({"dropout": 1.0}, "dropout: Input should be less than 1, got 1.0"),
    ({"classes": 0}, "classes: Input should be greater than or equal to 1, got 0"),
])
def test_fashion_cnn_config_problems_name_the_field(config, expected):
    text = "; ".join(f"{'.'.join(where)}: {message}" for where, message, _ in config_problems(FashionCNNConfig, config))
    assert expected in text, text


def test_fashion_cnn_sizes_at_their_bounds_validate():
    assert config_problems(FashionCNNConfig, {"width": 512, "dropout": 0.0, "classes": 1}) == []
    assert config_problems(FashionCNNConfig, {"width": 8}) == []
    defaults = FashionCNNConfig.model_validate({})  # what a card that gives none runs: the judge of the README
    assert (defaults.classes, defaults.width, defaults.features, defaults.dropout) == (10, 32, 256, 0.3)


@pytest.mark.parametrize(("config", "expected"), [
    ({"scaling_factor": 1e-45}, "scaling_factor: Input should be greater than or equal to 0.000001, got 1e-45"),
    ({"scaling_factor": 2e6}, "scaling_factor: Input should be less than or equal to 1000000, got 2000000.0"),
    ({"image_size": 33}, "padded_size 32 must hold image_size 33 and halve 2 times exactly"),
    ({"padded_size": 30}, "padded_size 30 must hold image_size 28 and halve 2 times exactly"),
    ({"channels": [8, 12]}, "channels [12] do not split into GroupNorm's min(8, channels) groups"),
    ({"image_channels": 5}, "image_channels: Input should be less than or equal to 4, got 5"),
])
def test_conv_vae_config_problems_name_the_field(config, expected):
    text = "; ".join(f"{'.'.join(where)}: {message}" for where, message, _ in config_problems(ConvVAEConfig, config))
    assert expected in text, text


def test_conv_vae_sizes_at_their_bounds_validate():
    assert config_problems(ConvVAEConfig, {"scaling_factor": 1e6, "channels": [4, 8, 8]}) == []
    assert config_problems(ConvVAEConfig, {"scaling_factor": 1e-6, "image_size": 32}) == []
    defaults = ConvVAEConfig.model_validate({})  # what a card that gives none runs: 28×28 grey in 4×8×8 latents
    assert (defaults.image_size, defaults.padded_size, defaults.latent_size) == (28, 32, 8)
    assert defaults.channels == (32, 64, 128) and defaults.scaling_factor == 1.0


def test_an_encoder_max_length_is_a_whole_number_up_to_4096():
    from cardtool.backends.hf_encoder_config import HFEncoderConfig

    assert config_problems(HFEncoderConfig, {"max_length": 4096}) == []
    for value, message in ((16.0, "valid integer, got 16.0"), (4097, "less than or equal to 4096, got 4097")):
        [(where, text, _)] = config_problems(HFEncoderConfig, {"max_length": value})
        assert where == ("max_length",) and message in text
    assert HFEncoderConfig.model_validate({}).max_length == 32, "the default of a card that gives none"
