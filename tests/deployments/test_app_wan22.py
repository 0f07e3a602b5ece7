"""Wan2.2's two experts through the whole graph (Serve's local testing mode, model=tiny_wan22): a request by
handle with guidance_scale_2, whose SDE window lies across the expert boundary and replays with ratio 1 on the
trainer's side, and the HTTP answer's MP4s."""

import base64
import json

import pytest
import torch

from serve_app.schemas import RolloutRequest, TrajectoryBatch
from serve_app.serving.engine_contract import replay_verdict
from serve_app.weights import BASE_HASH

OVERRIDES = [
    "model=tiny_wan22", "reward=video_brightness", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
    "sampling.num_frames=5", "ingress.chunk_size=4",
]


@pytest.fixture(scope="module")
def batch(start_local_app) -> TrajectoryBatch:
    handle = start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-wan22-local")
    return handle.rollout.remote(
        RolloutRequest(prompts=["a red circle"], group_size=2, seed=3, sampling={"guidance_scale_2": 2.0})
    ).result()


def test_a_two_expert_rollout_by_handle_replays_with_ratio_one(batch):
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    t = batch.trajectory
    assert t.images.shape == (2, 5, 3, 32, 32) and t.images.dtype == torch.uint8
    assert t.latents.shape == (2, 3, 4, 2, 8, 8) and t.sampling.guidance_scale_2 == 2.0
    assert batch.policy_version == 0 and t.weights_hash == BASE_HASH
    policy = load_policy(ensure_embedded_model("tiny-wan22"))
    # The window (steps 0 and 1) has one step on each expert.
    assert [policy.expert_at_sigma(t.sigmas[i]) for i in t.step_indices.tolist()] == ["transformer", "transformer_2"]
    verdict = replay_verdict(policy, t)
    assert verdict.ok, verdict.message


def test_the_http_answer_carries_one_mp4_per_sample(batch):
    from serve_app.serving.ingress import to_response
    from serve_app.media import decode_mp4

    answer = json.loads(to_response(batch, images=batch.images).model_dump_json(exclude_none=True))
    assert len(answer["samples"]) == 2
    for sample, video in zip(answer["samples"], batch.trajectory.images):
        decoded = decode_mp4(base64.b64decode(sample["video_mp4_base64"]))
        assert decoded.shape == (5, 3, 32, 32)
        torch.testing.assert_close(decoded.float().mean(dim=(1, 2, 3)), video.float().mean(dim=(1, 2, 3)), atol=3,
                                   rtol=0)
