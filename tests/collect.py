"""The rollout flow in one process over trajectories already sampled: the coordinator the ingress runs,
with in-process calls (tests of the aggregator's scoring and layout)."""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.schemas import Trajectory, TrajectoryBatch
from serve_app.serving.aggregator import TrajectoryAssembler
from serve_app.serving.coordinator import RolloutCoordinator


def collect(assembler: TrajectoryAssembler, trajectories: Sequence[Trajectory], prompts: Sequence[str],
            group_size: int, *, request_id: str = "r") -> TrajectoryBatch:
    return RolloutCoordinator.in_process(assembler).run_sync(trajectories, prompts, group_size, request_id=request_id)
