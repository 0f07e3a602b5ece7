"""The diffusers sampling engine - one implementation of serve_app.serving.engine_contract.SamplingEngine: fuse
concurrent chunks into batches, keep the weights at the pinned version, run our sampler on a diffusers
policy, split the result back per chunk."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from serve_app.serving.engine_contract import BatchStats, EmbeddedChunk, SamplingEngine
from serve_app.errors import NumericalError
from serve_app.flowgrpo.sampler import encode_conditioning, rollout
from serve_app.policies.base import DiffusionPolicy, ImageGeometry
from serve_app.schemas import PromptEmbeds, RolloutChunk, Trajectory
from serve_app.weights.layout import Layout, ModelLayout
from serve_app.weights.replica import PolicyVersions
from serve_app.weights import LoraSpec, VersionStore, WeightKind

if TYPE_CHECKING:
    from serve_app.config import RolloutConfig

__all__ = ["BatchStats", "DiffusersEngine", "load_engine"]


def load_engine(config: RolloutConfig) -> SamplingEngine:
    """The engine `replica.backend` names, over the configured model (its transformer compiled when
    `model.compile` is on) and the trainer's weight store."""
    from serve_app.policies import load_configured_policy
    from serve_app.weights import open_weight_store

    if config.replica.backend == "diffusers":
        policy = load_configured_policy(config.model)
        if config.model.compile:
            policy.compile_transformer()
        return DiffusersEngine(policy, open_weight_store(config))
    raise ValueError(f"replica.backend {config.replica.backend!r} has no engine; available: diffusers")


class DiffusersEngine:
    """Runs chunks on one diffusers policy; thread-safe (one batch at a time)."""

    backend = "diffusers"

    def __init__(self, policy: DiffusionPolicy, store: VersionStore | None = None) -> None:
        self.policy = policy
        self.versions = PolicyVersions(policy, store)
        self._layout = ModelLayout.of(policy.experts)  # before a version's adapter wraps any layer
        self._lock = threading.Lock()
        self._probe_conditioning: PromptEmbeds | None = None

    @property
    def family(self) -> str:
        return self.policy.family

    @property
    def geometry(self) -> ImageGeometry:
        return self.policy.geometry

    def generate(self, chunks: Sequence[RolloutChunk]) -> tuple[list[Trajectory | Exception], list[BatchStats]]:
        """One result per chunk, in order: its trajectory, or the error it alone caused.

        Chunks that can share a batch (same params, window and version) run as one forward batch; a
        chunk's result does not depend on its neighbours. When a fused batch fails, its chunks run
        again one by one, so a chunk fails only for its own fault, never for another request's.
        """
        results: list[Trajectory | Exception | None] = [None] * len(chunks)
        stats: list[BatchStats] = []
        with self._lock:
            for (version, _, _), members in self._fusable_groups(chunks).items():
                fused = [chunks[i] for i in members]
                try:
                    outcomes: list[Trajectory | Exception] = list(self._run(fused, version, stats))
                except Exception:
                    outcomes = [self._run_alone(chunk, version, stats) for chunk in fused]
                for i, outcome in zip(members, outcomes):
                    results[i] = outcome
        assert all(r is not None for r in results), "every chunk belongs to exactly one fused group"
        return results, stats  # type: ignore[return-value]

    def _run_alone(self, chunk: RolloutChunk, version: int, stats: list[BatchStats]) -> Trajectory | Exception:
        try:
            return self._run([chunk], version, stats)[0]
        except Exception as exc:  # returned, not raised: it is this chunk's answer
            return exc

    def check_health(self) -> None:
        """Raise unless this engine can serve: the version it holds is still published, and - when no
        batch is running - a one-step forward of the smallest sample gives finite values. A running
        batch is a forward in progress; Serve's health-check timeout bounds one that hangs."""
        versions = self.versions
        if versions.current != 0 and versions.store is not None and versions.current not in versions.store.versions():
            raise RuntimeError(f"policy version {versions.current} is loaded but gone from {versions.store.where}")
        if not self._lock.acquire(blocking=False):
            return
        try:
            velocity = self._probe_forward()
        finally:
            self._lock.release()
        if not bool(torch.isfinite(velocity).all()):
            raise RuntimeError(f"a one-step probe forward of version {versions.current} gave non-finite values")

    @torch.no_grad()
    def _probe_forward(self) -> torch.Tensor:
        policy = self.policy
        side = policy.spatial_multiple
        if self._probe_conditioning is None:
            (tokens,) = policy.text_processor().tokenize([" "])
            # An image-conditioned family needs its fewest input images: gray ones, at a square image's size.
            fewest = policy.geometry.input_images[0]
            if fewest:
                gray = torch.full((3, side, side), 128, dtype=torch.uint8)
                images, condition = policy.geometry.conditioning_images([gray] * fewest, output_size=(side, side))
                tokens = replace(tokens, images=images, condition_images=condition)
            self._probe_conditioning = policy.encode_prompts([tokens])
        # The fewest frames the model takes: a transformer with two-frame tokens refuses one latent frame.
        shape = policy.latent_shape(side, side, policy.geometry.min_frames)
        latents = torch.zeros((1, *shape), device=policy.device, dtype=policy.dtype)
        # One sigma per expert (Wan2.2-A14B: a step of each), so a broken low-noise expert is caught too.
        sigmas = torch.tensor(policy.probe_sigmas, device=policy.device)
        # Eager even when the transformer is compiled: compiling the probe's one-off shape could take longer
        # than a health check may, and Serve would replace a healthy replica.
        eager = torch.compiler.set_stance("force_eager") if policy.compiled else contextlib.nullcontext()
        with eager:
            return torch.cat([policy.velocity(latents, sigma[None], self._probe_conditioning, negative=None,
                                              guidance_scale=1.0, height=side, width=side) for sigma in sigmas])

    def generate_embedded(self, chunk: EmbeddedChunk) -> Trajectory:
        """Sample from already encoded prompts (the contract's embeddings entry); raises on error."""
        with self._lock:
            self.versions.ensure(chunk.policy_version)
            trajectory = rollout(
                self.policy, chunk.conditioning, chunk.seeds, chunk.sampling, window_start=chunk.window_start,
                prompt_index=chunk.prompt_index, sample_index=chunk.sample_index, policy_version=chunk.policy_version,
                weights_hash=self.versions.current_hash, group_seeds=chunk.group_seeds,
            )
        _check_finite(trajectory)
        return trajectory

    def weight_layout(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        return self._layout.version(kind, lora)

    def prefetch(self, version: int) -> int:
        """Load `version` now, between batches; returns the version loaded."""
        with self._lock:
            self.versions.ensure(version)
            return self.versions.current

    def _fusable_groups(self, chunks: Sequence[RolloutChunk]) -> dict[tuple, list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i, chunk in enumerate(chunks):
            key = (chunk.policy_version, chunk.sampling.model_copy(update={"seed": None}), chunk.window_start)
            groups.setdefault(key, []).append(i)
        return groups

    def _run(self, chunks: list[RolloutChunk], version: int, stats: list[BatchStats]) -> list[Trajectory]:
        self.versions.ensure(version)
        params = chunks[0].sampling
        started = time.perf_counter()
        # 1. Encode each chunk's distinct prompts once (rows offset per chunk), and the negative once.
        offsets = torch.tensor([0] + [len(c.prompts) for c in chunks[:-1]]).cumsum(0)
        embed_row = torch.cat([c.prompt_slot + off for c, off in zip(chunks, offsets.tolist())])
        conditioning = encode_conditioning(
            self.policy, [p for c in chunks for p in c.prompts], embed_row.to(self.policy.device),
            chunks[0].negative_prompt, params,
        )
        # 2. Sample the fused batch.
        fused = rollout(
            self.policy,
            conditioning,
            torch.cat([c.seeds for c in chunks]),
            params,
            window_start=chunks[0].window_start,
            prompt_index=torch.cat([c.prompt_index for c in chunks]),
            sample_index=torch.cat([c.sample_index for c in chunks]),
            policy_version=version,
            weights_hash=self.versions.current_hash,
            group_seeds=None if chunks[0].group_seeds is None else torch.cat([c.group_seeds for c in chunks]),
        )
        _check_finite(fused)
        seconds = time.perf_counter() - started
        stats.append(BatchStats(len(fused), seconds / params.num_steps, version))
        # 3. Split back: each chunk gets its own samples, only its prompts' embeddings, and its own
        # request's params (fused chunks may differ in the request seed, which their seeds already hold).
        bounds = torch.tensor([0] + [len(c) for c in chunks]).cumsum(0).tolist()
        return [replace(fused.take(slice(lo, hi)), sampling=c.sampling)
                for c, lo, hi in zip(chunks, bounds[:-1], bounds[1:])]


def _check_finite(trajectory: Trajectory) -> None:
    """A trainer must never receive NaN or infinite log-probs or latents; a typed error instead."""
    for name in ("log_probs", "latents"):
        values = getattr(trajectory, name)
        if not bool(torch.isfinite(values).all()):
            raise NumericalError(
                f"non-finite {name} at policy version {trajectory.policy_version} (sampling "
                f"{trajectory.sampling.model_dump(exclude={'negative_prompt'})})"
            )
