"""Welch's t, Wilson intervals and the bootstrap on hand-computed values."""

import math

import numpy as np
import pytest

from serve_app.trainer.statistics import (
    bootstrap_interval,
    cluster_bootstrap_interval,
    first_and_last,
    welch_t,
    wilson_interval,
    z_value,
)


def test_welch_t_on_hand_values():
    # means 2 and 5, sample variances 1 and 1, n = 3 each: t = 3 / sqrt(1/3 + 1/3)
    assert welch_t([1, 2, 3], [4, 5, 6]) == pytest.approx(3 / math.sqrt(2 / 3))
    # unequal variances and sizes: means 1 and 4, variances 0.5 and 4 -> 3 / sqrt(0.5/2 + 4/3)
    assert welch_t([0.5, 1.5], [2, 4, 6]) == pytest.approx(3 / math.sqrt(0.25 + 4 / 3))
    assert welch_t([4, 5, 6], [1, 2, 3]) < 0
    with pytest.raises(ValueError, match="at least 2"):
        welch_t([1], [2, 3])


def test_first_and_last_quarter():
    assert first_and_last(list(range(16))) == ([0, 1, 2, 3], [12, 13, 14, 15])
    assert first_and_last([1, 2, 3]) == ([1, 2], [2, 3])  # at least two a side


def test_z_value():
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6)
    assert z_value(0.5) == pytest.approx(0.674490, abs=1e-6)
    with pytest.raises(ValueError, match="confidence"):
        z_value(1.0)


def test_wilson_interval_on_hand_values():
    # 8 of 10, z^2 = 3.841459: centre (0.8 + 0.192073) / 1.384146 = 0.716740,
    # half 1.959964 / 1.384146 * sqrt(0.016 + 0.0096036) = 0.226577
    assert wilson_interval(8, 10) == pytest.approx((0.490163, 0.943317), abs=1e-6)
    # None of 10: the interval keeps a width, 0 to 2 * 0.192073 / 1.384146
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277533), abs=1e-6)
    assert wilson_interval(10, 10) == pytest.approx((0.722467, 1.0), abs=1e-6)
    # 50%: symmetric, and narrower with more trials (18 of 56 vs 144 of 448, the same 32.1%)
    lo, hi = wilson_interval(5, 10)
    assert 0.5 - lo == pytest.approx(hi - 0.5)
    assert np.subtract(*wilson_interval(144, 448)[::-1]) < np.subtract(*wilson_interval(18, 56)[::-1]) / 2.5
    for bad in ((11, 10), (-1, 10), (0, 0)):
        with pytest.raises(ValueError, match="successes"):
            wilson_interval(*bad)


def test_bootstrap_interval_on_hand_values():
    # [0, 1]: a resample's mean is 0, 1/2 or 1 (chances 1/4, 1/2, 1/4), so the 2.5% and 97.5%
    # percentiles of 2000 resamples are 0 and 1.
    assert bootstrap_interval([0, 1]) == (0.0, 1.0)
    assert bootstrap_interval([0.25] * 7) == (0.25, 0.25)  # nothing varies
    # Seeded: the same values give the same interval.
    values = [0, 1, 1, 0, 1, 1, 1, 0]
    assert bootstrap_interval(values) == bootstrap_interval(values)
    with pytest.raises(ValueError, match="no values"):
        bootstrap_interval([])


def test_bootstrap_interval_matches_the_normal_one_on_a_large_sample():
    # 200 ones and 200 zeros: standard error sqrt(0.25 / 400) = 0.025, 95% half-width 0.049. The
    # percentile bootstrap's Monte Carlo error at 2000 resamples is ~0.0015, its grid 1/400.
    lo, hi = bootstrap_interval([1.0] * 200 + [0.0] * 200)
    assert (hi - lo) / 2 == pytest.approx(1.959964 * 0.025, abs=0.006)
    assert (lo + hi) / 2 == pytest.approx(0.5, abs=0.006)


def test_the_prompt_level_interval_is_wider_when_prompts_differ_and_close_when_they_do_not():
    rng = np.random.default_rng(0)
    prompts = [f"prompt {p}" for p in range(14) for _ in range(32)]  # 14 prompts x 32 seeds, as held out

    def widths(values):
        lo, hi = bootstrap_interval(values)
        prompt_lo, prompt_hi = cluster_bootstrap_interval(values, prompts)
        assert prompt_lo <= np.mean(values) <= prompt_hi
        return hi - lo, prompt_hi - prompt_lo

    # Each prompt's change is its own (spread 0.3), and its seeds agree to within 0.01: the 448 images are
    # 14 draws, not 448, and resampling prompts says so (sqrt(32) ~ 5.7 times as wide).
    effect = np.repeat(rng.normal(0.1, 0.3, 14), 32)
    image, prompt = widths(effect + rng.normal(0, 0.01, 448))
    assert prompt > 3 * image
    # No prompt effect: the seeds are independent whatever prompt they belong to, and the intervals agree on
    # average. One data set's prompt-level width is itself estimated from 14 prompts: 0.6 to 1.4 times the other.
    ratios = [prompt / image for image, prompt in map(widths, rng.normal(0.1, 0.3, (20, 448)))]
    assert 0.85 < np.mean(ratios) < 1.15, ratios


def test_the_cluster_bootstrap_on_hand_values():
    values = [0, 1, 1, 0, 1, 1, 1, 0]
    # One value a cluster is the plain bootstrap; clusters are named by anything hashable.
    assert cluster_bootstrap_interval(values, list("abcdefgh")) == bootstrap_interval(values)
    # Two clusters, each always 0 or always 1: a resample's mean is 0, 1/2 or 1 as for two values.
    assert cluster_bootstrap_interval([0, 0, 0, 1, 1, 1], ["x", "x", "x", "y", "y", "y"]) == (0.0, 1.0)
    # Clusters [2] and [0, 0, 0]: a resample holds both (mean 2/4, chance 1/2), the first twice (2) or the second
    # twice (0). The mean is over values, not over cluster means (which would put the middle at 1).
    assert cluster_bootstrap_interval([2, 0, 0, 0], [1, 2, 2, 2]) == (0.0, 2.0)
    assert cluster_bootstrap_interval([2, 0, 0, 0], [1, 2, 2, 2], confidence=0.4) == (0.5, 0.5)
    with pytest.raises(ValueError, match="one a value"):
        cluster_bootstrap_interval([0, 1], ["a"])
    with pytest.raises(ValueError, match="no values"):
        cluster_bootstrap_interval([], [])
