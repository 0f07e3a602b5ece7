"""DiffusionNFT's pieces beside the loss (serve_app.trainer.loss.nft_loss): the forward-process draws it trains
on, the conditional velocity it trains, and the trust check that the trainer's copy of the sampling version has the
velocity that sampled the rollouts.

DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) trains on the forward process x_t = (1 - t) x0 + t eps of
each rollout's clean final latents x0, not on the sampler's transitions: the rollouts are ODE samples recorded
as their final latents and those after the first step (`sampling.record final`), so no log-prob crosses the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.flowgrpo.sampler import deterministic_transition, initial_latents, trajectory_conditioning
from serve_app.flowgrpo.sde import SolverHistory
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import Trajectory
from serve_app.trainer.config import DiffusionNFTSection


class VelocityMismatchError(RuntimeError):
    """The trainer's copy of the sampling version does not give the rollouts' first step."""


@dataclass(frozen=True)
class ForwardDraws:
    """`draws` forward-process points of every sample: t [B, D] in the t range, x_t and v_target = eps - x0
    [B, D, ...]; each sample's from a generator of its own (forward_generators), so a sample's draws do not depend
    on which other samples share its batch or its rank."""

    t: torch.Tensor
    x_t: torch.Tensor
    v_target: torch.Tensor

    @staticmethod
    def of(x0: torch.Tensor, draws: int, t_range: tuple[float, float],
           generators: Sequence[torch.Generator]) -> ForwardDraws:
        if len(generators) != x0.shape[0]:
            raise ValueError(f"one generator per sample: {len(generators)} for {x0.shape[0]} samples")
        lo, hi = t_range
        x0 = x0.float()
        t = torch.stack([lo + (hi - lo) * torch.rand(draws, generator=g) for g in generators])
        eps = torch.stack([torch.randn((draws, *x0.shape[1:]), generator=g) for g in generators])
        column = t.reshape(*t.shape, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - column) * x0[:, None] + column * eps
        return ForwardDraws(t, x_t, eps - x0[:, None])


def forward_generators(update_seed: int, epoch: int, sample_seeds: torch.Tensor) -> list[torch.Generator]:
    """One generator per sample for its forward draws in pass `epoch` of the update seeded `update_seed`, keyed by
    the sample's own seed: data-parallel ranks, each holding a shard of the batch, draw what one process would."""
    generators = []
    for sample_seed in sample_seeds.tolist():
        key = hashlib.blake2b(f"{update_seed}/{epoch}/{sample_seed}".encode(), digest_size=8).digest()
        generators.append(torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1))
    return generators


def sampling_decay(section: DiffusionNFTSection, update: int) -> float:
    """The decay d of the sampling policy's soft update after update `update` (0-based): old <- d old + (1 - d)
    theta. 0 before `sampling_decay_delay` updates, then rising by `sampling_decay_rate` per update to
    `sampling_decay_max` (DiffusionNFT's reference schedules: delay 0, rate 0.001, max 0.5; delay 75, rate
    0.0075, max 0.999)."""
    if update < section.sampling_decay_delay:
        return 0.0
    return min((update - section.sampling_decay_delay) * section.sampling_decay_rate, section.sampling_decay_max)


def final_latents(trajectory: Trajectory) -> torch.Tensor:
    """[B, ...] the clean final latents of a `record final` trajectory."""
    _check_recorded_final(trajectory)
    return trajectory.latents[:, 1]


def first_step_latents(trajectory: Trajectory) -> torch.Tensor:
    """[B, ...] the latents after the first step of a `record final` trajectory (what the trust check recomputes)."""
    _check_recorded_final(trajectory)
    return trajectory.latents[:, 0]


def _check_recorded_final(trajectory: Trajectory) -> None:
    if trajectory.latents.shape[1] != 2 or trajectory.log_probs.shape[1] != 0:
        raise ValueError("DiffusionNFT trains on final latents alone: the rollouts must be sampled with "
                         f"sampling.record final (got latents {tuple(trajectory.latents.shape)})")


def conditional_velocity(policy: DiffusionPolicy, trajectory: Trajectory, x_t: torch.Tensor, t: torch.Tensor,
                         rows: torch.Tensor) -> torch.Tensor:
    """float32 [n, ...] the policy's velocity at x_t [n, ...] and times t [n] of samples `rows` (CFG off: DiffusionNFT
    trains the conditional velocity). Differentiable."""
    device = policy.device
    embeds = trajectory.prompt_embeds.to(device).select(trajectory.embed_row[rows].to(device))
    sampling = trajectory.sampling
    return policy.velocity(x_t.to(device, policy.dtype), t.to(device), embeds, negative=None, guidance_scale=1.0,
                           height=sampling.height, width=sampling.width).float()


@torch.no_grad()
def check_velocity(policy: DiffusionPolicy, trajectory: Trajectory, rows: torch.Tensor, *, bound: float) -> float:
    """The largest |v_trainer - v_sampler| of samples `rows` at their first step: the trainer rebuilds each one's
    initial noise from its seed and takes the sampler's own first step (its settings, CFG included) with the weights
    it holds; a difference in the latents after it, divided by the step's |sigma_1 - sigma_0|, is the velocity's.
    Raises VelocityMismatchError above `bound` (the weights held for the version the rollouts claim are not the ones
    that sampled them). One model call per row, and no solve that carries float order from step to step."""
    params = trajectory.sampling
    conditioning = trajectory_conditioning(trajectory, rows, policy.device)
    noise = initial_latents(policy, params, sample_generators(trajectory.seeds[rows]))
    sigmas = trajectory.sigmas.to(policy.device)
    first, _ = deterministic_transition(policy, noise, sigmas[0], sigmas[1], conditioning, params, SolverHistory())
    step = abs(float(sigmas[1] - sigmas[0]))
    error = float((first.float().cpu() - first_step_latents(trajectory)[rows].float()).abs().max()) / step
    if not error <= bound:
        raise VelocityMismatchError(
            f"the trainer's copy of policy version {trajectory.policy_version} gives {len(rows)} of its rollouts a "
            f"first-step velocity {error:.3g} from the one that sampled them > "
            f"trainer.diffusion_nft.max_velocity_error {bound}; the replicas' weights, sampling settings or precision "
            "differ from the trainer's")
    return error
