"""Seeds: every sample's noise derives from (request seed, prompt index, sample index) only, so a
sample is the same whichever replica or batch it lands in, and a retried request reproduces it."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from serve_app.config.sampling import SamplingParams


def derive_sample_seed(request_seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed, statistically independent across (prompt, sample) pairs."""
    state = np.random.SeedSequence([request_seed, prompt_index, sample_index]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1])) & (2**63 - 1)


# The sample index that names a group's shared initial noise: no real sample has it.
GROUP_NOISE_INDEX = 2**62


def derive_group_seed(request_seed: int, prompt_index: int) -> int:
    """The seed of a group's shared initial noise (sampling.group_noise = "shared")."""
    return derive_sample_seed(request_seed, prompt_index, GROUP_NOISE_INDEX)


def group_seeds_for(request_seed: int, prompt_index: torch.Tensor) -> torch.Tensor:
    """[B] the group seed of each sample's prompt."""
    return torch.tensor([derive_group_seed(request_seed, int(p)) for p in prompt_index], dtype=torch.long)


def sample_generators(seeds: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per sample."""
    return [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds.tolist()]


def draw_window_start(request_seed: int, window_range: tuple[int, int]) -> int:
    """The SDE window's first step, shared by every chunk of a request (so groups stack)."""
    lo, hi = window_range
    return random.Random(request_seed).randrange(lo, hi)


def fresh_request_seed() -> int:
    return random.SystemRandom().randrange(0, 2**63)


def group_layout(request_seed: int, num_prompts: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples of a request in AABB order (a group is contiguous): prompt_index, sample_index and
    seeds, each [num_prompts * group_size] long - the same for the service and an in-process rollout."""
    prompt_index = torch.arange(num_prompts).repeat_interleave(group_size)
    sample_index = torch.arange(group_size).repeat(num_prompts)
    seeds = torch.tensor(
        [derive_sample_seed(request_seed, int(p), int(s)) for p, s in zip(prompt_index, sample_index)],
        dtype=torch.long,
    )
    return prompt_index, sample_index, seeds


@dataclass(frozen=True)
class RequestSeeds:
    """Every seed of one request, derived from its seed alone: the samples in AABB order, their seeds, their
    groups' seeds (shared group noise, else None) and the SDE window's first step (None without a window)."""

    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    seeds: torch.Tensor
    group_seeds: torch.Tensor | None
    window_start: int | None

    @classmethod
    def of(cls, request_seed: int, num_prompts: int, group_size: int, sampling: SamplingParams) -> RequestSeeds:
        """The seeds of a request of `num_prompts` groups of `group_size` sampled with `sampling` (its group noise
        and SDE window; its own seed field is not read: `request_seed` is the one resolved for the request)."""
        prompt_index, sample_index, seeds = group_layout(request_seed, num_prompts, group_size)
        shared = sampling.group_noise == "shared"
        return cls(prompt_index, sample_index, seeds, group_seeds_for(request_seed, prompt_index) if shared else None,
                   None if sampling.sde_window_size is None else draw_window_start(request_seed, sampling.sde_window_range))
