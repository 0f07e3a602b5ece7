"""Welch's t on hand-computed values."""

import math

import pytest

from serve_app.trainer.statistics import first_and_last, welch_t


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
