import numpy as np
import pytest
import torch

from serve_app.config import load_config
from serve_app.worlds.motion import MotionSpec, render
from serve_app.rewards import CompositeReward, build_reward

STRICT, PARTIAL = "serve_app.worlds.motion.rewards:motion_strict", "serve_app.worlds.motion.rewards:motion_partial"


def videos_of(*drawn: str, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([render(MotionSpec.of(*d.split(" ", 2)), rng) for d in drawn]))


def test_motion_rewards_score_strict_and_partial():
    asked = ["a red circle moving left to right"] * 4
    videos = videos_of("red circle left to right", "blue circle left to right", "red square right to left",
                       "green triangle top to bottom")
    strict, partial = build_reward(STRICT)(videos, asked), build_reward(PARTIAL)(videos, asked)
    assert strict.dtype == partial.dtype == torch.float32
    assert strict.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert partial.tolist() == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_motion_rewards_reject_images_and_prompts_outside_the_grammar():
    reward = build_reward(STRICT)
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        reward(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), ["a red circle moving left to right"] * 2)
    with pytest.raises(ValueError, match="purple"):
        reward(videos_of("red circle left to right"), ["a purple circle moving left to right"])


def test_motion_reward_config_weights_strict_and_partial():
    components = load_config("motion_rollout", ["reward=motion"]).reward.components
    assert [(c.name, c.weight) for c in components] == [(STRICT, 1.0), (PARTIAL, 0.5)]
    composite = CompositeReward(components)  # builds both from the config
    assert composite.keys == ("motion_strict", "motion_partial")
    videos = videos_of("red circle left to right", "red circle top to bottom")
    prompts = ["a red circle moving left to right"] * 2
    values = {k: build_reward(c.name, **c.args)(videos, prompts) for k, c in zip(composite.keys, components)}
    assert composite.total(values).tolist() == pytest.approx([1.5, 0.5 * 2 / 3])


def test_direction_reward_ignores_colour_and_shape_but_not_the_way():
    asked = ["a red circle moving left to right"] * 3
    videos = videos_of("blue square left to right", "red circle right to left", "red circle left to right")
    assert build_reward("serve_app.worlds.motion.rewards:motion_direction")(videos, asked).tolist() == [1.0, 0.0, 1.0]


def test_one_object_direction_reward_closes_the_second_blob_loophole(add_second_blob):
    asked = ["a red circle moving left to right"] * 3
    videos = videos_of("red circle left to right", "red circle left to right", "red circle right to left")
    add_second_blob(videos[1])  # a small red square in the same spot of every frame, away from the subject
    direction = build_reward("serve_app.worlds.motion.rewards:motion_direction")(videos, asked)
    one_object = build_reward("serve_app.worlds.motion.rewards:motion_direction_one_object")(videos, asked)
    assert direction.tolist() == [1.0, 1.0, 0.0]  # the direction follows the largest object: the blob is free
    assert one_object.tolist() == [1.0, 0.0, 0.0]
    components = load_config("motion_rollout").reward.components
    assert [c.name.rsplit(":", 1)[1] for c in components] == ["motion_direction_one_object", "motion_partial"]
