"""DiffusionReplica: a thin Serve shell over a SamplingEngine (serve_app.serving.engine_contract; one policy per
replica, batched chunks; the engine is chosen by replica.backend)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import torch
from ray import serve
from ray.serve import metrics

from serve_app.config import RolloutConfig
from serve_app.serving.engine import load_engine
from serve_app.errors import WeightMismatchError
from serve_app.serving.options import check_running_options
from serve_app.weights import LoraSpec, WeightKind
from serve_app.weights.layout import Layout
from serve_app.weights.replica import replica_name
from serve_app.policies.base import ImageGeometry
from serve_app.schemas import ChunkHeader, RolloutChunk, Trajectory

logger = logging.getLogger("ray.serve")


class DiffusionReplica:
    def __init__(self, config: RolloutConfig) -> None:
        check_running_options(config, "DiffusionReplica")
        if config.replica.torch_threads is not None:
            # Ray pins OMP_NUM_THREADS to the replica's whole CPUs (1 for a fractional share); a CPU
            # replica that should use the machine's cores says so here.
            torch.set_num_threads(config.replica.torch_threads)
        self.engine = load_engine(config)
        self.name = replica_name()
        # Batching is set up per replica, sized by the config. serve.batch keeps its queue on the
        # function it decorates, so a class-level decorator would share one queue - served by one event
        # loop - between every replica of a process, as Serve's local testing mode runs them (measured:
        # a second app's rollouts 15x slower, its batches handled on the first app's loop).
        self._generate_fused = serve.batch(
            max_batch_size=config.replica.max_batch_size, batch_wait_timeout_s=config.replica.batch_wait_timeout_s
        )(self._generate_batch)
        tags = ("family",)
        self._tags = {"family": config.model.family}
        self.images_generated = metrics.Counter(
            "flowgrpo_images_generated", description="Images sampled by this replica.", tag_keys=tags
        )
        self.step_seconds = metrics.Histogram(
            "flowgrpo_denoise_step_seconds",
            description="Wall time of one denoising step of a fused batch.",
            boundaries=[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10],
            tag_keys=tags,
        )
        self.policy_version = metrics.Gauge(
            "flowgrpo_replica_policy_version", description="Weights version loaded on this replica.", tag_keys=tags
        )
        self.policy_version.set(0, tags=self._tags)
        self.weight_mismatches = metrics.Counter(
            "flowgrpo_weight_mismatches", description="Weights found different from the published version.",
            tag_keys=("where",),
        )

    async def generate(self, chunk: RolloutChunk) -> AsyncIterator[ChunkHeader | torch.Tensor | Trajectory]:
        """One chunk, yielded in three parts that each become an object of their own, so a caller can hand
        each to the process that needs it: the header (ids, seeds, log-probs, version), the images (for
        the rewards) and the transitions (for the trainer). Call it with handle.options(stream=True).

        Concurrent calls are fused into one forward batch; an error raised here is this chunk's own
        (DiffusersEngine.generate isolates the chunks of a fused batch)."""
        result = await self._generate_fused(chunk)
        if isinstance(result, Exception):
            raise result
        yield ChunkHeader.of(result, sampled_by=self.name)
        yield result.images
        yield result.without_images()

    def geometry(self) -> ImageGeometry:
        """The image sizes this replica's model takes and what an image costs (the ingress checks
        requests against it before fan-out)."""
        return self.engine.geometry

    async def _generate_batch(self, chunks: list[RolloutChunk]) -> list[Trajectory | Exception]:
        # Sampling is CPU/GPU-bound: run it off the event loop so health checks and metrics keep flowing.
        results, stats = await asyncio.to_thread(self.engine.generate, chunks)
        mismatches = sum(isinstance(r, WeightMismatchError) for r in results)
        if mismatches:
            self.weight_mismatches.inc(mismatches, tags={"where": "replica"})
        for s in stats:
            self.images_generated.inc(s.images, tags=self._tags)
            self.step_seconds.observe(s.seconds_per_step, tags=self._tags)
            self.policy_version.set(s.policy_version, tags=self._tags)
        return results

    def weight_layout(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        """{tensor name: shape} of a version of this replica's model (the ingress checks uploads against it)."""
        return self.engine.weight_layout(kind, lora)

    async def prefetch_version(self, version: int) -> int:
        """Load a version ahead of the requests that pin it (the trainer may push to warm replicas)."""
        return await asyncio.to_thread(self.engine.prefetch, version)

    async def check_health(self) -> None:
        # Raising makes Serve replace this replica (DiffusersEngine.check_health says what is checked).
        await asyncio.to_thread(self.engine.check_health)
