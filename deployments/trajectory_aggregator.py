"""TrajectoryAggregator: a thin Serve shell over TrajectoryAssembler (score chunks as they arrive,
whole groups, advantages), with each reward's calls, retries, failures and dropped groups as metrics.
It reads the chunks' images and headers, never their transitions."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import torch
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle

from serve_app.serving.aggregator import TrajectoryAssembler
from serve_app.config import RolloutConfig
from serve_app.errors import WeightMismatchError
from serve_app.serving.options import check_running_options
from serve_app.rewards.composite import CompositeReward, RemoteReward
from serve_app.schemas import BatchLayout, ChunkHeader, GroupScores, ScoreJob
from serve_app.weights import open_weight_store

logger = logging.getLogger("ray.serve")


def _remote(handle: DeploymentHandle) -> RemoteReward:
    async def call(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return await handle.score.remote(images, prompts)

    return call


class RewardMetrics:
    """Per reward key: call latency, retries, failures (after the retries) and dropped groups."""

    def __init__(self) -> None:
        tags = ("reward",)
        self.latency = metrics.Histogram(
            "flowgrpo_reward_latency_seconds", description="Wall time of one reward call (a part of a group).",
            boundaries=[0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30], tag_keys=tags,
        )
        self.retries = metrics.Counter("flowgrpo_reward_retries", description="Reward calls repeated after a failure.",
                                       tag_keys=tags)
        self.failures = metrics.Counter(
            "flowgrpo_reward_failures", description="Reward calls that failed after their retries.", tag_keys=tags
        )
        self.dropped_groups = metrics.Counter(
            "flowgrpo_reward_dropped_groups", description="Groups dropped because a reward failed on them "
            "(on_error: drop_group).", tag_keys=tags,
        )

    def record(self, key: str, outcome: Literal["ok", "retry", "failed"], seconds: float) -> None:
        tags = {"reward": key}
        self.latency.observe(seconds, tags=tags)
        if outcome == "retry":
            self.retries.inc(tags=tags)
        elif outcome == "failed":
            self.failures.inc(tags=tags)


class TrajectoryAggregator:
    def __init__(self, config: RolloutConfig, reward_servers: dict[str, DeploymentHandle] | None = None) -> None:
        check_running_options(config, "TrajectoryAggregator")
        self.reward_metrics = RewardMetrics()
        reward = CompositeReward(
            config.reward.components, servers={key: _remote(h) for key, h in (reward_servers or {}).items()}
        )
        self.assembler = TrajectoryAssembler(
            reward,
            config.aggregator.advantage,
            reward_threads=config.aggregator.reward_threads,
            store=open_weight_store(config),
            observer=self.reward_metrics,
        )
        self._reward_names = dict(zip(reward.keys, (s.name for s in reward.specs)))
        self.reward_mean = metrics.Gauge("flowgrpo_reward_mean", description="Mean total reward of the last request.")
        self.tied_groups = metrics.Gauge(
            "flowgrpo_tied_group_fraction", description="Share of groups whose rewards all tie (no learning signal)."
        )
        self.groups_collected = metrics.Counter("flowgrpo_groups_collected", description="Whole groups returned.")
        self.weight_mismatches = metrics.Counter(
            "flowgrpo_weight_mismatches", description="Weights found different from the published version.",
            tag_keys=("where",),
        )

    def scoring(self) -> dict[str, bool]:
        """Which jobs the ingress's ScoreStream makes: per-sample parts, whole groups, or both; and whether
        they carry their prompt's input images."""
        reward = self.assembler.reward
        return {"per_sample": reward.has_per_sample, "groupwise": reward.has_groupwise,
                "input_images": reward.needs_input_images}

    async def score(self, job: ScoreJob) -> GroupScores:
        """One part of a group (or a whole group) scored; RewardError when a reward failed closed."""
        return await self.assembler.score(job)

    async def collect(self, prompts: list[str], group_size: int, scores: list[GroupScores],
                      headers: list[ChunkHeader]) -> BatchLayout:
        """The chunks' headers and their scores -> the batch's rows, rewards and advantages (the chunks'
        tensors never come here: the images were fetched to score them, the transitions go to the trainer)."""
        try:
            layout = await asyncio.to_thread(self.assembler.finish, headers, scores, prompts, group_size)
        except WeightMismatchError:
            self.weight_mismatches.inc(tags={"where": "aggregator"})
            raise
        keys = {name: key for key, name in self._reward_names.items()}
        for group, why in layout.dropped_groups.items():
            failed = next((s.failed_reward for s in scores if s.prompt_index == group and s.failed_reward), None)
            self.reward_metrics.dropped_groups.inc(tags={"reward": keys.get(failed or "", failed or "unknown")})
            logger.warning("dropped group %d (%s): %s", group, prompts[group], why)
        self.reward_mean.set(layout.metrics["reward_mean"])
        self.tied_groups.set(layout.metrics["tied_group_fraction"])
        self.groups_collected.inc(len(prompts) - len(layout.dropped_groups))
        return layout
