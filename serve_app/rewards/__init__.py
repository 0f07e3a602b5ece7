"""Rewards for rollouts: a registry of named rewards and their weighted combination."""

from .builtin import brightness, color_target, jpeg_compressibility, jpeg_incompressibility, saturation
from .composite import TOTAL_KEY, CompositeReward, RewardError, RewardSpec
from .registry import (
    RewardFactory,
    RewardFn,
    build_reward,
    check_image_batch,
    declared_input,
    declares_input_images,
    register_reward,
    registered_rewards,
    sees_input_images,
    takes,
)

__all__ = [
    "TOTAL_KEY",
    "CompositeReward",
    "RewardError",
    "RewardFactory",
    "RewardFn",
    "RewardSpec",
    "brightness",
    "build_reward",
    "check_image_batch",
    "declared_input",
    "declares_input_images",
    "color_target",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "register_reward",
    "registered_rewards",
    "saturation",
    "sees_input_images",
    "takes",
]

