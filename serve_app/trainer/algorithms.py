"""What each training algorithm asks the service to sample (`trainer.algorithm`).

The service is one sampler; the algorithms differ in the settings each rollout request carries:

- flow_grpo: the configured sampling as it is (Flow-GRPO, or Flow-GRPO-Fast with a window).
- mix_grpo: MixGRPO (Li et al. 2025, arXiv 2507.21802). A sliding window: the trainer names the window's first
  step exactly in every request, moving it `stride` steps later every `shift_interval` rollouts, up to
  `max_start`; the steps outside it are the ODE (`sampling.ode_solver` picks its solver).
- dance_grpo: DanceGRPO (Xue et al. 2025, arXiv 2505.07818): the configured sampling with its SDE step
  (`sampling.sde_type dance`), trained by the same clipped ratio as flow_grpo.
- diffusion_nft: DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): ODE rollouts (noise 0) recorded as their
  final latents and those after the first step (`sampling.record final`); the trainer trains on their forward
  process and checks its velocity by the first step (serve_app.trainer.nft), so no log-prob crosses the wire.

A rollout's settings follow from its index alone, like its prompts and seed, so a resumed run requests the
same rollouts the uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from serve_app.config.sampling import SamplingParams


class TrainerSection(Protocol):
    """What these functions read of serve_app.trainer.config.TrainerSection (which imports this module)."""

    algorithm: str
    grpo_guard: bool
    mix_grpo: Any

Algorithm = Literal["flow_grpo", "mix_grpo", "dance_grpo", "diffusion_nft"]
ALGORITHMS: tuple[str, ...] = ("flow_grpo", "mix_grpo", "dance_grpo", "diffusion_nft")
# The algorithms that train the sampler's per-step log-probs (a clipped ratio against the rollouts').
RATIO_BASED: tuple[str, ...] = ("flow_grpo", "mix_grpo", "dance_grpo")
# GRPO-Guard's RatioNorm needs the Gaussian log-density with its 1 / (2 s^2) scale (serve_app.trainer.loss).
GAUSSIAN_STEPS: tuple[str, ...] = ("sde", "dance")


def mix_grpo_window_start(cfg: TrainerSection, index: int) -> int:
    """The first window step of rollout `index` under MixGRPO's sliding schedule."""
    mix = cfg.mix_grpo
    return min((index // mix.shift_interval) * mix.stride, mix.max_start)


def rollout_sampling(cfg: TrainerSection, sampling: SamplingParams, index: int) -> SamplingParams:
    """The sampling settings of rollout `index`: the configured ones with the algorithm's changes."""
    if cfg.algorithm == "mix_grpo":
        start = mix_grpo_window_start(cfg, index)
        return sampling.model_copy(update={"sde_window_range": (start, start + 1)})
    if cfg.algorithm == "diffusion_nft":
        return sampling.model_copy(update={"noise_level": 0.0, "record": "final"})
    return sampling


def check_algorithm_sampling(cfg: TrainerSection, sampling: SamplingParams) -> None:
    """Raise ValueError, naming the settings, when the configured sampling cannot serve `cfg.algorithm` (or
    GRPO-Guard); every rollout the run will request is validated here, before anything is sampled."""
    if cfg.algorithm == "mix_grpo":
        if sampling.sde_window_size is None:
            raise ValueError("trainer.algorithm mix_grpo slides a window: set sampling.sde_window_size")
        last = cfg.mix_grpo.max_start + sampling.sde_window_size
        if last > sampling.num_steps - 1:
            raise ValueError(
                f"trainer.mix_grpo.max_start {cfg.mix_grpo.max_start} + sampling.sde_window_size "
                f"{sampling.sde_window_size} must be at most sampling.num_steps - 1 = {sampling.num_steps - 1} "
                "(the last step is deterministic)")
    if cfg.algorithm == "dance_grpo" and sampling.sde_type != "dance":
        raise ValueError(f"trainer.algorithm dance_grpo samples DanceGRPO's step: set sampling.sde_type dance "
                         f"(got {sampling.sde_type!r})")
    if cfg.algorithm == "diffusion_nft":
        if sampling.group_noise != "independent":
            raise ValueError("trainer.algorithm diffusion_nft samples the ODE: with sampling.group_noise shared every "
                             "sample of a group would be the same image; set it to independent")
        if cfg.grpo_guard:
            raise ValueError("trainer.grpo_guard normalises a log-ratio; trainer.algorithm diffusion_nft has none")
    if cfg.grpo_guard and sampling.sde_type not in GAUSSIAN_STEPS:
        raise ValueError(f"trainer.grpo_guard normalises the Gaussian log-ratio of sampling.sde_type in {GAUSSIAN_STEPS}; "
                         f"got {sampling.sde_type!r}")
