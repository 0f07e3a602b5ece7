import numpy as np
import pytest
import torch

from serve_app.config import RewardConfig
from serve_app.worlds.motion import MotionSpec, render
from serve_app.rewards import CompositeReward, RewardSpec, build_reward, register_reward, registered_rewards
from serve_app.rewards.video import check_video_batch

SHAPES_STRICT = "serve_app.worlds.shapes.rewards:shapes_strict"


def grey_video(levels: list[int], size: int = 8) -> torch.Tensor:
    """uint8 [F, 3, size, size], frame f uniformly levels[f]."""
    return torch.tensor(levels, dtype=torch.uint8)[:, None, None, None].expand(-1, 3, size, size).contiguous()


def test_video_rewards_are_registered():
    assert {"frames", "temporal_consistency", "first_frame"} <= set(registered_rewards())


@pytest.mark.parametrize("videos, prompts, match", [
    (torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"], r"\[B, F, 3, H, W\]"),
    (torch.zeros(2, 4, 3, 8, 8), ["a", "b"], "uint8"),
    (torch.zeros(2, 4, 1, 8, 8, dtype=torch.uint8), ["a", "b"], r"\[B, F, 3, H, W\]"),
    (torch.zeros(2, 0, 3, 8, 8, dtype=torch.uint8), ["a", "b"], "F >= 1"),
    (np.zeros((2, 4, 3, 8, 8), dtype=np.uint8), ["a", "b"], "ndarray"),
    (torch.zeros(2, 4, 3, 8, 8, dtype=torch.uint8), ["a"], "expected 2 prompts, one per video, got 1"),
    (torch.zeros(2, 4, 3, 8, 8, dtype=torch.uint8), "ab", "got a str"),
])
def test_check_video_batch_rejects_what_is_no_video_batch(videos, prompts, match):
    with pytest.raises(ValueError, match=match):
        check_video_batch(videos, prompts)


def test_frames_reduces_an_image_reward_by_mean_or_min():
    videos = torch.stack([grey_video([0, 51, 102, 255]), grey_video([204, 204, 204, 204])])
    per_frame = -(torch.tensor([[0, 51, 102, 255], [204] * 4]) / 255.0 - 0.8).abs()  # brightness(0.8) per frame
    mean = build_reward("frames", reward="brightness", target=0.8)(videos, ["a", "b"])
    low = build_reward("frames", reward="brightness", reduce="min", target=0.8)(videos, ["a", "b"])
    assert mean.dtype == low.dtype == torch.float32
    torch.testing.assert_close(mean, per_frame.mean(1))
    torch.testing.assert_close(low, per_frame.amin(1))
    assert mean[0] > low[0] and mean[1] == low[1]


_SEEN: list = []


@register_reward("test_video_frame_recorder")
def _frame_recorder():
    def reward(images, prompts):
        _SEEN.append((images.clone(), list(prompts)))
        return images.float().mean(dim=(1, 2, 3))

    return reward


def test_frames_scores_all_frames_in_one_call_in_video_order():
    _SEEN.clear()
    videos = torch.randint(0, 256, (3, 5, 3, 4, 4), dtype=torch.uint8)
    values = build_reward("frames", reward="test_video_frame_recorder")(videos, ["p0", "p1", "p2"])
    (images, prompts), = _SEEN
    assert torch.equal(images, videos.reshape(15, 3, 4, 4))
    assert prompts == ["p0"] * 5 + ["p1"] * 5 + ["p2"] * 5
    torch.testing.assert_close(values, videos.float().mean(dim=(2, 3, 4)).mean(1))


def test_frames_of_the_shapes_checker_with_min_needs_every_frame_right():
    spec = MotionSpec.of("red", "circle", "left to right")
    video = torch.from_numpy(render(spec, np.random.default_rng(0)))
    broken = video.clone()
    broken[3] = broken[3].flip(0)  # frame 3 in other colours: no red circle there
    prompts = ["a red circle", "a red circle"]
    videos = torch.stack([video, broken])
    assert build_reward("frames", reward=SHAPES_STRICT, reduce="min")(videos, prompts).tolist() == [1.0, 0.0]
    assert build_reward("frames", reward=SHAPES_STRICT)(videos, prompts).tolist() == pytest.approx([1.0, 7 / 8])


@register_reward("test_video_groupwise", groupwise=True)
def _groupwise():
    return lambda images, prompts: torch.zeros(len(prompts))


def test_frames_rejects_bad_configuration():
    with pytest.raises(ValueError, match="reduce must be one of mean, min"):
        build_reward("frames", reward="brightness", reduce="max")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("frames", reward="nope")
    with pytest.raises(ValueError, match="groupwise"):
        build_reward("frames", reward="test_video_groupwise")
    with pytest.raises(ValueError, match="target must be in"):
        build_reward("frames", reward="brightness", target=2.0)
    with pytest.raises(ValueError, match="bad args for reward 'brightness'"):
        build_reward("frames", reward="brightness", colour=1)


def test_frames_is_configured_with_flat_args():
    config = RewardConfig(components=[{"name": "frames", "args": {"reward": "color_target", "reduce": "min",
                                                                    "rgb": [1.0, 0.0, 0.0]}}])
    composite = CompositeReward(config.components)
    red = torch.zeros(1, 2, 3, 4, 4, dtype=torch.uint8)
    red[:, :, 0] = 255
    spec: RewardSpec = config.components[0]
    assert composite.keys == ("frames",) and spec.args["reward"] == "color_target"
    reward = build_reward(spec.name, **spec.args)
    assert reward(red, ["x"]).tolist() == [0.0]
    red[0, 1] = 0  # a black frame: the worst frame decides
    assert reward(red, ["x"]).tolist() == pytest.approx([-(1 / 3) ** 0.5])


def test_temporal_consistency_values():
    plain = build_reward("temporal_consistency")
    still = grey_video([90] * 4)
    flicker = grey_video([0, 255, 0, 255])
    fade = grey_video([0, 51, 102, 153])  # 0.2 a step
    values = plain(torch.stack([still, flicker, fade]), ["p"] * 3)
    assert values.dtype == torch.float32
    assert values.tolist() == pytest.approx([0.0, -1.0, -0.2])
    # Uniform noise: E|U - V| = 1/3 for independent uniforms on [0, 1]; 9,216 differences put the
    # mean within 0.0025 (one standard deviation) of it.
    noise = torch.randint(0, 256, (1, 4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert plain(noise, ["p"]).item() == pytest.approx(-1 / 3, abs=0.01)


def test_temporal_consistency_with_shifts_forgives_steady_motion_not_flicker():
    rng = np.random.default_rng(0)
    moving = torch.from_numpy(np.stack([render(MotionSpec.of("blue", "square", d), rng, frames=5)
                                        for d in ("left to right", "bottom to top")]))
    plain, shifted = build_reward("temporal_consistency"), build_reward("temporal_consistency", max_shift=8)
    prompts = ["p", "p"]
    assert (plain(moving, prompts) < -0.005).all()  # a moving object differs from frame to frame
    assert shifted(moving, prompts).tolist() == [0.0, 0.0]  # ... by a shift only: up to 6 px a frame here
    popping = moving.clone()
    popping[:, 2] = popping[:, 2].flip(1)  # frame 2 swaps its colour channels
    assert (shifted(popping, prompts) < -0.005).all()
    jump = torch.zeros(1, 2, 3, 32, 32, dtype=torch.uint8)
    jump[0, 0, :, 10:16, 0:6] = 255  # from the left edge ...
    jump[0, 1, :, 10:16, 26:32] = 255  # ... to the right one: 20 px, beyond any shift
    assert shifted(jump, ["p"]).item() < -0.02  # >= 36 of 1,024 pixels white against black: -0.035


def test_temporal_consistency_rejects_bad_input():
    with pytest.raises(ValueError, match="max_shift"):
        build_reward("temporal_consistency", max_shift=-1)
    with pytest.raises(ValueError, match="max_shift"):
        build_reward("temporal_consistency", max_shift=1.5)
    with pytest.raises(ValueError, match="at least 2 frames"):
        build_reward("temporal_consistency")(torch.zeros(1, 1, 3, 8, 8, dtype=torch.uint8), ["p"])


def test_first_frame_scores_each_videos_start_against_its_own_input_image():
    from serve_app.rewards import declares_input_images

    assert declares_input_images("first_frame") and not declares_input_images("temporal_consistency")
    reward = build_reward("first_frame")
    videos = torch.stack([grey_video([51, 0, 0]), grey_video([255, 255, 255])])
    starts = [[torch.full((3, 8, 8), 0, dtype=torch.uint8)], [torch.full((3, 8, 8), 255, dtype=torch.uint8)]]
    # 51/255 = 0.2 off for the first video; the second starts exactly from its image; later frames do not count.
    torch.testing.assert_close(reward(videos, ["a", "b"], input_images=starts), torch.tensor([-0.2, 0.0]))
    torch.testing.assert_close(reward(videos, ["a", "b"], input_images=starts[::-1]), torch.tensor([-0.8, -1.0]))
    with pytest.raises(ValueError, match="exactly one input image per video"):
        reward(videos, ["a", "b"], input_images=[[], []])
    with pytest.raises(ValueError, match="do not match the first frames"):
        reward(videos, ["a", "b"], input_images=[[torch.zeros(3, 4, 4, dtype=torch.uint8)]] * 2)
    # In a composite it runs in process, given each sample its prompt's image.
    composite = CompositeReward([RewardSpec(name="first_frame")])
    assert composite.needs_input_images
    with pytest.raises(ValueError, match="runs with placement: in_process"):
        CompositeReward([RewardSpec(name="first_frame", placement="deployment")], servers={"first_frame": None})
