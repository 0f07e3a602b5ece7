"""LTX-2 through the whole graph (Serve's local testing mode), the recipe docs/models.md gives: model=tiny_ltx2
reward=video_brightness. Videos scored by a video reward, the audio latents sampled alongside the video's (each
seed its own), the trainer's replay at ratio 1, and the same batch over HTTP as by handle, bitwise."""

import pytest
import torch

from serve_app.http_client import HttpRolloutClient
from serve_app.schemas import RolloutRequest
from tests.http_server import assert_same_batch, serve_http

OVERRIDES = ["model=tiny_ltx2", "reward=video_brightness", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
             "sampling.num_frames=5"]
PROMPTS = ["a red circle", "a blue square"]


@pytest.fixture(scope="module")
def handle(start_local_app):
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-ltx2-local")


@pytest.fixture(scope="module")
def batch(handle):
    return handle.rollout.remote(RolloutRequest(prompts=PROMPTS, group_size=2, seed=1)).result().fetch(images=True)


@pytest.fixture(scope="module")
def policy():
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    return load_configured_policy(load_config("diffusion_rollout", OVERRIDES).model)


def test_videos_are_sampled_with_their_audio_and_scored(batch, policy):
    t = batch.trajectory
    assert t.images.shape == (4, 5, 3, 32, 32) and batch.rewards["total"].isfinite().all()
    final = policy.split(t.latents[:, -1], height=32, width=32)
    assert final.audio.shape[:2] == (4, policy.audio_frames(5))
    # Each sample's audio latents are its own draw: no two samples share them, and the SDE window moved them.
    distances = torch.cdist(final.audio.flatten(1), final.audio.flatten(1))
    assert float(distances.masked_fill(torch.eye(4, dtype=torch.bool), 1).min()) > 1e-3
    start = policy.split(t.latents[:, 0], height=32, width=32)
    assert float((final.audio - start.audio).abs().max()) > 1e-3


def test_the_trainer_replays_the_batch_at_ratio_one(batch, policy):
    from serve_app.serving.engine_contract import replay_verdict

    verdict = replay_verdict(policy, batch.transitions)
    assert verdict.ok, verdict.message


def test_http_gives_the_handles_batch_bitwise(handle):
    want = handle.rollout.remote(RolloutRequest(prompts=PROMPTS[:1], group_size=2, seed=3)).result().fetch()
    with serve_http(handle) as url:
        got = HttpRolloutClient(url).rollout(PROMPTS[:1], group_size=2, seed=3)
    assert_same_batch(got, want)


# Image-to-video: model=tiny_ltx2_i2v reward=video_first_frame, the recipe docs/models.md gives.
I2V_OVERRIDES = ["model=tiny_ltx2_i2v", "reward=video_first_frame", "sampling.num_steps=3",
                 "sampling.sde_window_range=[0,1]", "sampling.num_frames=5"]


def _image(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, 24, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def i2v_handle(start_local_app):
    return start_local_app("diffusion_rollout", I2V_OVERRIDES, name="flowgrpo-ltx2-i2v-local")


def test_image_to_video_starts_each_group_from_its_image_by_handle_and_over_http(i2v_handle):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy
    from serve_app.serving.engine_contract import replay_verdict

    request = RolloutRequest(prompts=PROMPTS, group_size=2, seed=1, images=[[_image(0)], [_image(1)]])
    batch = i2v_handle.rollout.remote(request).result().fetch(images=True)
    assert batch.trajectory.images.shape == (4, 5, 3, 32, 32) and batch.rewards["first_frame"].isfinite().all()
    # The first frame is given, not sampled: the prompt's image conditions its group, not the other.
    other = i2v_handle.rollout.remote(RolloutRequest(prompts=PROMPTS, group_size=2, seed=1,
                                                     images=[[_image(7)], [_image(1)]])).result().fetch(images=True)
    assert float((other.trajectory.images[:2, 0].float() - batch.trajectory.images[:2, 0].float()).abs().max()) > 10
    assert int((other.trajectory.images[2:].int() - batch.trajectory.images[2:].int()).abs().max()) <= 1
    policy = load_configured_policy(load_config("diffusion_rollout", I2V_OVERRIDES).model)
    verdict = replay_verdict(policy, batch.transitions)
    assert verdict.ok, verdict.message
    with serve_http(i2v_handle) as url:
        got = HttpRolloutClient(url).rollout(PROMPTS, group_size=2, seed=1, images=[_image(0), _image(1)])
    assert_same_batch(got, batch)
