"""One rollout request from plan to batch: sample each chunk, score each as it arrives, collect whole
groups and advantages. The calls are injected - the ingress deployment gives it handle calls, a test or
benchmark in-process ones - so the flow that serves is the flow that is tested.

What moves where: a chunk's header (ids, seeds, log-probs, version) comes back to the coordinator; its
images go to the rewards and its transitions to the trainer, each as the sampling call returned them
(references on a cluster): nothing heavy passes through here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from serve_app.schemas import BatchLayout, ChunkHeader, GroupScores, SampledChunk, ScoreJob, Trajectory, TrajectoryBatch
from serve_app.serving.aggregator import ScoreStream, TrajectoryAssembler

# What a chunk is depends on the sampling call: a RolloutChunk for a replica, a Trajectory already sampled.
SampleCall = Callable[[Any], Awaitable[SampledChunk]]
ScoreCall = Callable[[ScoreJob], Awaitable[GroupScores]]
CollectCall = Callable[[list[str], int, list[GroupScores], list[ChunkHeader]], Awaitable[BatchLayout]]


@dataclass(frozen=True)
class Scoring:
    """Which score jobs the rewards need, and when: per-sample parts, whole groups, while sampling."""

    per_sample: bool = True
    groupwise: bool = False
    while_sampling: bool = True
    input_images: bool = False  # jobs carry their prompt's input images (a reward compares samples with them)


async def all_or_cancel(coroutines: Sequence[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Their results in order; the first failure cancels the rest (a failed request stops sampling and
    scoring its other chunks) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def engine_sample_call(engine: Any) -> SampleCall:
    """A chunk sampled on a SamplingEngine in this process (a thread keeps the event loop free), held by value."""

    async def sample(chunk: Any) -> SampledChunk:
        [result], _ = await asyncio.to_thread(engine.generate, [chunk])
        if isinstance(result, Exception):
            raise result
        return SampledChunk.of(result)

    return sample


class RolloutCoordinator:
    """Runs planned requests with the given calls (see the module doc)."""

    def __init__(self, sample: SampleCall, score: ScoreCall, collect: CollectCall, scoring: Scoring) -> None:
        self.sample = sample
        self.score = score
        self.collect = collect
        self.scoring = scoring

    @classmethod
    def in_process(cls, assembler: TrajectoryAssembler, *, sample: SampleCall | None = None,
                   while_sampling: bool = True) -> RolloutCoordinator:
        """Every call in this process: the assembler's scoring and layout, and `sample` (by default the
        chunks are trajectories already sampled, held by value)."""

        async def sampled(trajectory: Trajectory) -> SampledChunk:
            return SampledChunk.of(trajectory)

        async def collect(prompts: list[str], group_size: int, scores: list[GroupScores],
                          headers: list[ChunkHeader]) -> BatchLayout:
            return assembler.finish(headers, scores, prompts, group_size)

        reward = assembler.reward
        scoring = Scoring(reward.has_per_sample, reward.has_groupwise, while_sampling, reward.needs_input_images)
        return cls(sample or sampled, assembler.score, collect, scoring)

    async def run(self, chunks: Sequence[Any], prompts: Sequence[str], group_size: int, *, request_id: str,
                  input_images: Sequence[list[torch.Tensor]] | None = None) -> TrajectoryBatch:
        """The batch of a planned request: whole groups or an error (a chunk's, a reward's, the collect's).
        ``input_images``: each prompt's, for the rewards that compare samples with them."""
        started = time.perf_counter()
        prompts = list(prompts)
        stream = ScoreStream(prompts, group_size, per_sample=self.scoring.per_sample, groupwise=self.scoring.groupwise,
                             input_images=input_images if self.scoring.input_images else None)

        async def sample_and_score(chunk: Any) -> tuple[SampledChunk, list[GroupScores]]:
            sampled = await self.sample(chunk)
            if not self.scoring.while_sampling:
                return sampled, []
            return sampled, await all_or_cancel([self.score(job) for job in stream.add(sampled)])

        done = await all_or_cancel([sample_and_score(chunk) for chunk in chunks])
        sampled_chunks = [sampled for sampled, _ in done]
        scores = [part for _, parts in done for part in parts]
        if not self.scoring.while_sampling:
            scores = await all_or_cancel([self.score(job) for c in sampled_chunks for job in stream.add(c)])
        layout = await self.collect(prompts, group_size, scores, [c.header for c in sampled_chunks])
        metrics = {**layout.metrics, "rollout_seconds": time.perf_counter() - started}
        return TrajectoryBatch(sampled_chunks, layout.rows, prompts, group_size, layout.rewards, layout.advantages,
                               metrics, request_id, layout.policy_version, layout.dropped_groups)

    def run_sync(self, chunks: Sequence[Any], prompts: Sequence[str], group_size: int, *, request_id: str,
                 input_images: Sequence[list[torch.Tensor]] | None = None) -> TrajectoryBatch:
        """:meth:`run` for callers without an event loop (tests, benchmarks, in-process rollouts)."""
        return asyncio.run(self.run(chunks, prompts, group_size, request_id=request_id, input_images=input_images))
