"""Statistics of a run's figures: per-step figures against their own step-to-step noise, and the
intervals of evaluation accuracies and of their paired changes (over images, and over prompts)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np
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


def z_value(confidence: float) -> float:
    """The two-sided standard-normal quantile of a confidence level (1.96 for 0.95)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1); got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion: unlike p +- z·se it stays inside [0, 1] and does not
    collapse to a point at 0 or n successes, which small evaluations often hit."""
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1; got {successes} of {trials}")
    z2 = z_value(confidence) ** 2
    p = successes / trials
    centre = (p + z2 / (2 * trials)) / (1 + z2 / trials)
    half = math.sqrt(z2) / (1 + z2 / trials) * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials**2))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap_interval(values: Sequence[float], *, confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(values), resampling the values with replacement.

    For a paired comparison pass the per-item differences (after - before): each pair stays
    together. Seeded: the same values give the same interval.
    """
    return cluster_bootstrap_interval(values, range(len(values)), confidence=confidence, resamples=resamples,
                                      seed=seed)


def cluster_bootstrap_interval(values: Sequence[float], clusters: Sequence[Hashable], *, confidence: float = 0.95,
                               resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(values), resampling whole clusters with replacement: each
    resample draws as many clusters as there are, each with all its values, and takes the mean of the
    values drawn. `clusters[i]` names the cluster of `values[i]`.

    Values of one cluster are not independent draws (the seeds of one prompt share the prompt's
    difficulty); resampling them together asks what other clusters would give, e.g. unseen prompts for
    prompt clusters. One value a cluster is the plain bootstrap (`bootstrap_interval`). Seeded.

    Raises:
        ValueError: no values, or not one cluster per value.
    """
    if not len(values):
        raise ValueError("no values to resample")
    if len(clusters) != len(values):
        raise ValueError(f"{len(values)} values but {len(clusters)} cluster names: one a value")
    number = {name: i for i, name in enumerate(dict.fromkeys(clusters))}
    member = np.fromiter((number[name] for name in clusters), dtype=np.int64, count=len(clusters))
    sums = np.bincount(member, weights=np.asarray(values, dtype=np.float64))
    sizes = np.bincount(member)
    picks = np.random.default_rng(seed).integers(0, len(sums), size=(resamples, len(sums)))
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(sums[picks].sum(axis=1) / sizes[picks].sum(axis=1), [tail, 100 - tail])
    return float(lo), float(hi)
