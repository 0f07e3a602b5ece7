"""Trajectory.take / Trajectory.cat: the one way a trajectory is cut and joined, and the stamps it
must never lose."""

import dataclasses

import pytest
import torch

from serve_app.flowgrpo.sampler import sample_group
from serve_app.schemas import SamplingOverrides, SamplingParams, Trajectory

PARAMS = SamplingParams(num_steps=4, guidance_scale=1.0, sde_window_size=None, seed=3)


@pytest.fixture(scope="module")
def trajectory(tiny_policy):
    prompts = tiny_policy.text_processor().tokenize(["a cat", "a red house on a hill", "a bowl"])
    return sample_group(tiny_policy, prompts, 2, PARAMS, policy_version=4)


def test_take_keeps_rows_and_only_the_prompts_they_use(trajectory):
    part = trajectory.take(torch.tensor([5, 2, 3]))
    assert part.prompt_index.tolist() == [2, 1, 1] and part.sample_index.tolist() == [1, 0, 1]
    assert torch.equal(part.latents, trajectory.latents[[5, 2, 3]])
    assert torch.equal(part.images, trajectory.images[[5, 2, 3]])
    # Two prompts, one embedding row each, in prompt order, trimmed to the longer of the two.
    assert len(part.prompt_embeds) == 2 and part.embed_row.tolist() == [1, 0, 0]
    for row, sample in zip(part.embed_row.tolist(), (5, 2, 3)):
        original = trajectory.prompt_embeds.select(trajectory.embed_row[[sample]])
        length = original.embeds.shape[1]
        assert torch.equal(part.prompt_embeds.embeds[row, :length], original.embeds[0])
    assert part.policy_version == 4 and part.sampling == trajectory.sampling
    # Copies, not views: a chunk sent to the aggregator does not drag its batch's storage along.
    assert part.latents.untyped_storage().data_ptr() != trajectory.latents.untyped_storage().data_ptr()


def test_cat_of_parts_then_take_in_order_gives_back_the_whole(trajectory):
    parts = [trajectory.take(slice(0, 3)), trajectory.take(slice(3, 6))]
    joined = Trajectory.cat(parts)
    assert len(joined.prompt_embeds) == 4  # the prompt cut in two travels in both parts
    whole = joined.take(torch.arange(len(joined)))
    for name in ("latents", "log_probs", "images", "seeds", "prompt_index", "sample_index"):
        assert torch.equal(getattr(whole, name), getattr(trajectory, name)), name
    assert whole.embed_row.tolist() == whole.prompt_index.tolist()  # once per prompt again
    torch.testing.assert_close(whole.prompt_embeds.embeds, trajectory.prompt_embeds.embeds, atol=0, rtol=0)


def test_cat_refuses_parts_sampled_differently(trajectory):
    other_version = dataclasses.replace(trajectory, policy_version=5)
    with pytest.raises(ValueError, match="different policy_version"):
        Trajectory.cat([trajectory, other_version])
    other_sampling = dataclasses.replace(trajectory, sampling=PARAMS.model_copy(update={"noise_level": 0.3}))
    with pytest.raises(ValueError, match="different sampling"):
        Trajectory.cat([trajectory, other_sampling])
    with pytest.raises(ValueError, match="at least one"):
        Trajectory.cat([])


def test_the_policy_version_has_no_default(trajectory):
    fields = {f.name: getattr(trajectory, f.name) for f in dataclasses.fields(Trajectory) if f.name != "policy_version"}
    with pytest.raises(TypeError, match="policy_version"):
        Trajectory(**fields)


def test_sampling_overrides_are_all_optional_and_merge_once():
    overrides = SamplingOverrides.model_validate({"num_steps": 4, "sde_window_size": None})
    assert overrides.model_dump(exclude_unset=True) == {"num_steps": 4, "sde_window_size": None}
    merged = SamplingParams(sde_window_range=(0, 2)).merged(overrides)
    assert (merged.num_steps, merged.sde_window_size, merged.noise_level) == (4, None, SamplingParams().noise_level)
    with pytest.raises(ValueError, match="Extra inputs"):
        SamplingOverrides.model_validate({"nosie_level": 1})


def test_image_prompts_split_into_texts_and_their_images():
    from serve_app.schemas import ImagePrompt, split_image_prompts

    image = torch.zeros(3, 8, 8, dtype=torch.uint8)
    assert split_image_prompts(["a cat", "a dog"]) == (["a cat", "a dog"], None)
    texts, images = split_image_prompts([ImagePrompt("make it red", (image,)), ImagePrompt("add a hat", (image, image))])
    assert texts == ["make it red", "add a hat"] and [len(i) for i in images] == [1, 2]
    with pytest.raises(ValueError, match="with and without input images"):
        split_image_prompts(["a cat", ImagePrompt("make it red", (image,))])
