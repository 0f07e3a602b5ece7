"""Statistics of a run's per-step figures, measured against their own step-to-step noise."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def welch_t(before: Sequence[float], after: Sequence[float]) -> float:
    """Welch's t statistic of mean(after) - mean(before), each sample with its own variance.

    Raises:
        ValueError: fewer than two values on a side (no variance to measure against).
    """
    if len(before) < 2 or len(after) < 2:
        raise ValueError(f"Welch's t needs at least 2 values a side; got {len(before)} and {len(after)}")
    a, b = torch.tensor(before, dtype=torch.float64), torch.tensor(after, dtype=torch.float64)
    return float((b.mean() - a.mean()) / (a.var() / len(a) + b.var() / len(b)).sqrt())


def first_and_last(values: Sequence[float], *, share: float = 0.25) -> tuple[list[float], list[float]]:
    """The first and the last `share` of `values` (at least 2 each), for comparing the start of a run to its end."""
    k = max(2, int(len(values) * share))
    return list(values[:k]), list(values[-k:])
