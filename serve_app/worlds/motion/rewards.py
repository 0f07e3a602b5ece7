"""Moving-shapes rewards: each prompt parsed with the motion grammar, each video checked.

Video rewards (serve_app.rewards.video: ``(videos uint8 [B, F, 3, H, W], prompts) -> float32 [B]``)
named by import path in a reward config (configs/reward/motion.yaml, motion_direction.yaml):
``serve_app.worlds.motion.rewards:motion_strict`` (1.0 when every frame shows just the asked object and it
moves the asked way, else 0.0), ``serve_app.worlds.motion.rewards:motion_direction`` (1.0 when the subject is
found in every frame and moves the asked way, whatever it looks like),
``serve_app.worlds.motion.rewards:motion_direction_one_object`` (the same, and every frame shows exactly one
object) and ``serve_app.worlds.motion.rewards:motion_partial`` (``MotionVerdict.partial``: mean of the colour,
shape and direction sub-scores). A prompt outside the grammar raises ValueError: it is a configuration
error, not a low score.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from serve_app.rewards.registry import RewardFn, takes
from serve_app.rewards.video import check_video_batch
from .checker import MotionVerdict, check_video
from .scene import parse_prompt


def _verdict_reward(score: Callable[[MotionVerdict], float]) -> RewardFn:
    def reward(videos: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_video_batch(videos, prompts)
        specs = [parse_prompt(p) for p in prompts]  # all parsed first: fail before any work
        arrays = videos.detach().cpu().numpy()
        return torch.tensor([score(check_video(a, s)) for a, s in zip(arrays, specs)], dtype=torch.float32)

    return reward


@takes("videos")
def motion_strict() -> RewardFn:
    """1.0 if every frame shows exactly the asked object and it moves in the asked direction, else 0.0."""
    return _verdict_reward(lambda v: float(v.strict))


@takes("videos")
def motion_direction() -> RewardFn:
    """1.0 if the subject is found in every frame and moves in the asked direction, else 0.0."""
    return _verdict_reward(lambda v: float(v.direction_ok))


@takes("videos")
def motion_direction_one_object() -> RewardFn:
    """1.0 if every frame shows exactly one object and it moves in the asked direction, else 0.0: what
    ``motion_direction`` asks without its loophole, a second blob beside the subject (the direction
    follows the largest object in each frame, so extra blobs cost it nothing)."""
    return _verdict_reward(lambda v: float(v.one_object_direction_ok))


@takes("videos")
def motion_partial() -> RewardFn:
    """Mean of colour, shape and direction sub-scores (see ``checker.MotionVerdict``): 0, 1/3, 2/3 or 1."""
    return _verdict_reward(lambda v: v.partial)
