"""The aggregator's logic: score each chunk's samples as they arrive (groupwise rewards once their
group is whole), check that the chunks make whole groups, drop the groups a reward failed on where the
config allows it, compute group-relative advantages over the rest.

It reads images (to score them) and chunk headers (ids, version, weights hash), never the transitions:
those go from the replica to the trainer by reference. The coordinator cuts arriving chunks into
ScoreJobs with a ScoreStream; the aggregator scores each job (TrajectoryAssembler.score) and, once every
chunk is in, lays out the batch (finish).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from serve_app.config import AdvantageConfig
from serve_app.errors import GroupIncompleteError
from serve_app.flowgrpo.advantages import group_advantages, tied_group_fraction
from serve_app.rewards.composite import TOTAL_KEY, CompositeReward, RewardError, RewardObserver
from serve_app.schemas import BatchLayout, ChunkHeader, GroupScores, SampledChunk, ScoreJob
from serve_app.stored import Stored
from serve_app.weights import VersionStore, check_weights_hash


def batch_order(headers: Sequence[ChunkHeader], num_prompts: int, group_size: int) -> tuple[ChunkHeader, torch.Tensor]:
    """The chunks' headers concatenated, and the [P*G] rows of that concatenation in (prompt, sample) order.

    Raises:
        GroupIncompleteError: no chunks, chunks of different versions, or a group that is not whole.
    """
    if not headers:
        raise GroupIncompleteError("no chunks to collect")
    versions = sorted({h.policy_version for h in headers})
    if len(versions) != 1:
        raise GroupIncompleteError(f"chunks of one request were sampled under different policy versions {versions}")
    merged = ChunkHeader.cat(headers)
    _check_whole_groups(merged.prompt_index, merged.sample_index, num_prompts, group_size)
    return merged, torch.argsort(merged.prompt_index * group_size + merged.sample_index)


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
    """One request's arriving chunks -> ScoreJobs.

    Per-sample rewards get a job per (chunk, group) part as soon as the chunk arrives, so a failure
    names its prompt and a chunk holding parts of several groups is scored at once; groupwise
    rewards get one job per group when its last sample arrives (a group may span chunks). Jobs name
    the chunk's images and their rows; the images are fetched where the job is scored.
    """

    def __init__(self, prompts: Sequence[str], group_size: int, *, per_sample: bool = True, groupwise: bool = False,
                 input_images: Sequence[list[torch.Tensor]] | None = None) -> None:
        self.prompts = list(prompts)
        # Each prompt's input images, carried by its jobs when a reward compares samples with them.
        self.input_images = [list(row) for row in input_images] if input_images is not None else None
        self.group_size = group_size
        self.per_sample = per_sample
        self.groupwise = groupwise
        self._waiting: dict[int, list[tuple[torch.Tensor, Stored, torch.Tensor]]] = {}  # group -> parts

    def add(self, chunk: SampledChunk) -> list[ScoreJob]:
        header, jobs = chunk.header, []
        for p in torch.unique(header.prompt_index).tolist():
            if not 0 <= p < len(self.prompts):
                raise GroupIncompleteError(f"a chunk holds samples of prompt {p}, outside the request's {len(self.prompts)}")
            rows = (header.prompt_index == p).nonzero().flatten()
            samples = header.sample_index[rows]
            if self.per_sample:
                jobs.append(ScoreJob(p, self.prompts[p], samples, [(chunk.images, rows)], whole_group=False,
                                     input_images=self._input_images(p)))
            if self.groupwise:
                parts = self._waiting.setdefault(p, [])
                parts.append((samples, chunk.images, rows))
                if sum(len(s) for s, _, _ in parts) >= self.group_size:
                    del self._waiting[p]
                    jobs.append(self._whole_group(p, parts))
        return jobs

    def _whole_group(self, prompt_index: int, parts: list[tuple[torch.Tensor, Stored, torch.Tensor]]) -> ScoreJob:
        """The group's parts with each part's rows in sample order, the parts in order of their first sample."""
        ordered = []
        for samples, images, rows in sorted(parts, key=lambda part: int(part[0].min())):
            order = torch.argsort(samples)
            ordered.append((samples[order], images, rows[order]))
        samples = torch.cat([s for s, _, _ in ordered])
        if not torch.equal(samples, torch.sort(samples).values):
            raise GroupIncompleteError(f"the samples of group {prompt_index} arrived interleaved across chunks")
        return ScoreJob(prompt_index, self.prompts[prompt_index], samples, [(i, r) for _, i, r in ordered],
                        whole_group=True, input_images=self._input_images(prompt_index))

    def _input_images(self, prompt_index: int) -> list[torch.Tensor]:
        return [] if self.input_images is None else self.input_images[prompt_index]


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

    async def score(self, job: ScoreJob) -> GroupScores:
        """One job's values, or its group's drop. Raises RewardError (fail closed) when a reward with
        ``on_error: fail`` failed after its retries."""
        values, failure = await self.reward.score_part(
            await job.images(), job.prompt, whole_group=job.whole_group, input_images=job.input_images,
            executor=self._pool, observer=self.observer
        )
        if failure is not None:
            return GroupScores(job.prompt_index, job.sample_index, {}, failure.reward_name, str(failure))
        return GroupScores(job.prompt_index, job.sample_index, values)

    def finish(self, headers: Sequence[ChunkHeader], scores: Sequence[GroupScores], prompts: Sequence[str],
               group_size: int) -> BatchLayout:
        """Whole groups with their scores -> the batch's rows, rewards and advantages; groups a reward
        failed on are dropped.

        Raises:
            GroupIncompleteError: a group misses samples, or scores of a kept group are missing.
            WeightMismatchError: the weights stamp differs from the published one.
            RewardError: every group was dropped.
        """
        started = time.perf_counter()
        merged, rows = batch_order(headers, len(prompts), group_size)
        if self.store is not None:
            check_weights_hash(merged, self.store)
        per_key, dropped, failed_rewards = self._gather_scores(scores, prompts, group_size)
        if len(dropped) == len(prompts):
            first = min(dropped)
            raise RewardError(failed_rewards[first], prompts[first],
                              f"every group of the request was dropped (on_error: drop_group); first: {dropped[first]}")
        prompt_index = merged.prompt_index[rows]
        keep = ~torch.isin(prompt_index, torch.tensor(sorted(dropped), dtype=torch.long))
        rows, prompt_index = rows[keep], prompt_index[keep]
        rewards = {key: values[keep] for key, values in per_key.items()}
        total = self.reward.total(rewards)
        rewards[TOTAL_KEY] = total
        advantages = group_advantages(
            total, prompt_index, std_mode=self.advantage.std_mode, eps=self.advantage.eps, clip=self.advantage.clip
        )
        metrics = {
            "reward_mean": float(total.mean()),
            "reward_std": float(total.std(unbiased=False)),
            "tied_group_fraction": tied_group_fraction(total, prompt_index),
            "advantage_abs_mean": float(advantages.abs().mean()),
            "num_samples": float(len(rows)),
            "dropped_groups": float(len(dropped)),
            "policy_version": float(merged.policy_version),
            "aggregate_seconds": time.perf_counter() - started,
        }
        for key, value in rewards.items():
            if key != TOTAL_KEY:
                metrics[f"reward_{key}_mean"] = float(value.mean())
        return BatchLayout(rows, rewards, advantages, metrics, merged.policy_version, dict(sorted(dropped.items())))

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
