"""Rewards that compare each sample with its prompt's input images (editing): declared with
`sees_input_images`, called with the input images the model conditioned on, in the aggregator's process."""

import pytest
import torch

from serve_app.rewards import CompositeReward, RewardSpec
from serve_app.rewards import declares_input_images, sees_input_images
from serve_app.schemas import RolloutRequest

CLOSENESS = "tests.rewards.test_input_image_rewards:closeness"


@sees_input_images
def closeness(images: torch.Tensor, prompts, *, input_images) -> torch.Tensor:
    """Minus the mean absolute difference (0-255) of each sample to its prompt's first input image."""
    assert len(input_images) == len(images) == len(prompts)
    sources = torch.stack([row[0] for row in input_images])
    assert sources.shape == images.shape, (sources.shape, images.shape)
    return -(images.float() - sources.float()).abs().mean(dim=(1, 2, 3))


def _image(seed: int, height: int = 24, width: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_an_edit_app_scores_every_sample_against_its_own_prompts_input_image(start_local_app):
    from serve_app.media import resize_image

    overrides = ["model=tiny_qwen_image_edit", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
                 "ingress.chunk_size=2", f"reward.components=[{{name: '{CLOSENESS}'}}, {{name: brightness}}]"]
    handle = start_local_app("diffusion_rollout", overrides, name="flowgrpo-input-image-reward")
    sent = [_image(0), _image(1)]
    batch = handle.rollout.remote(RolloutRequest(prompts=["make it red", "add a circle"], group_size=3, seed=1,
                                                 images=[[sent[0]], [sent[1]]])).result()
    images = batch.fetch(images=True).trajectory.images
    prompt = batch.trajectory.prompt_index
    # What the model conditioned on: each image resized to the 32 x 32 px input area, as the ingress does.
    sources = torch.stack([resize_image(image, 32, 32) for image in sent])[prompt]
    want = -(images.float() - sources.float()).abs().mean(dim=(1, 2, 3))
    torch.testing.assert_close(batch.rewards["closeness"], want)
    # Each sample against its own prompt's image, not the other's.
    swapped = -(images.float() - sources.flip(0).float()).abs().mean(dim=(1, 2, 3))
    assert float((batch.rewards["closeness"] - swapped).abs().max()) > 1.0


def test_a_reward_that_sees_input_images_runs_in_process():
    assert declares_input_images(CLOSENESS) and not declares_input_images("brightness")
    reward = CompositeReward([RewardSpec(name=CLOSENESS), RewardSpec(name="brightness")])
    assert reward.needs_input_images and not CompositeReward([RewardSpec(name="brightness")]).needs_input_images
    images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    values = reward.score(images, ["a", "a"], [torch.full((3, 8, 8), 10, dtype=torch.uint8)])
    assert values["closeness"].tolist() == [-10.0, -10.0]
    with pytest.raises(ValueError, match="runs with placement: in_process"):
        CompositeReward([RewardSpec(name=CLOSENESS, placement="deployment")], servers={"closeness": None})
