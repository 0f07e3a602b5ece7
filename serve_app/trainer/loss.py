"""The Flow-GRPO objective as pure tensor functions (names as in the paper / cleanRL)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached summaries of one loss evaluation (for logging)."""

    ratio_mean: float
    ratio_min: float
    ratio_max: float
    clip_frac: float
    approx_kl: float


def clipped_ratio_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-GRPO's clipped surrogate: mean(max(-A r, -A clip(r, 1 - e, 1 + e))), r = exp(logp - logp_old).

    Args:
        log_prob: [B] log-probs of the stored transitions under the current weights (differentiable).
        old_log_prob: [B] the rollout's log-probs (no grad).
        advantages: [B] advantages (already clamped).
        clip_range: e.
    Returns: (scalar loss, [B] ratio).
    """
    if not log_prob.shape == old_log_prob.shape == advantages.shape:
        raise ValueError(
            f"log_prob, old_log_prob and advantages must share a shape; got {tuple(log_prob.shape)}, "
            f"{tuple(old_log_prob.shape)}, {tuple(advantages.shape)}"
        )
    ratio = torch.exp(log_prob - old_log_prob.detach())
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(pg_loss1, pg_loss2).mean(), ratio


def loss_stats(log_prob: torch.Tensor, old_log_prob: torch.Tensor, ratio: torch.Tensor, clip_range: float) -> PolicyLossStats:
    """Ratio range, the clipped share and approx_kl = 0.5 mean((logp - logp_old)^2) (the reference's estimator)."""
    with torch.no_grad():
        r = ratio.detach()
        return PolicyLossStats(
            ratio_mean=float(r.mean()),
            ratio_min=float(r.min()),
            ratio_max=float(r.max()),
            clip_frac=float(((r - 1.0).abs() > clip_range).float().mean()),
            approx_kl=float(0.5 * ((log_prob.detach() - old_log_prob) ** 2).mean()),
        )
