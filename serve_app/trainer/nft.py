"""DiffusionNFT's pieces beside the loss (serve_app.trainer.loss.nft_loss): the forward-process draws it trains
on, the conditional velocity it trains, and the trust check that the rollouts' final latents are what the
trainer's copy of the sampling version would have produced.

DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117) trains on the forward process x_t = (1 - t) x0 + t eps of
each rollout's clean final latents x0, not on the sampler's transitions: the rollouts are ODE samples recorded
as their final latents alone (`sampling.record final`), so no log-prob crosses the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from serve_app.flowgrpo.sampler import Conditioning, denoise, initial_latents
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import Trajectory
from serve_app.trainer.config import DiffusionNFTSection


class FinalLatentMismatchError(RuntimeError):
    """The trainer's copy of the sampling version does not reproduce the rollouts' final latents."""


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
    if trajectory.latents.shape[1] != 1 or trajectory.log_probs.shape[1] != 0:
        raise ValueError("DiffusionNFT trains on final latents alone: the rollouts must be sampled with "
                         f"sampling.record final (got latents {tuple(trajectory.latents.shape)})")
    return trajectory.latents[:, 0]


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
def regenerated_final_latents(policy: DiffusionPolicy, trajectory: Trajectory, rows: torch.Tensor) -> torch.Tensor:
    """[n, ...] the final latents the policy's current weights give samples `rows` from their seeds, by the sampler's
    own ODE (the rollouts' settings, CFG included)."""
    params = trajectory.sampling
    device = policy.device
    conditioning = Conditioning(
        trajectory.prompt_embeds.to(device), trajectory.embed_row[rows].to(device),
        None if trajectory.negative_embeds is None else trajectory.negative_embeds.to(device),
    )
    generators = sample_generators(trajectory.seeds[rows])
    latents = initial_latents(policy, params, generators)
    return denoise(policy, conditioning, latents, trajectory.sigmas.to(device), [], params, generators).final_latents


def check_final_latents(policy: DiffusionPolicy, trajectory: Trajectory, rows: torch.Tensor, *, bound: float) -> float:
    """The largest |regenerated - stored| of the final latents of `rows`; raises FinalLatentMismatchError above
    `bound` (the weights held for the version the rollouts claim are not the ones that sampled them)."""
    regenerated = regenerated_final_latents(policy, trajectory, rows).float().cpu()
    error = float((regenerated - final_latents(trajectory)[rows].float()).abs().max())
    if not error <= bound:
        raise FinalLatentMismatchError(
            f"regenerating {len(rows)} rollouts of policy version {trajectory.policy_version} with the trainer's copy "
            f"of its weights lands {error:.3g} from their final latents > trainer.diffusion_nft.max_final_latent_error "
            f"{bound}; the replicas' weights, sampling settings or precision differ from the trainer's")
    return error
