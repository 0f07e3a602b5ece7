"""RewardServer: one reward component on a deployment of its own (resources, replicas, runtime_env),
a thin Serve shell over the reward the registry builds. Called by handle with uint8 images
[B, 3, H, W] or videos [B, F, 3, H, W] and prompts; concurrent calls are fused into one reward call
(@serve.batch, serve_app.rewards.composite.score_fused). Values come back unchecked: the caller
checks them (shape, finiteness) and retries."""

from __future__ import annotations

import asyncio

import torch
from ray import serve
from ray.serve import metrics

from serve_app.serving.options import check_reward_server_options
from serve_app.rewards.composite import RewardSpec, resolve_groupwise, score_fused
from serve_app.rewards.registry import build_reward
from serve_app.rewards.video import check_sample_batch


class RewardServer:
    def __init__(self, spec: RewardSpec, key: str) -> None:
        check_reward_server_options(spec, key)
        self.spec = spec
        self.key = key
        self.reward = build_reward(spec.name, **spec.args)
        self.groupwise = resolve_groupwise(spec)
        # Per replica, not a class-level decorator: serve.batch keeps its queue on the function it wraps,
        # which would be shared by every reward server of a process (local testing mode runs them all).
        self._score_fused = serve.batch(
            max_batch_size=spec.server.max_batch_size, batch_wait_timeout_s=spec.server.batch_wait_timeout_s
        )(self._score_batch)
        self.batch_size = metrics.Histogram(
            "flowgrpo_reward_server_batch_calls", description="Calls fused into one reward call by a RewardServer.",
            boundaries=[1, 2, 4, 8, 16, 32, 64], tag_keys=("reward",),
        )
        self.images_scored = metrics.Counter(
            "flowgrpo_reward_server_images", description="Samples (images or videos) scored by a RewardServer.", tag_keys=("reward",)
        )

    async def score(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The reward of each image or video ([B] values); raises what the reward raised on them."""
        check_sample_batch(images, prompts)
        result = await self._score_fused((images, list(prompts)))
        if isinstance(result, Exception):
            raise result
        return result

    def describe(self) -> dict[str, object]:
        return {"key": self.key, "name": self.spec.name, "groupwise": self.groupwise}

    async def _score_batch(self, calls: list[tuple[torch.Tensor, list[str]]]) -> list[object]:
        # A reward is blocking work (a model forward, an HTTP call): a thread keeps the replica answering.
        results = await asyncio.to_thread(score_fused, self.reward, calls, groupwise=self.groupwise)
        tags = {"reward": self.key}
        self.batch_size.observe(len(calls), tags=tags)
        self.images_scored.inc(sum(images.shape[0] for images, _ in calls), tags=tags)
        return results
