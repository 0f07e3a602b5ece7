"""Videos through the whole graph (Serve's local testing mode, model=tiny_wan): uint8 [B, F, 3, H, W]
trajectories in whole groups, video rewards (one on a reward deployment), the version stamp, chunks and the work budget counted in
latent frames (422 / 413 naming the field), and the HTTP answer's MP4s (over a live socket too)."""

import base64
import json

import pytest
import torch

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError, RequestTooLargeError
from serve_app.serving.ingress import RolloutPlanner
from serve_app.schemas import RolloutRequest, SamplingParams, TrajectoryBatch
from serve_app.weights import BASE_HASH

OVERRIDES = [
    "model=tiny_wan", "reward=video_brightness", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]",
    "ingress.chunk_size=4", "ingress.max_samples=12", "model.max_request_work=4096",
    # One video reward on a RewardServer deployment of its own: it takes [B, F, 3, H, W] like one in process.
    "reward.components.1.placement=deployment",
]
VIDEO = {"num_frames": 5}  # 2 latent frames of 4x4 tokens


@pytest.fixture(scope="module")
def handle(start_local_app):
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-wan-local")


@pytest.fixture(scope="module")
def batch(handle) -> TrajectoryBatch:
    return handle.rollout.remote(
        RolloutRequest(prompts=["a red circle", "a blue square"], group_size=3, seed=1, sampling=VIDEO)
    ).result()


def test_a_video_rollout_returns_whole_groups_of_uint8_videos(batch):
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 1, 1, 1] and t.sample_index.tolist() == [0, 1, 2] * 2
    assert t.images.shape == (6, 5, 3, 32, 32) and t.images.dtype == torch.uint8
    assert t.latents.shape == (6, 3, 4, 2, 8, 8)  # [B, K+1, C, latent frames, H/4, W/4]
    assert t.log_probs.shape == (6, 2) and bool(torch.isfinite(t.log_probs).all())
    assert t.sampling.num_frames == 5
    assert batch.policy_version == 0 and t.weights_hash == BASE_HASH
    # The frames reward scored every frame of every video, temporal consistency the frame pairs.
    assert set(batch.rewards) == {"frames", "temporal_consistency", "total"}
    frames = t.images.float() / 255.0
    expected = -(frames.mean(dim=(2, 3, 4)) - 0.2).abs().mean(dim=1)  # brightness(target 0.2) per frame, mean
    torch.testing.assert_close(batch.rewards["frames"], expected, atol=1e-5, rtol=0)
    assert bool((batch.rewards["temporal_consistency"] <= 0).all())
    torch.testing.assert_close(batch.rewards["total"],
                               batch.rewards["frames"] + 0.1 * batch.rewards["temporal_consistency"])
    assert batch.advantages.shape == (6,)
    # A group's samples differ (their own seeds), so advantages carry signal.
    assert float(batch.advantages.abs().sum()) > 0


def test_a_retried_video_request_reproduces_it(handle, batch):
    again = handle.rollout.remote(
        RolloutRequest(prompts=["a red circle", "a blue square"], group_size=3, seed=1, sampling=VIDEO)
    ).result().trajectory
    assert torch.equal(again.seeds, batch.trajectory.seeds)
    torch.testing.assert_close(again.log_probs, batch.trajectory.log_probs, atol=1e-6, rtol=0)


def test_bad_frame_counts_and_oversized_videos_are_refused_naming_the_field(handle):
    with pytest.raises(InvalidRequestError, match="multiple of 4") as info:
        handle.rollout.remote({"prompts": ["a"], "group_size": 2, "sampling": {"num_frames": 4}}).result()
    assert info.value.field == "sampling.num_frames"
    # 17 frames = 5 latent frames: more than a replica call takes (chunk_size 4 latent frames).
    with pytest.raises(RequestTooLargeError, match="5 latent frames") as info:
        handle.rollout.remote({"prompts": ["a"], "group_size": 1, "sampling": {"num_frames": 17}}).result()
    assert info.value.field == "sampling.num_frames"
    # The work budget counts every latent frame: 12 one-frame samples x 8 steps x 16 tokens x 2 (CFG) = 3072
    # would fit the budget of 4096; as 5-frame videos (2 latent frames, 32 tokens) it is 6144 and does not.
    cheap = {"prompts": ["a", "b"], "group_size": 6, "sampling": {"num_frames": 5, "num_steps": 3, "guidance_scale": 1.0}}
    assert len(handle.rollout.remote(cheap).result()) == 12  # 12 x 3 x 32 = 1152
    with pytest.raises(RequestTooLargeError, match=r"32 latent tokens \(2 latent frames of 5\) x 2 \(true CFG\) = 6144"
                       ) as info:
        handle.rollout.remote({**cheap, "sampling": {"num_frames": 5, "num_steps": 8, "guidance_scale": 4.0,
                                                     "sde_window_range": [0, 5]}}).result()
    assert info.value.field == "sampling"


def test_the_http_answer_carries_one_mp4_per_sample(batch):
    from serve_app.serving.ingress import to_response
    from serve_app.media import decode_mp4

    answer = json.loads(to_response(batch, images=batch.images).model_dump_json(exclude_none=True))
    assert len(answer["samples"]) == 6
    for sample, video in zip(answer["samples"], batch.trajectory.images):
        assert "image_png_base64" not in sample
        decoded = decode_mp4(base64.b64decode(sample["video_mp4_base64"]))
        assert decoded.shape == (5, 3, 32, 32)
        # H.264 is lossy (colour at half resolution, and these random-model frames are noise): each frame's
        # mean level survives, pixels only roughly.
        torch.testing.assert_close(decoded.float().mean(dim=(1, 2, 3)), video.float().mean(dim=(1, 2, 3)), atol=3, rtol=0)
        assert float((decoded.float() - video.float()).abs().mean()) < 20
    plain = json.loads(to_response(batch, images=None).model_dump_json(exclude_none=True))
    assert "video_mp4_base64" not in plain["samples"][0]


def test_over_a_live_socket_each_samples_mp4_decodes_to_its_video(handle):
    """The HTTP API on loopback over this module's app: the JSON answer's MP4s are the videos a handle caller gets
    for the same seeds, and a frame count the family cannot take is a 422 naming the field."""
    import httpx

    from serve_app.media import decode_mp4
    from tests.http_server import serve_http

    request = {"prompts": ["a red circle"], "group_size": 2, "seed": 3, "sampling": VIDEO}
    by_handle = handle.rollout.remote(RolloutRequest(**request)).result().trajectory
    with serve_http(handle) as url:
        response = httpx.post(f"{url}/v1/rollouts", json={**request, "return_images": True}, timeout=120)
        refused = httpx.post(f"{url}/v1/rollouts", json={**request, "sampling": {"num_frames": 4}}, timeout=30)
    assert response.status_code == 200, response.text
    samples = response.json()["samples"]
    assert [s["seed"] for s in samples] == by_handle.seeds.tolist()
    for sample, frames in zip(samples, by_handle.images):
        assert "image_png_base64" not in sample
        decoded = decode_mp4(base64.b64decode(sample["video_mp4_base64"]))
        assert decoded.shape == (5, 3, 32, 32)
        # H.264 is lossy: each frame's mean level survives, not each pixel.
        torch.testing.assert_close(decoded.float().mean(dim=(1, 2, 3)), frames.float().mean(dim=(1, 2, 3)), atol=3, rtol=0)
    assert refused.status_code == 422 and refused.json()["field"] == "sampling.num_frames"


@pytest.fixture(scope="module")
def wan_text(flowgrpo_home):
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_text_processor

    return load_text_processor(ensure_embedded_model("tiny-wan"))


def _planner(text, geometry, chunk_size=4) -> RolloutPlanner:
    return RolloutPlanner(text, IngressConfig(chunk_size=chunk_size), SamplingParams(num_steps=3, sde_window_range=(0, 1)),
                          geometry, max_work=2**22)


def test_chunks_count_latent_frames(wan_text):
    from serve_app.policies.base import ImageGeometry

    wan = ImageGeometry("wan", 8, 256, temporal_factor=4, max_frames=125)
    planner = _planner(wan_text, wan)
    sizes = {frames: [len(c) for c in planner.plan(RolloutRequest(prompts=["a", "b"], group_size=3, seed=0,
                                                                  sampling={"num_frames": frames})).chunks]
             for frames in (1, 5, 9, 13)}
    # chunk_size 4 latent frames: 1 frame -> 4 samples a chunk, 5 -> 2 (2 latent frames each), 9 and 13 -> 1.
    assert sizes == {1: [4, 2], 5: [2, 2, 2], 9: [1] * 6, 13: [1] * 6}
    # An image family counts as before: one place per sample, and it takes one frame only.
    image = ImageGeometry("qwen_image", 8, 256)
    assert [len(c) for c in _planner(wan_text, image).plan(
        RolloutRequest(prompts=["a", "b"], group_size=3, seed=0)).chunks] == [4, 2]
    with pytest.raises(InvalidRequestError, match="generates images") as info:
        _planner(wan_text, image).plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"num_frames": 5}))
    assert info.value.field == "sampling.num_frames"


def test_a_transformer_with_two_frame_tokens_takes_an_even_number_of_latent_frames():
    from serve_app.policies.base import ImageGeometry

    two_frame_tokens = ImageGeometry("wan", 4, 128, temporal_factor=1, max_frames=64, temporal_patch=2)
    two_frame_tokens.check(32, 32, 4)
    assert two_frame_tokens.tokens(32, 32, 4) == 8 * 8 * 4 // 2
    assert two_frame_tokens.min_frames == 2
    assert ImageGeometry("wan", 16, 128, temporal_factor=4, max_frames=81, temporal_patch=2).min_frames == 5
    assert ImageGeometry("qwen_image", 16, 1024).min_frames == 1
    with pytest.raises(InvalidRequestError, match="multiple of 2") as info:
        two_frame_tokens.check(32, 32, 3)
    assert info.value.field == "sampling.num_frames"
