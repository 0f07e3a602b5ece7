"""The sampling-engine contract: what every backend (diffusers today, vllm-omni next) takes, returns
and guarantees. The replica and the ingress talk to this; only an engine's own module knows its library.

Takes (``generate``): RolloutChunks - per prompt its token ids (``PromptTokens``), SamplingParams,
per-sample seeds, the SDE window's start and the concrete policy version; or (``generate_embedded``)
an :class:`EmbeddedChunk` whose prompts are already encoded (``PromptEmbeds``), for callers that
encode elsewhere.

Returns: one :class:`~serve_app.schemas.Trajectory` per chunk - window latents [B, K+1, ...],
per-step log-probs [B, K] float32, the sigma schedule [N+1], uint8 images [B, 3, H, W] (a video
family's videos [B, F, 3, H, W]), the policy version and the content hash of the weights that
produced them - or the exception that chunk alone caused.

Invariants (tests/conformance checks each one on CPU, for every engine and family):

1. Seed-only noise. A sample's initial latent is the first draw of ``torch.Generator().manual_seed(seed)``
   shaped like the family's latent (``sampler.initial_latents``), and its step noise the following
   draws of the same stream; so a sample is the same alone or fused with any other chunk.
2. Noise 0 is the family's stock diffusers pipeline: with ``noise_level`` 0 the images equal the stock
   ``__call__`` given the same initial latents, steps and guidance.
3. Replay gives ratio 1: the trainer's replay (``sampler.replay_step``, fp32) of every window step of
   a trajectory, under the weights it was sampled with, reproduces its log-probs to
   ``REPLAY_TOLERANCE`` (:func:`replay_verdict` says whether it does, and by how much it does not).
   An engine that cannot (bf16, other kernels) must say so, and the trainer then corrects for it
   (``trainer.mismatch``, truncated importance sampling) instead of silently training off-policy.
4. Version pinning: a chunk pinned to version v runs with v's weights or fails with
   PolicyVersionError; its trajectory is stamped with v and the hash of the weights held.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from serve_app.flowgrpo.sampler import Conditioning
from serve_app.policies.base import DiffusionPolicy, ImageGeometry
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import RolloutChunk, Trajectory
from serve_app.weights.layout import Layout
from serve_app.weights.versions import LoraSpec, WeightKind
from serve_app.flowgrpo.ratios import LogRatioSummary, replay_log_probs, summarize_log_ratios

# fp32, one code path for sampling and replay: the ratio is 1 up to reduction-order noise.
REPLAY_TOLERANCE = 1e-6


@dataclass
class BatchStats:
    """One fused forward batch an engine ran (for the replica's metrics)."""

    images: int
    seconds_per_step: float
    policy_version: int


@dataclass(frozen=True)
class EmbeddedChunk:
    """A chunk whose prompts are already encoded: sample b is conditioned on row ``embed_row[b]``.

    seeds, prompt_index, sample_index: [B] long; group_seeds: [B] with sampling.group_noise "shared".
    """

    conditioning: Conditioning
    sampling: SamplingParams
    seeds: torch.Tensor
    window_start: int | None
    policy_version: int
    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    group_seeds: torch.Tensor | None = None


@runtime_checkable
class SamplingEngine(Protocol):
    """What a replica needs from a sampling backend (the invariants are in the module docstring)."""

    backend: str  # the config's replica.backend that selects it

    @property
    def family(self) -> str: ...

    @property
    def geometry(self) -> ImageGeometry:
        """The image sizes the loaded model takes (the ingress checks requests against it)."""
        ...

    def generate(self, chunks: Sequence[RolloutChunk]) -> tuple[list[Trajectory | Exception], list[BatchStats]]:
        """One result per chunk, in order: its trajectory or the error it alone caused."""
        ...

    def generate_embedded(self, chunk: EmbeddedChunk) -> Trajectory:
        """The same sampling from prompt embeddings instead of token ids (raises on error)."""
        ...

    def prefetch(self, version: int) -> int:
        """Load `version` between batches; returns the version now held."""
        ...

    def check_health(self) -> None:
        """Raise unless the engine can serve."""
        ...

    def weight_layout(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        """{tensor name: shape} of a version of the loaded model (serve_app.weights.layout), against which an
        uploaded version is checked before it is stored."""
        ...


@dataclass(frozen=True)
class ReplayVerdict:
    """Whether replaying a trajectory reproduced its log-probs (invariant 3)."""

    ok: bool
    summary: LogRatioSummary
    tolerance: float
    message: str


@torch.no_grad()
def replay_verdict(
    policy: DiffusionPolicy, trajectory: Trajectory, *, tolerance: float = REPLAY_TOLERANCE
) -> ReplayVerdict:
    """Replay every window step of `trajectory` with the trainer's code on `policy` (which must hold
    the weights it was sampled with) and compare |log pi_replay - log pi_rollout| with `tolerance`."""
    if trajectory.log_probs.shape[1] == 0:
        raise ValueError("the trajectory has no stochastic steps: there is nothing to replay")
    log_ratios = replay_log_probs(policy, trajectory) - trajectory.log_probs
    summary = summarize_log_ratios(log_ratios)
    ok = math.isfinite(summary.max) and summary.max <= tolerance
    verdict = "reproduces" if ok else "does NOT reproduce"
    message = (
        f"replay {verdict} the rollout's log-probs: |log ratio| p50 {summary.p50:.3g}, p99 {summary.p99:.3g}, "
        f"max {summary.max:.3g} over {log_ratios.numel()} transitions (tolerance {tolerance:.3g}, fp32)"
    )
    return ReplayVerdict(ok, summary, tolerance, message)
