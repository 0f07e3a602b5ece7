"""The trainer's figures on the Ray dashboard (Prometheus, `ray_` prefix), beside the app's own."""

from __future__ import annotations

import sys
from typing import Any


class TrainerTelemetry:
    """Gauges and counters a training step updates; the trainer has them only when it runs on a Ray
    cluster (a process without Ray has no metrics agent to export to)."""

    def __init__(self) -> None:
        from ray.util import metrics

        self.staleness = metrics.Gauge(
            "flowgrpo_trainer_staleness", description="Updates between a batch's policy version and its use."
        )
        self.policy_version = metrics.Gauge(
            "flowgrpo_trainer_policy_version", description="The policy version the trainer's weights equal."
        )
        self.weight_sync = metrics.Histogram(
            "flowgrpo_weight_sync_seconds", description="Seconds to publish a version after an update.",
            boundaries=[0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 30],
        )
        self.dropped = metrics.Counter(
            "flowgrpo_trainer_dropped_batches", description="Rollouts dropped for exceeding max_staleness."
        )
        self._dropped_so_far = 0

    def record(self, row: dict[str, Any], *, trainer_version: int) -> None:
        self.staleness.set(float(row["staleness"]))
        self.policy_version.set(float(trainer_version))
        self.weight_sync.observe(float(row["weight_sync_s"]))
        dropped = int(row["dropped_batches"])
        if dropped > self._dropped_so_far:
            self.dropped.inc(dropped - self._dropped_so_far)
            self._dropped_so_far = dropped

    @staticmethod
    def if_on_a_cluster() -> TrainerTelemetry | None:
        # A process that never imported Ray (a trainer over HTTP) is on no cluster, and must not import it now.
        ray = sys.modules.get("ray")
        return TrainerTelemetry() if ray is not None and ray.is_initialized() else None
