"""The trainer's objectives as pure tensor functions (names as in the papers / cleanRL).

- Flow-GRPO, MixGRPO, DanceGRPO: the clipped ratio surrogate (`clipped_ratio_loss`); the algorithms differ in
  what they sample (serve_app.trainer.algorithms), not in this loss.
- GRPO-Guard (Wang et al. 2025, arXiv 2510.22319), with any of them: RatioNorm (`ratio_norm_log_ratio`) changes
  the ratio the surrogate clips, and the step re-weighting (`grpo_guard_step_weight`) each window step's loss.
- DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): the forward-process loss (`nft_loss`) over velocities,
  with r from the advantages (`nft_optimality`); no ratio, no per-step log-probs.
"""

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
    return clipped_surrogate(ratio, advantages, clip_range), ratio


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_range: float) -> torch.Tensor:
    """mean(max(-A r, -A clip(r, 1 - e, 1 + e))) of [B] ratios r (differentiable) and advantages A."""
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(pg_loss1, pg_loss2).mean()


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


# -- GRPO-Guard ------------------------------------------------------------------------------------------


def ratio_norm_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                         old_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """GRPO-Guard's RatioNorm: the log of the normalised ratio of one window step, [B].

    For a Gaussian step x ~ N(mu_old, s^2) (s = sigma_t sqrt(|dt|), the step's std), the per-dimension mean
    log ratio splits into a bias that is never positive and a zero-mean term whose spread grows as s shrinks:

        log r = log p_theta(x) - log p_old(x) = -b + mean_d[(mu_theta - mu_old) eps] / s,
        b = mean_d[(mu_theta - mu_old)^2] / (2 s^2),   eps = (x - mu_old) / s.

    RatioNorm adds the bias back and scales by s, so the log ratio has mean 0 and the same spread at every step:

        log r_norm = s (log r + b)   (= mean_d[(mu_theta - mu_old) eps]),   r_norm = exp(log r_norm),

    which is what the clipped surrogate then clips. It needs the Gaussian log-density with its 1 / (2 s^2) scale
    (sde_type "sde"; "cps" drops it, see serve_app.flowgrpo.sde). At mu_theta = mu_old it is 0: ratio 1.

    Args:
        log_prob: [B] log-probs of the stored transitions under the current weights (differentiable).
        old_log_prob: [B] their log-probs under the behaviour policy (no grad).
        mean: [B, ...] the current weights' transition means mu_theta (differentiable).
        old_mean: [B, ...] the behaviour policy's means mu_old (no grad).
        std: [B] the step's standard deviation s > 0 (the same under both policies).
    Returns: [B] log r_norm.
    """
    if not log_prob.shape == old_log_prob.shape == std.shape or mean.shape != old_mean.shape:
        raise ValueError(
            f"log_prob, old_log_prob and std must be [B] and mean, old_mean share a shape; got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(std.shape)}, {tuple(mean.shape)}, "
            f"{tuple(old_mean.shape)}"
        )
    if not bool((std > 0).all()):
        raise ValueError("RatioNorm needs a stochastic step (std > 0) at every row")
    bias = ((mean - old_mean.detach()) ** 2).flatten(1).mean(dim=1) / (2.0 * std**2)
    return std * (log_prob - old_log_prob.detach() + bias)


def grpo_guard_step_weight(sigmas: torch.Tensor, step: int) -> float:
    """GRPO-Guard's gradient re-weighting: step `step`'s loss is multiplied by 1 / |dt|, dt = sigma[step + 1] -
    sigma[step]. The transition mean moves with the velocity by |dt| (mu = x + (...) v dt), so the normalised
    ratio's gradient is proportional to |dt|; dividing by it gives every window step the same share of the update
    whatever its step size. `sigmas`: the [N + 1] schedule."""
    dt = float(sigmas[step]) - float(sigmas[step + 1])
    if not dt > 0:
        raise ValueError(f"sigmas must decrease at step {step}; got {float(sigmas[step])} -> {float(sigmas[step + 1])}")
    return 1.0 / dt


# -- DiffusionNFT ----------------------------------------------------------------------------------------


def nft_optimality(advantages: torch.Tensor, advantage_clip: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = 1/2 + 1/2 clip(A / advantage_clip, -1, 1) in [0, 1], [B] -> [B]
    (no grad): 1 is all positive, 0 all negative, 1/2 (an average sample) neither."""
    if advantage_clip <= 0:
        raise ValueError(f"advantage_clip must be > 0; got {advantage_clip}")
    return 0.5 + 0.5 * torch.clamp(advantages.detach().float() / advantage_clip, -1.0, 1.0)


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_target: torch.Tensor, r: torch.Tensor, *, beta: float,
             t: torch.Tensor | None = None) -> torch.Tensor:
    """DiffusionNFT's negative-aware forward-process loss at x_t = (1 - t) x0 + t eps, v_target = eps - x0:

        v+ = (1 - beta) v_old + beta v_theta,    v- = (1 + beta) v_old - beta v_theta,
        L = mean_B[ r ||v+ - v_target||^2 + (1 - r) ||v- - v_target||^2 ],

    ||.||^2 the mean over the non-batch dims. With `t`, each term is the paper's adaptive weighting instead, in
    x0 space: with x0_hat = x_t - t v (so x0_hat - x0 = -t (v - v_target)), ||x0_hat - x0||^2 /
    sg(max(mean_d |x0_hat - x0|, 1e-5)), sg = no gradient.

    Args:
        v_theta: [B, ...] the trained velocity (differentiable).
        v_old: [B, ...] the sampling (old) policy's velocity at the same x_t (no grad).
        v_target: [B, ...] eps - x0.
        r: [B] optimality probabilities in [0, 1] (nft_optimality).
        beta: the guidance strength of the implicit policies (> 0).
        t: [B] the forward times, for the adaptive weighting; None = the plain squared error.
    Returns: the scalar loss.
    """
    if not v_theta.shape == v_old.shape == v_target.shape or r.shape != v_theta.shape[:1]:
        raise ValueError(
            f"v_theta, v_old, v_target must share a shape [B, ...] and r be [B]; got {tuple(v_theta.shape)}, "
            f"{tuple(v_old.shape)}, {tuple(v_target.shape)}, {tuple(r.shape)}"
        )
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    v_old = v_old.detach()
    positive = _flow_matching_error((1.0 - beta) * v_old + beta * v_theta, v_target, t)
    negative = _flow_matching_error((1.0 + beta) * v_old - beta * v_theta, v_target, t)
    return (r * positive + (1.0 - r) * negative).mean()


def _flow_matching_error(v: torch.Tensor, v_target: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """[B] mean squared velocity error, or its adaptive x0-space form when `t` is given."""
    # At least fp32: the loss of a bf16 model is a small difference of its velocities.
    dtype = torch.promote_types(v.dtype, torch.float32)
    error = (v.to(dtype) - v_target.to(dtype)).flatten(1)
    squared = (error**2).mean(dim=1)
    if t is None:
        return squared
    t = t.to(dtype)
    scale = (t * error.abs().mean(dim=1)).detach().clamp_min(1e-5)
    return t**2 * squared / scale
