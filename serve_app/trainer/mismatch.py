"""The rollout-vs-replay mismatch monitor, and truncated importance sampling (TIS) for engines that
are known to differ from the trainer.

Always on: on the first replay of a rollout (before any optimizer step, at staleness 0) the trainer's
log-prob of each stored transition is compared with the rollout engine's, and the distribution of
|log pi_trainer - log pi_rollout| over the batch's transitions is logged (p50 / p99 / max, metrics.csv
columns ``mismatch_abs_log_ratio_*``). Above ``trainer.mismatch.max_abs_log_ratio`` it warns, or
stops before the first optimizer step (``action: stop``).

Optional TIS (``trainer.mismatch.tis_cap``), after Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training"): the PPO ratio is taken against the trainer's own
log-prob of the batch before the update, ``r = exp(logp_new - logp_trainer_old)``, and each
transition's loss is weighted by

    w = min(exp(logp_trainer_old - logp_rollout), cap)

i.e. what is truncated is the importance weight of the trainer's pre-update policy over the rollout
engine's policy for that one transition (not the PPO ratio, which keeps its own clip). ``w`` > 0
multiplies the advantage: max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)), so the clipped loss is
unchanged in form.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Literal

import torch

from serve_app.flowgrpo.ratios import LogRatioSummary, replay_log_probs, summarize_log_ratios

if TYPE_CHECKING:
    from serve_app.policies.base import DiffusionPolicy
    from serve_app.schemas import Trajectory

logger = logging.getLogger(__name__)

MismatchAction = Literal["warn", "stop"]


class RolloutMismatchError(RuntimeError):
    """The rollout engine's log-probs differ from the trainer's replay by more than the configured bound."""


def truncated_is_weight(trainer_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """w = min(exp(logp_trainer_old - logp_rollout), cap), no grad; [B] -> [B]."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0; got {cap}")
    log_w = (trainer_log_prob.detach().float() - rollout_log_prob.detach().float()).clamp(max=math.log(cap))
    return torch.exp(log_w)


class MismatchMonitor:
    """One per trainer; per update: ``begin`` -> ``observe`` (first replays) / ``correct`` (each loss) -> ``end``.

    Args:
        max_abs_log_ratio: the bound on |log pi_trainer - log pi_rollout| of any first-replay transition.
        action: "warn" (log and go on) or "stop" (raise RolloutMismatchError before the optimizer step).
        tis_cap: the TIS truncation C; None = no correction.
    """

    def __init__(self, *, max_abs_log_ratio: float, action: MismatchAction = "warn", tis_cap: float | None = None) -> None:
        if action not in ("warn", "stop"):
            raise ValueError(f"mismatch action must be 'warn' or 'stop'; got {action!r}")
        self.bound = max_abs_log_ratio
        self.action = action
        self.tis_cap = tis_cap
        self._observed: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []
        self._trainer_old: torch.Tensor | None = None

    @torch.no_grad()
    def begin(self, policy: DiffusionPolicy, trajectory: Trajectory, *, micro_batch_size: int) -> None:
        """Start an update; with TIS, replay the whole batch once under the pre-update weights."""
        self._observed, self._weights, self._trainer_old = [], [], None
        if self.tis_cap is None:
            return
        self._trainer_old = replay_log_probs(policy, trajectory, micro_batch_size=micro_batch_size)

    def observe(self, replay_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> None:
        """A first replay (before any optimizer step): record its log ratios; with action "stop", raise
        as soon as one exceeds the bound."""
        log_ratio = (replay_log_prob.detach().float() - rollout_log_prob.detach().float()).cpu()
        self._observed.append(log_ratio)
        if self.action == "stop":
            summary = summarize_log_ratios(log_ratio)
            if not summary.max <= self.bound:
                raise RolloutMismatchError(self._message(summarize_log_ratios(torch.cat(self._observed))))

    def correct(self, rows: torch.Tensor, k: int, rollout_log_prob: torch.Tensor,
                advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The old log-prob and advantages the clipped loss uses for window step k of `rows`: unchanged
        without TIS; with it, the trainer's pre-update log-prob and the advantages times the TIS weight."""
        if self._trainer_old is None or self.tis_cap is None:
            return rollout_log_prob, advantages
        trainer_old = self._trainer_old[rows.cpu(), k].to(rollout_log_prob.device)
        weight = truncated_is_weight(trainer_old, rollout_log_prob, self.tis_cap)
        self._weights.append(weight.cpu())
        return trainer_old, advantages * weight.to(advantages.device)

    def end(self) -> dict[str, float]:
        """The update's metrics.csv columns; warns when the first replay exceeded the bound."""
        observed = torch.cat(self._observed) if self._observed else torch.zeros(0)
        summary = summarize_log_ratios(observed)
        if summary.count and not summary.max <= self.bound:
            logger.warning(self._message(summary))
        weights = torch.cat(self._weights) if self._weights else torch.zeros(0)
        row = {
            "mismatch_abs_log_ratio_p50": summary.p50,
            "mismatch_abs_log_ratio_p99": summary.p99,
            "mismatch_abs_log_ratio_max": summary.max,
        }
        if self.tis_cap is not None:
            row["tis_weight_mean"] = float(weights.mean()) if weights.numel() else math.nan
            row["tis_truncated_frac"] = (
                float((weights >= self.tis_cap * (1 - 1e-6)).float().mean()) if weights.numel() else math.nan
            )
        return row

    def _message(self, summary: LogRatioSummary) -> str:
        return (
            f"rollout-vs-replay mismatch: |log pi_trainer - log pi_rollout| p50 {summary.p50:.3g}, p99 "
            f"{summary.p99:.3g}, max {summary.max:.3g} over {summary.count} first-replay transitions exceeds "
            f"trainer.mismatch.max_abs_log_ratio {self.bound:.3g}; the rollout engine's weights, precision or "
            "kernels differ from the trainer's (for an engine known to differ, set trainer.mismatch.tis_cap)"
        )
