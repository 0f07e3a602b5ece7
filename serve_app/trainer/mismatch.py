"""The rollout-vs-replay mismatch monitor, and truncated importance sampling (TIS) for engines that
are known to differ from the trainer.

Always on, at every step and any staleness: before the update, a sample of the batch's stored transitions
is replayed under no grad with the weights of the version that sampled it (the trainer keeps the last
``trainer.max_staleness + 1`` versions' trainable tensors and swaps them in for the check), and the
distribution of |log pi_behaviour_replay - log pi_rollout| over those transitions is logged (p50 / p99 /
max, metrics.csv columns ``mismatch_abs_log_ratio_*``, with ``mismatch_version``, ``mismatch_rows`` and
the check's cost ``mismatch_check_s``). The sample is ``trainer.mismatch.check_groups`` whole groups of
each rank's shard, drawn with the step's seed. Above ``trainer.mismatch.max_abs_log_ratio`` it warns, or
stops every rank before the step's first optimizer step (``action: stop``): a replica that serves other
weights than it was sent, kernels that drift, or a half-bound weight sync show here at every step, not
only at staleness 0.

Optional TIS (``trainer.mismatch.tis_cap``), after Yao et al. 2025 ("Your efficient RL framework
secretly brings you off-policy RL training"): the same replay, of every row, gives the trainer's own
log-prob of the batch under the behaviour version's weights, the PPO ratio is taken against it,
``r = exp(logp_new - logp_trainer_old)``, and each transition's loss is weighted by

    w = min(exp(logp_trainer_old - logp_rollout), cap)

i.e. what is truncated is the importance weight of the trainer's behaviour policy over the rollout
engine's policy for that one transition (not the PPO ratio, which keeps its own clip). ``w`` > 0
multiplies the advantage: max(-wA r, -wA clip(r)) = w max(-A r, -A clip(r)), so the clipped loss is
unchanged in form.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

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
    """One per trainer; per update: ``check`` (before any optimizer step) -> ``correct`` (each loss) -> ``end``.

    Args:
        max_abs_log_ratio: the bound on |log pi_behaviour_replay - log pi_rollout| of any checked transition.
        action: "warn" (log and go on) or "stop" (raise RolloutMismatchError before the optimizer step).
        tis_cap: the TIS truncation C; None = no correction.
        check_groups: whole groups (prompts) of each rank's shard replayed per update, or "all" rows. With
            TIS every row is replayed, whatever this says.
    """

    def __init__(self, *, max_abs_log_ratio: float, action: MismatchAction = "warn", tis_cap: float | None = None,
                 check_groups: int | Literal["all"] = 1) -> None:
        if action not in ("warn", "stop"):
            raise ValueError(f"mismatch action must be 'warn' or 'stop'; got {action!r}")
        if check_groups != "all" and (not isinstance(check_groups, int) or check_groups < 1):
            raise ValueError(f"check_groups must be a number of groups >= 1 or 'all'; got {check_groups!r}")
        self.bound = max_abs_log_ratio
        self.action = action
        self.tis_cap = tis_cap
        self.check_groups = check_groups
        self._reset()

    def _reset(self) -> None:
        self._observed = torch.zeros((0, 0))  # [rows of every rank, K] log ratios of the last check
        self._version: int | None = None
        self._seconds = math.nan
        self._weights: list[torch.Tensor] = []
        self._trainer_old: torch.Tensor | None = None

    def check_rows(self, trajectory: Trajectory, *, seed: int) -> torch.Tensor:
        """The rows `check` replays, in batch order: all of them with TIS or check_groups "all", else the
        rows of `check_groups` whole groups (prompt_index) drawn with `seed` (the same seed, the same rows)."""
        if self.tis_cap is not None or self.check_groups == "all":
            return torch.arange(len(trajectory))
        prompt_index = trajectory.prompt_index.cpu()
        groups = prompt_index.unique()
        order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))
        return torch.isin(prompt_index, groups[order[: self.check_groups]]).nonzero().flatten()

    @torch.no_grad()
    def check(self, policy: DiffusionPolicy, trajectory: Trajectory, *, seed: int, micro_batch_size: int,
              behaviour: AbstractContextManager[Any] | None = None,
              gather: Callable[[torch.Tensor], list[torch.Tensor]] = lambda local: [local]) -> None:
        """Start an update: replay `check_rows` while `behaviour` holds the weights of the version that sampled
        the batch (None: the policy holds them already), and compare with the rollout's log-probs. `gather`
        exchanges every rank's log ratios, so each rank sees all of them and all stop together.

        Raises:
            RolloutMismatchError: with action "stop", when a checked transition exceeds the bound on any rank.
        """
        self._reset()
        started = time.perf_counter()
        rows = self.check_rows(trajectory, seed=seed)
        with behaviour if behaviour is not None else nullcontext():
            replayed = replay_log_probs(policy, trajectory, rows=rows, micro_batch_size=micro_batch_size)
        if self.tis_cap is not None:
            self._trainer_old = replayed  # every row, in order: the old log-probs of the clipped ratio
        local = replayed - trajectory.log_probs[rows].float().cpu()
        self._observed = torch.cat(gather(local))
        self._version = trajectory.policy_version
        self._seconds = time.perf_counter() - started
        summary = summarize_log_ratios(self._observed)
        if self.action == "stop" and summary.count and not summary.max <= self.bound:
            raise RolloutMismatchError(self._message(summary))

    def correct(self, rows: torch.Tensor, k: int, rollout_log_prob: torch.Tensor,
                advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The old log-prob and advantages the clipped loss uses for window step k of `rows`: unchanged
        without TIS; with it, the trainer's behaviour-version log-prob and the advantages times the TIS weight."""
        if self._trainer_old is None or self.tis_cap is None:
            return rollout_log_prob, advantages
        trainer_old = self._trainer_old[rows.cpu(), k].to(rollout_log_prob.device)
        weight = truncated_is_weight(trainer_old, rollout_log_prob, self.tis_cap)
        self._weights.append(weight.cpu())
        return trainer_old, advantages * weight.to(advantages.device)

    def end(self) -> dict[str, float]:
        """The update's metrics.csv columns (NaN where nothing was checked); warns when the check exceeded
        the bound. Clears the update's state."""
        summary = summarize_log_ratios(self._observed)
        if summary.count and not summary.max <= self.bound:
            logger.warning(self._message(summary))
        weights = torch.cat(self._weights) if self._weights else torch.zeros(0)
        row = {
            "mismatch_abs_log_ratio_p50": summary.p50,
            "mismatch_abs_log_ratio_p99": summary.p99,
            "mismatch_abs_log_ratio_max": summary.max,
            "mismatch_version": math.nan if self._version is None else float(self._version),
            "mismatch_rows": float(self._observed.shape[0]) if summary.count else math.nan,
            "mismatch_check_s": self._seconds,
        }
        if self.tis_cap is not None:
            row["tis_weight_mean"] = float(weights.mean()) if weights.numel() else math.nan
            row["tis_truncated_frac"] = (
                float((weights >= self.tis_cap * (1 - 1e-6)).float().mean()) if weights.numel() else math.nan
            )
        self._reset()
        return row

    def _message(self, summary: LogRatioSummary) -> str:
        return (
            f"rollout-vs-replay mismatch: replayed with the weights of policy version {self._version}, "
            f"|log pi_behaviour_replay - log pi_rollout| p50 {summary.p50:.3g}, p99 {summary.p99:.3g}, max "
            f"{summary.max:.3g} over {summary.count} transitions exceeds trainer.mismatch.max_abs_log_ratio "
            f"{self.bound:.3g}; the rollout engine's weights, precision or kernels differ from the trainer's (for "
            "an engine known to differ, set trainer.mismatch.tis_cap)"
        )
