"""TrajectoryAggregator: a thin Serve shell over TrajectoryAssembler (whole groups, rewards, advantages)."""

from __future__ import annotations

import asyncio

from ray.serve import metrics

from serve_app.assembler import TrajectoryAssembler
from serve_app.config import RolloutConfig
from serve_app.errors import WeightMismatchError
from serve_app.options import check_running_options
from serve_app.rewards import CompositeReward
from serve_app.schemas import Trajectory, TrajectoryBatch
from serve_app.weights import open_weight_store


class TrajectoryAggregator:
    def __init__(self, config: RolloutConfig) -> None:
        check_running_options(config, "TrajectoryAggregator")
        self.assembler = TrajectoryAssembler(
            CompositeReward(config.reward.components),
            config.aggregator.advantage,
            reward_threads=config.aggregator.reward_threads,
            store=open_weight_store(config),
        )
        self.reward_mean = metrics.Gauge("flowgrpo_reward_mean", description="Mean total reward of the last request.")
        self.tied_groups = metrics.Gauge(
            "flowgrpo_tied_group_fraction", description="Share of groups whose rewards all tie (no learning signal)."
        )
        self.groups_collected = metrics.Counter("flowgrpo_groups_collected", description="Whole groups returned.")
        self.weight_mismatches = metrics.Counter(
            "flowgrpo_weight_mismatches", description="Weights found different from the published version.",
            tag_keys=("where",),
        )

    async def collect(
        self, prompts: list[str], group_size: int, request_id: str, *chunks: Trajectory
    ) -> TrajectoryBatch:
        """The chunks' trajectories, sampled and checked by the ingress, into one TrajectoryBatch."""
        try:
            batch = await asyncio.to_thread(self.assembler.assemble, chunks, prompts, group_size, request_id=request_id)
        except WeightMismatchError:
            self.weight_mismatches.inc(tags={"where": "aggregator"})
            raise
        self.reward_mean.set(batch.metrics["reward_mean"])
        self.tied_groups.set(batch.metrics["tied_group_fraction"])
        self.groups_collected.inc(len(prompts))
        return batch
