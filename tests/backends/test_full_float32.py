"""float32 means float32 on CUDA: PyTorch runs cuDNN's float32 convolutions in TF32 on sm80+ unless told not to
(an H200 decoded fashion-base's VAE 4.9e-4 off numpy and failed `parity --card`). The components, the judge and the
parity rows run with TF32 off there, and the caller's own settings come back after."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cardtool.backends import component_parity
from cardtool.backends.platform import Platform
from cardtool.backends.precision import autocast, full_float32
from cardtool.core.cards.loader import load_card
from cardtool.core.evaluation.reward import FashionJudge
from cardtool.core.sampling.instance import ModelInstance

CUDA = Platform("cuda", "sm90")
CONV, MATMUL = torch.backends.cudnn.conv, torch.backends.cuda.matmul


@pytest.fixture
def tf32_on():
    """The user's process asked for TF32 everywhere; the test's end puts torch's own defaults back."""
    saved = CONV.fp32_precision, MATMUL.fp32_precision
    CONV.fp32_precision = MATMUL.fp32_precision = "tf32"
    yield
    CONV.fp32_precision, MATMUL.fp32_precision = saved


def flags():
    return CONV.fp32_precision, MATMUL.fp32_precision


@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_full_precision_on_cuda_turns_tf32_off_and_gives_the_callers_settings_back(tf32_on, precision):
    with autocast(CUDA, precision):
        assert flags() == ("ieee", "ieee")
    assert flags() == ("tf32", "tf32")
    with pytest.raises(ValueError), full_float32(CUDA):
        assert flags() == ("ieee", "ieee")
        raise ValueError("a component failed")
    assert flags() == ("tf32", "tf32")  # restored on the way out of a failure too


def test_overlapping_contexts_keep_tf32_off_until_the_last_one_leaves(tf32_on):
    """Two threads generating at once leave in any order: the first out must not turn TF32 back on under the other,
    and the last out restores the caller's settings, not the other context's."""
    first, second = full_float32(CUDA), full_float32(CUDA)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert flags() == ("ieee", "ieee")
    second.__exit__(None, None, None)
    assert flags() == ("tf32", "tf32")
    with full_float32(CUDA), full_float32(CUDA):
        assert flags() == ("ieee", "ieee")
    assert flags() == ("tf32", "tf32")


def test_the_cpu_and_mixed_precision_leave_the_settings_alone(tf32_on):
    for platform, precision in ((Platform("cpu", "avx2"), "float32"), (Platform("numpy", "generic"), "float32"),
                                (Platform("cpu", "avx512_bf16"), "bfloat16")):
        with autocast(platform, precision):
            assert flags() == ("tf32", "tf32")


def test_the_judge_measures_in_full_float32_on_cuda(tf32_on, examples):
    judge = FashionJudge(ModelInstance(load_card(examples / "tiny-judge"), Platform("cpu", "generic")))
    judge.instance.platform = CUDA  # the model stays on the CPU; only the device's settings are asked for
    seen = []
    judge._batches(np.zeros((3, 28, 28), np.uint8), lambda model, x: seen.append(flags()) or (x.flatten(1),))
    assert seen == [("ieee", "ieee")] and flags() == ("tf32", "tf32")


def test_component_parity_runs_the_torch_forward_in_full_float32_on_cuda(tf32_on):
    seen = []
    torch_vae = SimpleNamespace(decode=lambda latents: seen.append(flags()) or latents)
    numpy_vae = SimpleNamespace(decode=lambda latents: latents)
    platform = SimpleNamespace(device="cuda", torch_device="cpu")  # CUDA's settings, tensors on the CPU
    z = np.arange(8.0).reshape(2, 1, 2, 2)
    [actual], [expected] = component_parity._run(("decode 2x1x2x2", "decode", {"latents": z}, {}), torch_vae,
                                                 numpy_vae, platform, "float32")
    assert seen == [("ieee", "ieee")] and np.array_equal(actual, expected) and np.array_equal(actual, z)
