"""The aggregator's logic: put a request's chunks back together into whole groups, score rewards,
compute group-relative advantages."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from serve_app.config import AdvantageConfig
from serve_app.errors import GroupIncompleteError, WeightMismatchError
from serve_app.flowgrpo.advantages import group_advantages, tied_group_fraction
from serve_app.rewards import TOTAL_KEY, CompositeReward
from serve_app.schemas import Trajectory, TrajectoryBatch
from serve_app.weights import VersionStore


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


def check_weights_hash(trajectory: Trajectory, store: VersionStore) -> None:
    """Raise WeightMismatchError unless the trajectory's stamp is the content hash published for its version."""
    published = store.published_hash(trajectory.policy_version)
    if trajectory.weights_hash != published:
        raise WeightMismatchError(
            f"policy version {trajectory.policy_version} was sampled with weights {trajectory.weights_hash[:12]}, "
            f"but was published as {published[:12]}: the replicas hold other weights under that version "
            "(another weight store, or a version changed after publishing)"
        )


class TrajectoryAssembler:
    """Whole groups, rewards and advantages. With `store`, every request's weights stamp is checked
    against the content hash published for its version."""

    def __init__(self, reward: CompositeReward, advantage: AdvantageConfig, *, reward_threads: int = 2,
                 store: VersionStore | None = None) -> None:
        self.reward = reward
        self.advantage = advantage
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=reward_threads, thread_name_prefix="reward")

    def score(self, trajectory: Trajectory, prompts: Sequence[str], group_size: int) -> dict[str, torch.Tensor]:
        """Rewards per key, one call per group so a failure names its prompt; groups run in parallel."""
        calls = [
            self._pool.submit(
                self.reward.score, trajectory.images[g * group_size : (g + 1) * group_size], [prompts[g]] * group_size
            )
            for g in range(len(prompts))
        ]
        per_group = [c.result() for c in calls]  # re-raises RewardError naming the reward and prompt
        return {key: torch.cat([r[key] for r in per_group]) for key in per_group[0]}

    def assemble(
        self, trajectories: Sequence[Trajectory], prompts: Sequence[str], group_size: int, *, request_id: str
    ) -> TrajectoryBatch:
        started = time.perf_counter()
        trajectory = merge_chunks(trajectories, len(prompts), group_size)
        if self.store is not None:
            check_weights_hash(trajectory, self.store)
        rewards = self.score(trajectory, prompts, group_size)
        total = rewards[TOTAL_KEY]
        advantages = group_advantages(
            total,
            trajectory.prompt_index,
            std_mode=self.advantage.std_mode,
            eps=self.advantage.eps,
            clip=self.advantage.clip,
        )
        metrics = {
            "reward_mean": float(total.mean()),
            "reward_std": float(total.std(unbiased=False)),
            "tied_group_fraction": tied_group_fraction(total, trajectory.prompt_index),
            "advantage_abs_mean": float(advantages.abs().mean()),
            "num_samples": float(len(trajectory)),
            "policy_version": float(trajectory.policy_version),
            "aggregate_seconds": time.perf_counter() - started,
        }
        for key, value in rewards.items():
            if key != TOTAL_KEY:
                metrics[f"reward_{key}_mean"] = float(value.mean())
        return TrajectoryBatch(trajectory, list(prompts), group_size, rewards, advantages, metrics, request_id)
