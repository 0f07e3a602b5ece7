"""Rollouts in flight while the trainer updates: the overlap of sampling and training, in one place.

With `max_staleness` k, up to k rollout requests are already sent (pinned to the newest policy
version at the time) while the trainer runs an update, so a batch is used at most k updates after
the version it was sampled with. k = 0 is the strict on-policy loop: one request, sent after the
previous update was published.

The rollouts in flight are part of a run's state: a checkpoint records them (`in_flight`) and a resumed
pipeline sends them again, each pinned to the version it was pinned to, before any new one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from serve_app.schemas import TrajectoryBatch


@dataclass
class Pending:
    """One rollout request in flight: which rollout it is (its prompts and seed) and when it finished."""

    index: int
    version: int
    future: Future[TrajectoryBatch]
    sent_at: float
    done_at: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Delivered:
    """A finished rollout as the trainer takes it."""

    index: int
    version: int  # the version the request was pinned to
    batch: TrajectoryBatch
    sampling_seconds: float  # sent to finished
    trainer_idle_seconds: float  # how long the trainer waited for it
    rollout_wait_seconds: float  # how long it waited, finished, for the trainer


class RolloutPipeline:
    """Sends `request(index, version)` for rollout 0, 1, 2, ... and hands back the results in order.

    Call `take(version)` when the trainer needs its next batch (it sends one first if none is in
    flight), then `prefill(version)` before an update: that keeps `max_staleness` requests in flight
    during the update, each pinned to `version`. `resent` are the (index, version) pairs a checkpoint
    recorded in flight, from `first_index` on: they are sent again, as they were, before any new rollout.
    """

    def __init__(self, request: Callable[[int, int], TrajectoryBatch], *, max_staleness: int, first_index: int = 0,
                 resent: Sequence[tuple[int, int]] = ()) -> None:
        indices = [index for index, _ in resent]
        if indices != list(range(first_index, first_index + len(indices))):
            raise ValueError(f"rollouts in flight {indices} do not follow rollout {first_index - 1}")
        self.request = request
        self.max_staleness = max_staleness
        self.next_index = first_index
        self.pending: deque[Pending] = deque()
        self._resent = [version for _, version in resent]
        self._pool = ThreadPoolExecutor(max_workers=max(max_staleness, len(resent)) + 1, thread_name_prefix="rollout")

    def in_flight(self) -> list[tuple[int, int]]:
        """(index, version) of each rollout sent and not yet taken, oldest first (what a checkpoint records)."""
        waiting = range(self.next_index, self.next_index + len(self._resent))
        return [(p.index, p.version) for p in self.pending] + list(zip(waiting, self._resent))

    def _send_resent(self) -> None:
        resent, self._resent = self._resent, []
        for version in resent:
            self._send(version)

    def _send(self, version: int) -> None:
        future = self._pool.submit(self.request, self.next_index, version)
        pending = Pending(self.next_index, version, future, time.perf_counter())
        pending.future.add_done_callback(lambda _: pending.done_at.append(time.perf_counter()))
        self.pending.append(pending)
        self.next_index += 1

    def start(self, version: int) -> None:
        """Make sure the next rollout is in flight: the resent ones first, else one sent at `version`."""
        self._send_resent()
        if not self.pending:
            self._send(version)

    def take(self, version: int) -> Delivered:
        """The oldest rollout in flight (one is sent at `version` if none is), waiting for it."""
        self.start(version)
        pending = self.pending.popleft()
        asked = time.perf_counter()
        batch = pending.future.result()
        taken = time.perf_counter()
        finished = pending.done_at[0] if pending.done_at else taken
        return Delivered(
            index=pending.index,
            version=pending.version,
            batch=batch,
            sampling_seconds=finished - pending.sent_at,
            trainer_idle_seconds=taken - asked,
            rollout_wait_seconds=max(0.0, asked - finished),
        )

    def prefill(self, version: int) -> None:
        """Keep `max_staleness` rollouts in flight through the coming update, pinned to `version`."""
        self._send_resent()
        while len(self.pending) < self.max_staleness:
            self._send(version)

    def close(self) -> None:
        """Stop sending; rollouts in flight finish and are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()
