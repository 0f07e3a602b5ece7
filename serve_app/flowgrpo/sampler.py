"""Rollout sampling with per-step log-probs, and the replay of a stored transition.

Both :func:`rollout` (sampling) and :func:`replay_step` (the trainer's recomputation) go through
:func:`transition`, which calls the policy's velocity and :func:`sde_step`: one code path, so the
on-policy ratio is exactly 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from serve_app.flowgrpo.sde import SDEStepResult, SolverHistory, draw_noise, ode_step, sde_step
from serve_app.flowgrpo.seeding import RequestSeeds, fresh_request_seed, sample_generators
from serve_app.media import to_uint8
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import BASE_HASH, PromptEmbeds, PromptTokens, Trajectory


class SamplingPolicy(Protocol):
    """What the sampler needs of a model family's adapter (serve_app.policies.DiffusionPolicy is one)."""

    device: torch.device
    dtype: torch.dtype

    def text_processor(self) -> Any: ...
    def encode_prompts_for(self, prompts: Sequence[PromptTokens], params: SamplingParams) -> PromptEmbeds: ...
    def check_size(self, height: int, width: int, num_frames: int = 1) -> None: ...
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]: ...
    def sigma_schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor: ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *,
                 negative: PromptEmbeds | None, guidance_scale: float, height: int, width: int) -> torch.Tensor:
        """float32 velocity [B, ...] of latents [B, ...] at sigmas [B], with true CFG when a negative is given."""
        ...

    def guidance_scale_at(self, sigma: torch.Tensor, params: SamplingParams) -> float:
        """The true-CFG scale of the step at `sigma` (two-expert models: each expert's own)."""
        ...

    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] (videos [B, F, 3, H, W]) float in [0, 1]."""
        ...


@dataclass(frozen=True)
class Conditioning:
    """Per-sample conditioning: rows of `prompts` picked by `embed_row` [B]. The negative is one row
    shared by every sample, or, with input images, one row per prompt row (picked by `embed_row` too)."""

    prompts: PromptEmbeds
    embed_row: torch.Tensor
    negative: PromptEmbeds | None

    def negative_rows(self) -> PromptEmbeds | None:
        """The negative for the samples: its one shared row, or each sample's own row [B]."""
        if self.negative is None or not self.negative.has_images:
            return self.negative
        return self.negative.select(self.embed_row)


def window_steps(params: SamplingParams, window_start: int | None) -> list[int]:
    """The stochastic steps: a window of `sde_window_size` from `window_start`, or every step but the last."""
    if params.sde_window_size is None:
        return list(range(params.num_steps - 1))
    if window_start is None:
        raise ValueError("window_start is required when sde_window_size is set")
    lo, hi = params.sde_window_range
    if not lo <= window_start < hi:
        raise ValueError(f"window_start {window_start} outside sde_window_range {params.sde_window_range}")
    return list(range(window_start, window_start + params.sde_window_size))


def conditioned_velocity(
    policy: SamplingPolicy,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    conditioning: Conditioning,
    params: SamplingParams,
) -> torch.Tensor:
    """The velocity of a batch at `sigma`, with true CFG when the request has it."""
    return policy.velocity(
        latents,
        sigma.expand(latents.shape[0]),
        conditioning.prompts.select(conditioning.embed_row),
        # CFG on or off for the whole request (the stock pipelines' do_classifier_free_guidance), at the
        # scale of this step's expert.
        negative=conditioning.negative_rows() if params.guidance_scale > 1.0 else None,
        guidance_scale=policy.guidance_scale_at(sigma, params),
        height=params.height,
        width=params.width,
    )


def transition(
    policy: SamplingPolicy,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    conditioning: Conditioning,
    params: SamplingParams,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: Sequence[torch.Generator] | None = None,
) -> SDEStepResult:
    """One stochastic step of a batch: velocity (with CFG) then the SDE step, sampled or scoring `prev_sample`."""
    return sde_step(
        conditioned_velocity(policy, latents, sigma, conditioning, params),
        latents,
        sigma,
        sigma_next,
        noise_level=params.noise_level,
        sde_type=params.sde_type,
        prev_sample=prev_sample,
        generator=generator,
    )


def deterministic_transition(
    policy: SamplingPolicy,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    conditioning: Conditioning,
    params: SamplingParams,
    history: SolverHistory,
) -> tuple[torch.Tensor, SolverHistory]:
    """One step outside the window, by `params.ode_solver`; returns the next latents and the solver's history."""
    velocity = conditioned_velocity(policy, latents, sigma, conditioning, params)
    return ode_step(velocity, latents, float(sigma), float(sigma_next), solver=params.ode_solver, history=history)


@dataclass
class DenoiseResult:
    final_latents: torch.Tensor
    window_latents: torch.Tensor  # [B, K+1, ...]
    log_probs: torch.Tensor  # [B, K]
    first_step_latents: torch.Tensor | None = None  # [B, ...] after the loop's first step (None: no step ran)


@torch.no_grad()
def denoise(
    policy: SamplingPolicy,
    conditioning: Conditioning,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    steps: list[int],
    params: SamplingParams,
    generators: Sequence[torch.Generator],
    *,
    start: int = 0,
) -> DenoiseResult:
    """The denoising loop from step `start`: ODE steps outside the window, SDE steps (with log-probs) inside it."""
    stochastic = set(steps)
    recorded: list[torch.Tensor] = []
    log_probs: list[torch.Tensor] = []
    history = SolverHistory()
    first_step = None
    for i in range(start, params.num_steps):
        if i not in stochastic:
            latents, history = deterministic_transition(
                policy, latents, sigmas[i], sigmas[i + 1], conditioning, params, history)
        else:
            recorded.append(latents)
            result = transition(policy, latents, sigmas[i], sigmas[i + 1], conditioning, params, generator=generators)
            latents = result.prev_sample
            log_probs.append(result.log_prob)
            # A multistep solver's history belongs to the deterministic path the sample has just left.
            history = SolverHistory()
            if i + 1 not in stochastic:
                recorded.append(latents)
        if first_step is None:
            first_step = latents
    batch = latents.shape[0]
    window = torch.stack(recorded, dim=1) if recorded else latents.new_zeros((batch, 0, *latents.shape[1:]))
    logp = torch.stack(log_probs, dim=1) if log_probs else torch.zeros(batch, 0)
    return DenoiseResult(latents, window, logp.float(), first_step)


def initial_latents(policy: SamplingPolicy, params: SamplingParams, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """x_1 ~ N(0, I) per sample from its own generator (the first draw of its stream)."""
    shape = (len(generators), *policy.latent_shape(params.height, params.width, params.num_frames))
    return draw_noise(shape, generators, device=policy.device).to(policy.dtype)


@torch.no_grad()
def shared_prefix(
    policy: SamplingPolicy,
    conditioning: Conditioning,
    group_seeds: torch.Tensor,
    sigmas: torch.Tensor,
    params: SamplingParams,
    *,
    until: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The latents entering step `until` of every sample when each group shares its initial noise: the
    deterministic steps before it run once per group (one row per distinct group seed), then each
    group's latent is repeated for its samples. Returns the latents [B, ...] and, when `until` > 0, those after
    the first step [B, ...] (else None)."""
    groups, member = torch.unique(group_seeds, return_inverse=True)
    leader = torch.tensor([int((member == g).nonzero()[0]) for g in range(len(groups))])
    group_conditioning = Conditioning(conditioning.prompts, conditioning.embed_row[leader.to(conditioning.embed_row.device)],
                                      conditioning.negative)
    result = denoise(policy, group_conditioning, initial_latents(policy, params, sample_generators(groups)), sigmas, [],
                     params.model_copy(update={"num_steps": until}), [])
    member = member.to(result.final_latents.device)
    first = None if result.first_step_latents is None else result.first_step_latents[member]
    return result.final_latents[member], first


def rollout(
    policy: SamplingPolicy,
    conditioning: Conditioning,
    seeds: torch.Tensor,
    params: SamplingParams,
    *,
    window_start: int | None,
    prompt_index: torch.Tensor,
    sample_index: torch.Tensor,
    policy_version: int,
    weights_hash: str,
    group_seeds: torch.Tensor | None = None,
) -> Trajectory:
    """Sample B trajectories (B = len(seeds)) and record the SDE window's latents and log-probs (or, with
    `params.record` final, the latents after the first step and the final ones: latents [B, 2, ...], log_probs
    [B, 0], no step indices).

    prompt_index / sample_index [B] say where each sample belongs in its request (kept, not used);
    policy_version / weights_hash are the stamp of the weights the policy holds. With group_seeds [B]
    (sampling.group_noise = "shared") samples of one group start from the group's noise and share the
    steps before the window; otherwise each starts from its own seed's noise.
    """
    # 1. Check inputs
    policy.check_size(params.height, params.width, params.num_frames)
    batch_shape = (conditioning.embed_row.shape[0],)
    for name, t in (("seeds", seeds), ("prompt_index", prompt_index), ("sample_index", sample_index)):
        if t.shape != batch_shape:
            raise ValueError(f"{name} must be [B] = {batch_shape} like the conditioning rows; got {tuple(t.shape)}")
    steps = window_steps(params, window_start)
    deterministic = params.noise_level == 0 or params.sde_type == "ode"
    if params.record == "final" and deterministic:
        steps = []  # nothing to record or branch on: every step is the ODE solver's
    # 2. Schedule and per-sample noise streams
    sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width, params.num_frames).to(policy.device)
    generators = sample_generators(seeds)
    first_step = None
    if group_seeds is None:
        start, latents = 0, initial_latents(policy, params, generators)
    else:
        start = steps[0] if steps else params.num_steps
        latents, first_step = shared_prefix(policy, conditioning, group_seeds, sigmas, params, until=start)
    # 3. Denoising loop
    result = denoise(policy, conditioning, latents, sigmas, steps, params, generators, start=start)
    # 4. Decode
    images = to_uint8(policy.decode(result.final_latents, height=params.height, width=params.width,
                                    cond=conditioning.prompts.select(conditioning.embed_row)))
    if params.record == "final":
        first_step = result.first_step_latents if first_step is None else first_step
        recorded, log_probs, steps = torch.stack([first_step, result.final_latents], dim=1), result.log_probs[:, :0], []
    else:
        recorded, log_probs = result.window_latents, result.log_probs
    return Trajectory(
        latents=recorded.cpu(),
        log_probs=log_probs.cpu(),
        sigmas=sigmas.cpu(),
        step_indices=torch.tensor(steps, dtype=torch.long),
        images=images,
        seeds=seeds.clone(),
        prompt_embeds=_to_cpu(conditioning.prompts),
        embed_row=conditioning.embed_row.cpu(),
        negative_embeds=None if conditioning.negative is None else _to_cpu(conditioning.negative),
        sampling=params,
        prompt_index=prompt_index.clone(),
        sample_index=sample_index.clone(),
        policy_version=policy_version,
        weights_hash=weights_hash,
    )


def sample_group(
    policy: SamplingPolicy,
    prompts: Sequence[PromptTokens],
    group_size: int,
    params: SamplingParams,
    *,
    negative: PromptTokens | None = None,
    policy_version: int,
    weights_hash: str = BASE_HASH,
) -> Trajectory:
    """`group_size` samples of each prompt in one batch; seeds derive from `params.seed`.

    The in-process equivalent of one rollout request (the service splits the same work into chunks);
    the caller stamps the weights it knows the policy holds (the base checkpoint unless it says otherwise).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if not prompts:
        raise ValueError("prompts must not be empty")
    request_seed = params.seed if params.seed is not None else fresh_request_seed()
    drawn = RequestSeeds.of(request_seed, len(prompts), group_size, params)
    conditioning = encode_conditioning(policy, prompts, drawn.prompt_index, negative, params)
    return rollout(
        policy, conditioning, drawn.seeds, params, window_start=drawn.window_start,
        prompt_index=drawn.prompt_index, sample_index=drawn.sample_index, policy_version=policy_version,
        weights_hash=weights_hash, group_seeds=drawn.group_seeds,
    )


def encode_conditioning(
    policy: SamplingPolicy,
    prompts: Sequence[PromptTokens],
    embed_row: torch.Tensor,
    negative: PromptTokens | None,
    params: SamplingParams,
) -> Conditioning:
    """Encode each distinct prompt once (and the negative once when CFG is on); sample b uses row embed_row[b].

    Prompts with input images get the negative prompt encoded with each prompt's images, as the stock edit
    pipelines do: one negative row per prompt.
    """
    use_cfg = params.guidance_scale > 1.0
    if use_cfg and negative is None:
        negative = policy.text_processor().tokenize([params.negative_prompt])[0]
    negatives: list[PromptTokens] = []
    if use_cfg and negative is not None:
        with_images = any(p.images for p in prompts)
        negatives = ([replace(negative, images=p.images, condition_images=p.condition_images) for p in prompts]
                     if with_images else [negative])
    return Conditioning(
        policy.encode_prompts_for(prompts, params),
        embed_row.to(torch.long),
        policy.encode_prompts_for(negatives, params) if negatives else None,
    )


def trajectory_conditioning(trajectory: Trajectory, rows: torch.Tensor, device: torch.device) -> Conditioning:
    """The conditioning the sampler gave samples `rows` of a stored trajectory, on `device`."""
    return Conditioning(
        _to_device(trajectory.prompt_embeds, device),
        trajectory.embed_row[rows].to(device),
        None if trajectory.negative_embeds is None else _to_device(trajectory.negative_embeds, device),
    )


def replay_step(
    policy: SamplingPolicy,
    trajectory: Trajectory,
    k: int,
    *,
    rows: torch.Tensor | None = None,
) -> SDEStepResult:
    """Recompute the log-prob of stored transition k (window position) under the current weights.

    Differentiable (no no_grad here): the trainer calls it inside its loss. `rows` picks samples.
    """
    index = torch.arange(len(trajectory)) if rows is None else rows
    step = int(trajectory.step_indices[k])
    device = policy.device
    conditioning = trajectory_conditioning(trajectory, index, device)
    return transition(
        policy,
        trajectory.latents[index, k].to(device),
        trajectory.sigmas[step].to(device),
        trajectory.sigmas[step + 1].to(device),
        conditioning,
        trajectory.sampling,
        prev_sample=trajectory.latents[index, k + 1].to(device),
    )


def _to_cpu(embeds: PromptEmbeds) -> PromptEmbeds:
    return embeds.to(torch.device("cpu"))


def _to_device(embeds: PromptEmbeds, device: torch.device) -> PromptEmbeds:
    return embeds.to(device)
