"""FID, KID and improved precision/recall on feature rows: analytic answers, KID staying unbiased where FID is not,
and precision/recall telling fidelity from diversity where one number cannot."""

from __future__ import annotations

import numpy as np
import pytest

from cardtool.core.evaluation.metrics import (
    fid_warning,
    frechet_distance,
    frechet_std,
    kernel_distance,
    precision_recall,
    wilson_interval,
)


def test_frechet_distance_of_a_mean_shift_is_the_squared_shift():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4000, 4))
    shifted = a + np.array([1.0, 0.0, 2.0, 0.0])
    assert abs(frechet_distance(a, shifted) - 5.0) < 1e-9, "equal covariances: only ‖μa − μb‖² = 1 + 4 remains"


def test_the_distance_to_a_fixed_real_side_is_the_frechet_distance():
    """FrechetTo (the bootstrap's) takes the real side's root instead of the sample's: the same number."""
    from cardtool.core.evaluation.metrics import FrechetTo

    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((500, 6)) * 1.3 + 0.4, rng.standard_normal((700, 6)) @ rng.standard_normal((6, 6))
    assert FrechetTo(b)(a) == pytest.approx(frechet_distance(a, b), rel=1e-9)


def test_one_feature_gives_the_univariate_frechet_distance():
    """A judge with `features: 1` validates: its FID is (μa − μb)² + (σa − σb)², where numpy's covariance of one
    column (a 0-d array) ended `eval` in a LinAlgError."""
    from cardtool.core.evaluation.metrics import FrechetTo

    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((300, 1)) * 2.0 + 1.0, rng.standard_normal((500, 1)) * 0.5
    expected = (a.mean() - b.mean()) ** 2 + (a.std(ddof=1) - b.std(ddof=1)) ** 2
    assert frechet_distance(a, b) == pytest.approx(expected, rel=1e-9)
    assert FrechetTo(b)(a) == pytest.approx(expected, rel=1e-9) and frechet_std(a, b, resamples=5) > 0
    assert np.isfinite(kernel_distance(a, b, subsets=3)[0]) and precision_recall(a, b, k=3)[0] >= 0


@pytest.mark.parametrize(("generated", "real", "size"), [(40, 70, 30), (30, 2100, 30), (30, 70, 50)],
                         ids=["a-subset-of-each", "all-of-a-and-real-in-chunks", "all-of-a-larger-than-real"])
def test_kid_is_the_unbiased_mmd_of_the_cubic_kernel_over_subsets_drawn_without_repeats(generated, real, size):
    """The estimator written out: a subset of each side drawn without replacement (a repeated row would pair with
    itself in the within-side sums, which leave out only the diagonal), k(x, y) = (x·y/d + 1)³ — also where every
    subset holds all of the generated rows, whose sums kernel_distance then takes once."""
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((generated, 5)) + 0.3, rng.standard_normal((real, 5))

    def mmd(x, y):
        kxx, kyy, kxy = ((p @ q.T / 5 + 1) ** 3 for p, q in ((x, x), (y, y), (x, y)))
        n = len(x)
        return (kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (n * (n - 1)) \
            - 2 * kxy.mean()

    n, draw = min(generated, real, size), np.random.default_rng(5)
    estimates = [mmd(a[draw.choice(generated, n, replace=False)], b[draw.choice(real, n, replace=False)])
                 for _ in range(3)]
    assert kernel_distance(a, b, subsets=3, subset_size=size, seed=5) == pytest.approx(
        (np.mean(estimates), np.std(estimates)), rel=1e-12)


def test_kid_of_another_real_side_or_sample_size_is_measured_anew():
    """The real side's within-subset sums are kept between calls (an eval's rows share them), by the real rows'
    content and the draws that pick the subsets: never another real side's of the same shape, or another N's."""
    from cardtool.core.evaluation import metrics

    def afresh(x, y, size):
        metrics._WITHIN_REAL.clear()
        return kernel_distance(x, y, subsets=4, subset_size=size)

    rng = np.random.default_rng(7)
    a, b = rng.standard_normal((50, 4)), rng.standard_normal((90, 4))
    changed = b.copy()
    changed[:45] += 0.5
    for x, y, size in ((a, changed, 40), (a[:40], b, 30), (a, b, 30), (a[:45], b, 40)):
        kept = [kernel_distance(z, b, subsets=4, subset_size=s) for z, s in ((a, 40), (a[:40], 40), (a, 30))]
        assert kernel_distance(x, y, subsets=4, subset_size=size) == afresh(x, y, size)
        assert kept == [afresh(z, b, s) for z, s in ((a, 40), (a[:40], 40), (a, 30))], "kept sums are the same sums"
    for seed in range(12):
        kernel_distance(a, b, subsets=1, subset_size=10, seed=seed)
    assert len(metrics._WITHIN_REAL) == 8, "a process evaluating many real sides keeps the latest eight"


def test_kid_and_the_fid_spread_default_to_the_published_protocol():
    """KID over 100 subsets of 1,000 rows (Bińkowski et al.), FID's bootstrap over 50 redraws, seeded with 0."""
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((1001, 2)), rng.standard_normal((1002, 2)) + 0.1
    assert kernel_distance(a, b) == kernel_distance(a, b, subsets=100, subset_size=1000, seed=0)
    assert frechet_std(a[:60], b) == frechet_std(a[:60], b, resamples=50, seed=0)


def test_the_bootstrapped_fid_spread_redraws_the_generated_rows_with_replacement():
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((60, 3)) * 1.2, rng.standard_normal((200, 3))
    draw = np.random.default_rng(0)
    spread = np.std([frechet_distance(a[draw.integers(0, 60, 60)], b) for _ in range(7)])
    assert frechet_std(a, b, resamples=7) == pytest.approx(spread, rel=1e-9)


def test_kernel_distance_is_near_zero_for_one_distribution_and_positive_for_two():
    rng = np.random.default_rng(1)
    real = rng.standard_normal((2000, 16))
    same, std = kernel_distance(rng.standard_normal((300, 16)), real, subsets=20)
    assert abs(same) < 3 * std + 1e-3, f"same distribution: KID {same} should be 0 within its spread {std}"
    other, _ = kernel_distance(rng.standard_normal((300, 16)) + 0.5, real, subsets=20)
    assert other > 10 * max(std, 1e-4), "a shifted distribution is far"
    assert np.isfinite(kernel_distance(real[:2], real[2:4], subsets=1)[0]), "two rows a side are enough"
    with pytest.raises(ValueError, match="two feature rows"):
        kernel_distance(real[:1], real)


def test_at_small_n_kid_stays_unbiased_while_fid_does_not():
    rng = np.random.default_rng(2)
    real = rng.standard_normal((3000, 64))
    kids, fids = [], []
    for seed in range(8):
        sample = np.random.default_rng(100 + seed).standard_normal((40, 64))  # the same distribution as `real`
        kids.append(kernel_distance(sample, real, subsets=10, seed=seed)[0])
        fids.append(frechet_distance(sample, real))
    assert abs(np.mean(kids)) < 3 * np.std(kids) / np.sqrt(len(kids)) + 1e-3, "KID's mean is 0 at N = 40"
    assert min(fids) > 10, "FID of 40 samples from the very same distribution is far from 0"


def test_a_sample_too_small_for_fid_is_named():
    assert fid_warning(20, 256) is not None and "KID" in fid_warning(20, 256)
    assert fid_warning(1000, 256) is None and fid_warning(512, 256) is None and fid_warning(511, 256) is not None


def test_the_wilson_interval_holds_the_proportion_and_is_sound_at_the_ends():
    z = 1.959964
    assert wilson_interval(0, 10) == pytest.approx((0.0, z * z / (10 + z * z)))  # p = 0: [0, z²/(n + z²)]
    low, high = wilson_interval(10, 10)
    assert high == pytest.approx(1.0) and low == pytest.approx(10 / (10 + z * z))
    # exactly 0 and 1 at the ends, where the formula's rounding gives 3.5e-18 (n = 69) or 1 ± 2.2e-16 (n = 4, 20)
    assert all(wilson_interval(n, n)[1] == 1.0 and wilson_interval(0, n)[0] == 0.0 for n in range(1, 200))
    low, high = wilson_interval(970, 1000)
    assert low < 0.97 < high and high - low == pytest.approx(2 * z * (0.97 * 0.03 / 1000) ** 0.5, rel=0.05), \
        "near the normal interval where that one is sound"
    wide, narrow = (wilson_interval(9 * n // 10, n) for n in (100, 400))
    assert narrow[1] - narrow[0] == pytest.approx((wide[1] - wide[0]) / 2, rel=0.05), "half as wide at 4× the images"


def test_bootstrapped_fid_spreads_less_with_more_images_and_matches_the_seed_to_seed_spread():
    rng = np.random.default_rng(0)
    real = rng.standard_normal((4000, 8))

    def generated(n, seed):
        return np.random.default_rng(seed).standard_normal((n, 8)) * 1.1 + 0.2

    small, large = frechet_std(generated(200, 1), real), frechet_std(generated(800, 1), real)
    assert 0 < large < small * 0.7
    spread = np.std([frechet_distance(generated(200, seed), real) for seed in range(2, 42)])
    assert small == pytest.approx(spread, rel=0.5), "a bootstrap of one sample estimates the spread over samples"
    assert frechet_std(generated(200, 1), real) == small, "seeded: the same number every run"


def _brute_precision_recall(a, b, k):
    """The definition written out with a full distance matrix, no chunks and no subsampling."""
    def radii(x):
        d = np.sqrt(((x[:, None] - x[None]) ** 2).sum(-1))
        return np.sort(d, axis=1)[:, k]  # column 0 is the row itself

    def inside(x, centres, r):
        return (np.sqrt(((x[:, None] - centres[None]) ** 2).sum(-1)) <= r[None]).any(1).mean()

    return inside(a, b, radii(b)), inside(b, a, radii(a))


def test_precision_recall_equals_its_definition_across_chunks():
    from cardtool.core.evaluation import metrics

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((300, 5)) + 1.5, rng.standard_normal((300, 5))
    expected = _brute_precision_recall(a, b, 3)
    assert 0.1 < expected[0] < 0.9 and 0.1 < expected[1] < 0.9, "a case where both balls' tests matter"
    assert precision_recall(a, b) == pytest.approx(expected, abs=1e-12)
    assert precision_recall(a, b, k=5) == pytest.approx(_brute_precision_recall(a, b, 5), abs=1e-12)
    assert precision_recall(a / 100, b / 100) == pytest.approx(expected, abs=1e-12), "balls scale with the features"
    line, point = np.array([[0.0], [1.0], [2.0], [3.0]]), np.array([[4.0]])  # 4 lies on 3's ball (radius 1), inside
    assert metrics._inside(point, line, metrics._kth_neighbour_distances(line, line, 1, same=True)).all()
    radii = metrics._kth_neighbour_distances(a, a, 3, same=True, chunk=7)  # rows split across chunks
    assert np.allclose(radii, metrics._kth_neighbour_distances(a, a, 3, same=True))
    # a larger real side is drawn down to the generated side's size without repeats (a repeated row would be its
    # copy's nearest neighbour at distance 0, shrinking the balls)
    more = rng.standard_normal((500, 5))
    drawn = more[np.random.default_rng(0).choice(500, 300, replace=False)]
    assert precision_recall(a, more) == pytest.approx(_brute_precision_recall(a, drawn, 3), abs=1e-12)
    assert precision_recall(more, a) == pytest.approx(_brute_precision_recall(drawn, a, 3), abs=1e-12)  # either side


def test_precision_recall_tells_a_collapsed_sample_from_a_scattered_one():
    rng = np.random.default_rng(0)
    real = rng.standard_normal((5000, 16))
    same = precision_recall(rng.standard_normal((1000, 16)), real)
    collapsed = precision_recall(0.3 * rng.standard_normal((1000, 16)), real)  # the modes, not the spread
    scattered = precision_recall(3 * rng.standard_normal((1000, 16)), real)
    assert abs(same[0] - same[1]) < 0.1 and min(same) > 0.5
    assert collapsed[0] > 0.95 > same[0] and collapsed[1] < 0.1, "realistic, but the variety is lost"
    assert scattered[0] < 0.1 and scattered[1] > 0.95, "everything covered, little of it realistic"
    assert precision_recall(real[:3], real) is None, "k = 3 neighbours need more than 3 rows"


def test_precision_recall_compares_at_equal_size():
    """The real side is drawn down to the generated side's size: the radii shrink as a side grows, so 10,000 real rows
    against 1,000 generated would make a sample of the real distribution itself score precision < recall."""
    rng = np.random.default_rng(2)
    real = rng.standard_normal((10000, 8))
    scores = [precision_recall(rng.standard_normal((500, 8)), real, seed=s) for s in range(3)]
    assert all(abs(p - r) < 0.06 for p, r in scores), scores
