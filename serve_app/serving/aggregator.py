"""The aggregator's logic: score each chunk's samples as they arrive (groupwise rewards once their
group is whole), put the chunks back together into whole groups, drop the groups a reward failed on
where the config allows it, compute group-relative advantages over the rest.

The ingress cuts arriving trajectories into ScoreJobs with a ScoreStream; the aggregator scores each
job (TrajectoryAssembler.score) and, once every chunk is in, assembles the batch (finish).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from serve_app.config import AdvantageConfig
from serve_app.errors import GroupIncompleteError
from serve_app.flowgrpo.advantages import group_advantages, tied_group_fraction
from serve_app.rewards.composite import TOTAL_KEY, CompositeReward, RewardError, RewardObserver
from serve_app.schemas import GroupScores, ScoreJob, Trajectory, TrajectoryBatch
from serve_app.weights import VersionStore, check_weights_hash


def merge_chunks(trajectories: Sequence[Trajectory], num_prompts: int, group_size: int) -> Trajectory:
    """Concatenate chunk trajectories, check every group is whole, order rows by (prompt, sample).

    The result holds each prompt's embeddings once, in prompt order (embed_row == prompt_index).
    """
    if not trajectories:
        raise GroupIncompleteError("no trajectories to merge")
    versions = {t.policy_version for t in trajectories}
    if len(versions) != 1:
        raise GroupIncompleteError(f"chunks of one request were sampled under different policy versions {sorted(versions)}")
    merged = Trajectory.cat(trajectories)
    _check_whole_groups(merged.prompt_index, merged.sample_index, num_prompts, group_size)
    return merged.take(torch.argsort(merged.prompt_index * group_size + merged.sample_index))


def _check_whole_groups(prompt_index: torch.Tensor, sample_index: torch.Tensor, num_prompts: int, group_size: int) -> None:
    expected = num_prompts * group_size
    key = prompt_index * group_size + sample_index
    counts = torch.bincount(key, minlength=expected) if len(key) else torch.zeros(expected, dtype=torch.long)
    bad_range = (prompt_index >= num_prompts) | (sample_index >= group_size) | (prompt_index < 0) | (sample_index < 0)
    if bool(bad_range.any()) or len(counts) != expected:
        raise GroupIncompleteError(f"samples outside {num_prompts} prompts x group {group_size}")
    missing = (counts == 0).nonzero().flatten()
    duplicated = (counts > 1).nonzero().flatten()
    if len(missing) or len(duplicated):

        def describe(keys: torch.Tensor) -> list[tuple[int, int]]:
            return [(int(k) // group_size, int(k) % group_size) for k in keys[:5]]

        raise GroupIncompleteError(
            f"groups not whole: missing (prompt, sample) {describe(missing)}, duplicated {describe(duplicated)}"
        )


class ScoreStream:
    """One request's arriving chunk trajectories -> ScoreJobs.

    Per-sample rewards get a job per (chunk, group) part as soon as the chunk arrives, so a failure
    names its prompt and a chunk holding parts of several groups is scored at once; groupwise
    rewards get one job per group when its last sample arrives (a group may span chunks).
    """

    def __init__(self, prompts: Sequence[str], group_size: int, *, per_sample: bool = True, groupwise: bool = False) -> None:
        self.prompts = list(prompts)
        self.group_size = group_size
        self.per_sample = per_sample
        self.groupwise = groupwise
        self._waiting: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # group -> (samples, images) parts

    def add(self, trajectory: Trajectory) -> list[ScoreJob]:
        jobs = []
        for p in torch.unique(trajectory.prompt_index).tolist():
            rows = (trajectory.prompt_index == p).nonzero().flatten()
            samples, images = trajectory.sample_index[rows], trajectory.images[rows]
            if not 0 <= p < len(self.prompts):
                raise GroupIncompleteError(f"a chunk holds samples of prompt {p}, outside the request's {len(self.prompts)}")
            if self.per_sample:
                jobs.append(ScoreJob(p, self.prompts[p], samples, images, whole_group=False))
            if self.groupwise:
                parts = self._waiting.setdefault(p, [])
                parts.append((samples, images))
                if sum(len(s) for s, _ in parts) >= self.group_size:
                    del self._waiting[p]
                    samples = torch.cat([s for s, _ in parts])
                    order = torch.argsort(samples)
                    jobs.append(ScoreJob(p, self.prompts[p], samples[order], torch.cat([i for _, i in parts])[order],
                                         whole_group=True))
        return jobs


class TrajectoryAssembler:
    """Scores, whole groups, advantages. With `store`, every request's weights stamp is checked
    against the content hash published for its version; `observer` hears of every reward call."""

    def __init__(self, reward: CompositeReward, advantage: AdvantageConfig, *, reward_threads: int = 2,
                 store: VersionStore | None = None, observer: RewardObserver | None = None) -> None:
        self.reward = reward
        self.advantage = advantage
        self.store = store
        self.observer = observer
        self._pool = ThreadPoolExecutor(max_workers=reward_threads, thread_name_prefix="reward")

    def stream(self, prompts: Sequence[str], group_size: int) -> ScoreStream:
        return ScoreStream(prompts, group_size, per_sample=self.reward.has_per_sample, groupwise=self.reward.has_groupwise)

    async def score(self, job: ScoreJob) -> GroupScores:
        """One job's values, or its group's drop. Raises RewardError (fail closed) when a reward with
        ``on_error: fail`` failed after its retries."""
        values, failure = await self.reward.score_part(
            job.images, job.prompt, whole_group=job.whole_group, executor=self._pool, observer=self.observer
        )
        if failure is not None:
            return GroupScores(job.prompt_index, job.sample_index, {}, failure.reward_name, str(failure))
        return GroupScores(job.prompt_index, job.sample_index, values)

    def finish(self, trajectories: Sequence[Trajectory], scores: Sequence[GroupScores], prompts: Sequence[str],
               group_size: int, *, request_id: str) -> TrajectoryBatch:
        """Whole groups with their scores -> TrajectoryBatch; groups a reward failed on are dropped.

        Raises:
            GroupIncompleteError: a group misses samples, or scores of a kept group are missing.
            WeightMismatchError: the weights stamp differs from the published one.
            RewardError: every group was dropped.
        """
        started = time.perf_counter()
        trajectory = merge_chunks(trajectories, len(prompts), group_size)
        if self.store is not None:
            check_weights_hash(trajectory, self.store)
        per_key, dropped, failed_rewards = self._gather_scores(scores, prompts, group_size)
        if len(dropped) == len(prompts):
            first = min(dropped)
            raise RewardError(failed_rewards[first], prompts[first],
                              f"every group of the request was dropped (on_error: drop_group); first: {dropped[first]}")
        keep = ~torch.isin(trajectory.prompt_index, torch.tensor(sorted(dropped), dtype=torch.long))
        if dropped:
            trajectory = trajectory.take(keep.nonzero().flatten())
        rewards = {key: values[keep] for key, values in per_key.items()}
        total = self.reward.total(rewards)
        rewards[TOTAL_KEY] = total
        advantages = group_advantages(
            total, trajectory.prompt_index, std_mode=self.advantage.std_mode, eps=self.advantage.eps, clip=self.advantage.clip
        )
        metrics = {
            "reward_mean": float(total.mean()),
            "reward_std": float(total.std(unbiased=False)),
            "tied_group_fraction": tied_group_fraction(total, trajectory.prompt_index),
            "advantage_abs_mean": float(advantages.abs().mean()),
            "num_samples": float(len(trajectory)),
            "dropped_groups": float(len(dropped)),
            "policy_version": float(trajectory.policy_version),
            "aggregate_seconds": time.perf_counter() - started,
        }
        for key, value in rewards.items():
            if key != TOTAL_KEY:
                metrics[f"reward_{key}_mean"] = float(value.mean())
        return TrajectoryBatch(trajectory, list(prompts), group_size, rewards, advantages, metrics, request_id,
                               dropped_groups=dict(sorted(dropped.items())))

    def _gather_scores(self, scores: Sequence[GroupScores], prompts: Sequence[str], group_size: int
                       ) -> tuple[dict[str, torch.Tensor], dict[int, str], dict[int, str]]:
        """Per key [P*G] values in (prompt, sample) order; {group: why} and {group: reward} of drops.

        Every sample of a kept group must be scored exactly once by every reward: a number is never
        made up for a missing score.
        """
        size = len(prompts) * group_size
        values = {key: torch.zeros(size) for key in self.reward.keys}
        filled = {key: torch.zeros(size, dtype=torch.long) for key in self.reward.keys}
        dropped: dict[int, str] = {}
        failed_rewards: dict[int, str] = {}
        for part in scores:
            if part.failure is not None:
                if part.prompt_index not in dropped:
                    dropped[part.prompt_index] = part.failure
                    failed_rewards[part.prompt_index] = part.failed_reward or "?"
                continue
            rows = part.prompt_index * group_size + part.sample_index
            for key, v in part.values.items():
                values[key][rows] = v
                filled[key][rows] += 1
        kept = torch.ones(size, dtype=torch.bool)
        for p in dropped:
            kept[p * group_size : (p + 1) * group_size] = False
        for key, count in filled.items():
            wrong = ((count != 1) & kept).nonzero().flatten()
            if len(wrong):
                row = int(wrong[0])
                raise GroupIncompleteError(
                    f"reward {key!r} scored sample {row % group_size} of prompt {row // group_size} "
                    f"{int(count[row])} times, expected once"
                )
        return values, dropped, failed_rewards

    async def assemble_async(
        self, trajectories: Sequence[Trajectory], prompts: Sequence[str], group_size: int, *, request_id: str
    ) -> TrajectoryBatch:
        """Score every chunk, then finish: what the service does, without a stream."""
        stream = self.stream(prompts, group_size)
        jobs = [job for t in trajectories for job in stream.add(t)]
        scores = await asyncio.gather(*(self.score(job) for job in jobs))
        return self.finish(trajectories, scores, prompts, group_size, request_id=request_id)

    def assemble(
        self, trajectories: Sequence[Trajectory], prompts: Sequence[str], group_size: int, *, request_id: str
    ) -> TrajectoryBatch:
        """assemble_async for callers without an event loop (tests, benchmarks, in-process rollouts)."""
        return asyncio.run(self.assemble_async(trajectories, prompts, group_size, request_id=request_id))
