"""Shapes-world rewards: each prompt is parsed with the scene grammar, each image checked.

Reward factories named by import path in a reward config (configs/reward/shapes.yaml):
``serve_app.worlds.shapes.rewards:shapes_strict`` (1.0 when the image shows exactly what the prompt asks
for, else 0.0) and ``serve_app.worlds.shapes.rewards:shapes_partial`` (``Verdict.partial``: mean of the
count, colour and shape sub-scores). A prompt outside the grammar raises ValueError: it is a
configuration error, not a low score.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from serve_app.rewards.registry import RewardFn, check_image_batch
from .checker import Verdict, check
from .scene import parse_prompt


def _verdict_reward(score: Callable[[Verdict], float]) -> RewardFn:
    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        specs = [parse_prompt(p) for p in prompts]  # all parsed first: fail before any work
        arrays = images.detach().cpu().numpy()
        return torch.tensor([score(check(a, s)) for a, s in zip(arrays, specs)], dtype=torch.float32)

    return reward


def shapes_strict() -> RewardFn:
    """1.0 if every asked object is there with the right colour and shape and nothing else, else 0.0."""
    return _verdict_reward(lambda v: float(v.strict))


def shapes_partial() -> RewardFn:
    """Mean of count, colour and shape sub-scores (see ``checker.Verdict``): 0, 1/3, 2/3 or 1."""
    return _verdict_reward(lambda v: v.partial)
