"""End-to-end parity: a short generation on the torch platform and on the numpy platform."""

from __future__ import annotations

from cardtool.backends.platform import Platform
from cardtool.core.cards.loader import load_card
from cardtool.core.evaluation.card_parity import generation_rows


def test_torch_and_numpy_generations_agree(examples):
    rows = generation_rows(load_card(examples / "tiny-base"), Platform("cpu", "generic"))
    assert [(r.dtype, r.passed) for r in rows] == [("float64", True), ("float32", True)]
    assert rows[0].max_abs_err < 1e-12 and 0 < rows[1].max_abs_err < 1e-4


def test_a_wrong_torch_kernel_shows_in_generation_parity(examples, kernels):
    kernels.register("cfg_combine", "cpu", "avx2", "default", target="wrong_kernels:cfg_combine_sign_flipped",
                     requires=("torch",))
    rows = generation_rows(load_card(examples / "tiny-base"), Platform("cpu", "avx2"))
    assert [r.passed for r in rows] == [False, False]
