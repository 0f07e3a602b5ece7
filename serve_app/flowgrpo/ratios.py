"""How far a replay of stored transitions is from the rollout that recorded them: the log ratios
log pi_replay - log pi_rollout of a trajectory's window steps, and their summary.

The engine contract's ratio-1 check and the trainer's rollout-vs-replay monitor both measure it here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from serve_app.flowgrpo.sampler import SamplingPolicy, replay_step
from serve_app.schemas import Trajectory


@dataclass(frozen=True)
class LogRatioSummary:
    """Quantiles of |log ratio| over a set of transitions (NaN when there are none)."""

    p50: float
    p99: float
    max: float
    count: int


def summarize_log_ratios(log_ratios: torch.Tensor) -> LogRatioSummary:
    """p50 / p99 / max of |log_ratios| (any shape); a non-finite value makes every quantile inf."""
    values = log_ratios.detach().abs().flatten().double().cpu()
    if values.numel() == 0:
        return LogRatioSummary(math.nan, math.nan, math.nan, 0)
    if not bool(torch.isfinite(values).all()):
        return LogRatioSummary(math.inf, math.inf, math.inf, values.numel())
    q = torch.quantile(values, torch.tensor([0.5, 0.99], dtype=torch.float64))
    return LogRatioSummary(float(q[0]), float(q[1]), float(values.max()), values.numel())


@torch.no_grad()
def replay_log_probs(policy: SamplingPolicy, trajectory: Trajectory, *, rows: torch.Tensor | None = None,
                     micro_batch_size: int | None = None) -> torch.Tensor:
    """log pi(x_{k+1} | x_k) of every window step of `rows` (default all), replayed on `policy` with
    the code the rollout ran; [len(rows), K] float32 on the CPU, in micro-batches of `micro_batch_size` rows."""
    index = torch.arange(len(trajectory)) if rows is None else rows
    window = trajectory.log_probs.shape[1]
    replayed = torch.empty((len(index), window), dtype=torch.float32)
    parts = torch.arange(len(index)).split(micro_batch_size or max(len(index), 1))
    for part in parts:
        for k in range(window):
            replayed[part, k] = replay_step(policy, trajectory, k, rows=index[part]).log_prob.float().cpu()
    return replayed
