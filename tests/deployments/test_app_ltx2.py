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
    assert float(torch.cdist(final.audio.flatten(1), final.audio.flatten(1)).masked_fill(torch.eye(4, dtype=torch.bool), 1).min()) > 1e-3
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
