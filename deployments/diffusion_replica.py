"""DiffusionReplica: a thin Serve shell over RolloutEngine (one policy per replica, batched chunks)."""

from __future__ import annotations

import asyncio
import logging

import torch
from ray import serve
from ray.serve import metrics

from serve_app.config import RolloutConfig
from serve_app.engine import RolloutEngine
from serve_app.schemas import RolloutChunk, Trajectory
from serve_app.weights import open_weight_store

logger = logging.getLogger("ray.serve")

def load_engine(config: RolloutConfig) -> RolloutEngine:
    """Load the configured policy on this process's device, with the weight store the trainer publishes to."""
    from serve_app.policies import load_configured_policy

    if config.replica.backend == "vllm_omni":
        from serve_app.backends import require_vllm_omni

        require_vllm_omni()
    return RolloutEngine(load_configured_policy(config.model), open_weight_store(config))


class DiffusionReplica:
    def __init__(self, config: RolloutConfig) -> None:
        if config.replica.torch_threads is not None:
            # Ray pins OMP_NUM_THREADS to the replica's whole CPUs (1 for a fractional share); a CPU
            # replica that should use the machine's cores says so here.
            torch.set_num_threads(config.replica.torch_threads)
        self.engine = load_engine(config)
        self.generate.set_max_batch_size(config.replica.max_batch_size)
        self.generate.set_batch_wait_timeout_s(config.replica.batch_wait_timeout_s)
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

    @serve.batch(max_batch_size=4, batch_wait_timeout_s=0.01)
    async def generate(self, chunks: list[RolloutChunk]) -> list[Trajectory]:
        # Sampling is CPU/GPU-bound: run it off the event loop so health checks and metrics keep flowing.
        trajectories, stats = await asyncio.to_thread(self.engine.generate, chunks)
        for s in stats:
            self.images_generated.inc(s.images, tags=self._tags)
            self.step_seconds.observe(s.seconds_per_step, tags=self._tags)
            self.policy_version.set(s.policy_version, tags=self._tags)
        return trajectories

    async def prefetch_version(self, version: int) -> int:
        """Load a version ahead of the requests that pin it (the trainer may push to warm replicas)."""
        return await asyncio.to_thread(self.engine.prefetch, version)

    def loaded_version(self) -> int:
        return self.engine.versions.current

    def check_health(self) -> None:
        # A replica whose policy lost its weights cannot serve; raising here makes Serve replace it.
        if self.engine.policy.transformer is None:
            raise RuntimeError("policy transformer is missing")
