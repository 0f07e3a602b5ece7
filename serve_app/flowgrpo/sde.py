"""The one implementation of a stochastic flow-matching step and its log-probability.

Convention (diffusers ``FlowMatchEulerDiscreteScheduler``): ``x_t = (1 - t) x0 + t eps``, sigma runs
from 1 to 0, the model predicts ``v ~ eps - x0`` and ``dt = sigma_next - sigma < 0``.

The rollout sampler calls :func:`sde_step` without ``prev_sample`` (sample and score); the trainer
calls it with the stored ``prev_sample`` (score only). Both paths run the same lines, so an
on-policy ratio is exactly 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

SDEType = Literal["sde", "cps", "dance", "ode"]
SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance", "ode")
ODESolver = Literal["euler", "dpm2m"]
ODE_SOLVERS: tuple[str, ...] = ("euler", "dpm2m")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStepResult:
    """What one step produced.

    prev_sample: [B, ...] the next latent, in the input dtype.
    log_prob:    [B] float32, mean over all non-batch dims of the Gaussian log-density
                 (zeros for a deterministic step).
    mean:        [B, ...] float32 mean of the transition.
    std:         [B, 1, ...] float32 standard deviation of the transition (zeros when deterministic).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _as_batch_column(value: float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """A sigma as float32 [B, 1, ..., 1] (or [1, ..., 1]) broadcastable against ``like``."""
    column = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if column.ndim == 0:
        return column.reshape([1] * like.ndim)
    if column.ndim == 1 and column.shape[0] in (1, like.shape[0]):
        return column.reshape([-1] + [1] * (like.ndim - 1))
    if column.ndim == like.ndim:
        return column
    raise ValueError(
        f"{name} must be a float, a [B] tensor or broadcastable to the sample; got shape {tuple(column.shape)} "
        f"for a sample of shape {tuple(like.shape)}"
    )


def draw_noise(
    shape: torch.Size | Sequence[int],
    generator: torch.Generator | Sequence[torch.Generator] | None,
    *,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Standard normal float32 noise; one generator per sample makes each row depend on its own seed only.

    Noise is drawn on the generator's device and then moved, so a CPU generator gives the same
    numbers whether the model runs on a CPU or a GPU.
    """
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        return torch.randn(tuple(shape), generator=generator, device=gen_device).to(device)
    generators = list(generator)
    if len(generators) != shape[0]:
        raise ValueError(f"generator: got {len(generators)} generators for a batch of {shape[0]}")
    rows = [torch.randn(tuple(shape[1:]), generator=g, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


def sde_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    sde_type: SDEType = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
) -> SDEStepResult:
    """One step from ``sigma`` to ``sigma_next``: sample ``prev_sample`` (or score the given one).

    Args:
        velocity: [B, ...] the model's (CFG-combined) velocity at ``sample``.
        sample: [B, ...] the current latent x_sigma.
        sigma, sigma_next: floats or tensors broadcastable over the batch, ``sigma_next < sigma``.
        noise_level: the ``a`` of Flow-GRPO (>= 0); 0 gives the deterministic Euler step.
        sde_type: ``"sde"`` (Flow-SDE), ``"cps"`` (coefficients-preserving), ``"dance"`` (DanceGRPO's step:
            Euler plus the score drift, std ``a sqrt(|dt|)``) or ``"ode"`` (Euler).
        prev_sample: when given, it is scored instead of sampled (the trainer's recomputation).
        generator: one generator, or one per sample so each row's noise depends on its seed only.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}; got {sde_type!r}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0; got {noise_level}")
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity shape {tuple(velocity.shape)} does not match sample shape {tuple(sample.shape)}"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample shape {tuple(prev_sample.shape)} does not match sample shape {tuple(sample.shape)}"
        )
    sigma_t = _as_batch_column(sigma, sample, "sigma")
    sigma_n = _as_batch_column(sigma_next, sample, "sigma_next")
    if bool((sigma_n >= sigma_t).any()):
        raise ValueError(
            f"sigma_next must be < sigma (sigma runs from 1 to 0); got sigma={sigma}, sigma_next={sigma_next}"
        )

    # Upcast: the log-density of a small step is a difference of nearly equal numbers, and a bf16
    # mean would move the ratio by more than the clip range.
    x = sample.float()
    v = velocity.float()
    dt = sigma_n - sigma_t

    if sde_type == "ode" or noise_level == 0:
        mean = x + v * dt
        std = torch.zeros_like(sigma_t.expand(x.shape[:1] + (1,) * (x.ndim - 1)))
        out = mean.to(sample.dtype) if prev_sample is None else prev_sample
        return SDEStepResult(out, torch.zeros(x.shape[0], device=x.device), mean, std)

    if sde_type == "sde":
        # At sigma == 1 the marginal has no signal left and 1 - sigma == 0; the next sigma keeps it finite.
        sigma_for_denominator = torch.where(sigma_t >= 1.0, sigma_n, sigma_t)
        std_dev_t = noise_level * torch.sqrt(sigma_t / (1.0 - sigma_for_denominator))
        mean = (
            x * (1.0 + std_dev_t**2 / (2.0 * sigma_t) * dt)
            + v * (1.0 + std_dev_t**2 * (1.0 - sigma_t) / (2.0 * sigma_t)) * dt
        )
        std = std_dev_t * torch.sqrt(-dt)
    elif sde_type == "dance":
        # DanceGRPO (Xue et al. 2025, arXiv 2505.07818): the score of x_sigma = (1 - sigma) x0 + sigma eps is
        # -eps_hat / sigma, and x - (1 - sigma) x0_hat = sigma eps_hat; the drift adds -a^2/2 score dt.
        x0_hat = x - sigma_t * v
        score = -(x - (1.0 - sigma_t) * x0_hat) / sigma_t**2
        mean = x + v * dt - 0.5 * noise_level**2 * score * dt
        std = noise_level * torch.sqrt(-dt)
    else:  # cps
        std = sigma_n * math.sin(noise_level * math.pi / 2.0)
        x0_hat = x - sigma_t * v
        x1_hat = x + (1.0 - sigma_t) * v
        mean = (1.0 - sigma_n) * x0_hat + torch.sqrt((sigma_n**2 - std**2).clamp_min(0.0)) * x1_hat
    std = std.expand(x.shape[:1] + (1,) * (x.ndim - 1))

    if prev_sample is None:
        noise = draw_noise(x.shape, generator, device=x.device)
        prev_sample = (mean + std * noise).to(sample.dtype)
    # Score the value the caller keeps (rounded to its dtype), so scoring it later gives this number.
    x_prev = prev_sample.float()
    reduce_dims = tuple(range(1, x.ndim))
    if sde_type in ("sde", "dance"):
        log_density = -((x_prev - mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    else:
        # The CPS reference drops the constants and the 1 / (2 std^2) scale; kept so clip ranges carry over.
        log_density = -((x_prev - mean) ** 2)
    return SDEStepResult(prev_sample, log_density.mean(dim=reduce_dims), mean, std)


@dataclass(frozen=True)
class SolverHistory:
    """What a multistep ODE solver carries from one deterministic step to the next: the previous step's
    data prediction x0_hat and its step in log-SNR, h. Empty at the start and after a stochastic step."""

    data_prediction: torch.Tensor | None = None
    log_snr_step: float = math.inf


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma; -inf at sigma 1, +inf at sigma 0."""
    if sigma >= 1.0:
        return -math.inf
    if sigma <= 0.0:
        return math.inf
    return math.log((1.0 - sigma) / sigma)


def ode_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    solver: ODESolver,
    history: SolverHistory,
) -> tuple[torch.Tensor, SolverHistory]:
    """One deterministic step from ``sigma`` to ``sigma_next`` (floats or 0-dim tensors: shared by the batch).

    ``euler``: x + v dt. ``dpm2m``: DPM-Solver++(2M) (Lu et al. 2022, arXiv 2211.01095) in data-prediction form
    for x_sigma = alpha x0 + sigma eps with alpha = 1 - sigma, lambda = log(alpha / sigma), h = lambda' - lambda:
        x' = (sigma' / sigma) x + alpha' (1 - e^-h) D,   x0_hat = x - sigma v,
        D = (1 + 1 / (2 r)) x0_hat - 1 / (2 r) x0_prev with r = h_prev / h, or D = x0_hat without a previous
        step. The first-order form equals Euler, so a step without history (the first, the first after a
        stochastic step) and the last (sigma' = 0, where D = x0_hat lands) take the Euler step itself.
    Returns the next latent (the input dtype) and the history the next step needs.
    """
    if solver not in ODE_SOLVERS:
        raise ValueError(f"ode_solver must be one of {ODE_SOLVERS}; got {solver!r}")
    x = sample.float()
    v = velocity.float()
    sigma_t = _as_batch_column(sigma, sample, "sigma")
    sigma_n = _as_batch_column(sigma_next, sample, "sigma_next")
    s, s_next = float(sigma), float(sigma_next)
    x0_hat = x - sigma_t * v
    h = _log_snr(s_next) - _log_snr(s)
    if solver == "euler" or history.data_prediction is None or math.isinf(h) or math.isinf(history.log_snr_step):
        # The same arithmetic as sde_step's deterministic branch: Euler rollouts are unchanged by the solver option.
        out = x + v * (sigma_n - sigma_t)
    else:
        half_inverse_r = h / (2.0 * history.log_snr_step)
        data = (1.0 + half_inverse_r) * x0_hat - half_inverse_r * history.data_prediction
        out = (s_next / s) * x + (1.0 - s_next) * (-math.expm1(-h)) * data
    next_history = SolverHistory(x0_hat, h) if solver == "dpm2m" else history
    return out.to(sample.dtype), next_history


def kl_between_means(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample KL of two Gaussians with one std: mean over non-batch dims of (mu - mu_ref)^2 / (2 std^2).

    This is the per-dimension KL (the reference code's form without the |dt| factor folded in).
    Returns [B]. Deterministic steps (std == 0) contribute 0.
    """
    safe_std = torch.where(std > 0, std, torch.ones_like(std))
    per_dim = (mean - mean_ref) ** 2 / (2.0 * safe_std**2) * (std > 0)
    return per_dim.mean(dim=tuple(range(1, mean.ndim)))
