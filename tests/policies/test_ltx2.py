"""The LTX-2 adapter over the embedded tiny LTX-2: left-padded tokens and the connectors' sequences, the frame-
dependent shifted schedule, and the joint video + audio latent as the stock LTX2Pipeline has them. (Noise 0 ==
stock __call__, replay ratio 1 and seed-only noise are in tests/conformance, run for every family.)"""

import copy

import numpy as np
import pytest
import torch
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps

from serve_app.media import to_pil
from serve_app.policies import detect_family, load_policy, load_text_processor
from serve_app.policies.ltx2 import LTX2Policy, LTX2TextProcessor


@pytest.fixture(scope="module")
def ltx2_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-ltx2")


@pytest.fixture(scope="module")
def policy(ltx2_dir):
    return load_policy(ltx2_dir)  # the family is detected from model_index.json


def test_detected_family_geometry_and_frozen_parts(policy, ltx2_dir):
    assert detect_family(ltx2_dir) == "ltx2" and isinstance(policy, LTX2Policy)
    pipe = policy.pipeline
    for module in (pipe.text_encoder, pipe.connectors, pipe.vae, pipe.audio_vae, pipe.vocoder):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    assert isinstance(load_text_processor(ltx2_dir), LTX2TextProcessor)  # the ingress's weight-free loader
    frames = 1 + policy.temporal_factor
    assert policy.audio_frames(frames) >= 1
    assert policy.geometry.min_frames == 1 and policy.max_frames > frames


def test_embeddings_are_the_stock_encoders_and_connectors(policy):
    """Left padding to max_sequence_length, every layer's states, the connectors' video and audio sequences."""
    pipe = policy.pipeline
    prompts = ["a cat", "  two green triangles on a very long table  ", "word " * 100]  # spaces; too long
    embeds = policy.encode_prompts(policy.text_processor().tokenize(prompts))
    stock, stock_mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False,
                                                 max_sequence_length=policy.max_sequence_length, device="cpu")
    video, audio, mask = pipe.connectors(stock, stock_mask, padding_side="left")
    assert embeds.embeds.shape == (3, policy.max_sequence_length, video.shape[-1] + audio.shape[-1])
    torch.testing.assert_close(embeds.embeds, torch.cat([video, audio], dim=-1), atol=0, rtol=0)
    assert torch.equal(embeds.mask, mask.bool()) and bool(embeds.mask.all())  # registers fill the padding


def test_the_schedule_is_the_stock_one_shifted_by_the_clips_tokens(policy):
    pipe = policy.pipeline
    short, long = 1 + policy.temporal_factor, 1 + 3 * policy.temporal_factor
    for frames in (short, long):
        frames_latent, rows, columns = policy._grid(32, 32, frames)
        scheduler = copy.deepcopy(pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift(frames_latent * rows * columns, config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        retrieve_timesteps(scheduler, 5, "cpu", sigmas=np.linspace(1.0, 1 / 5, 5), mu=mu)
        torch.testing.assert_close(policy.sigma_schedule(5, 32, 32, frames), scheduler.sigmas.float(), atol=0, rtol=0)
    # More video tokens shift the schedule towards noise: the frame count is part of the schedule's key.
    assert bool((policy.sigma_schedule(5, 32, 32, long)[1:-1] > policy.sigma_schedule(5, 32, 32, short)[1:-1]).all())


def test_a_latent_is_the_packed_video_then_the_packed_audio(policy):
    frames = 1 + policy.temporal_factor
    (n,) = policy.latent_shape(32, 48, frames)
    latents = torch.randn(2, n)
    joint = policy.split(latents, height=32, width=48)
    grid_frames, rows, columns = joint.grid
    assert (rows, columns) == (32 // policy.spatial_multiple, 48 // policy.spatial_multiple)
    assert joint.video.shape == (2, grid_frames * rows * columns, policy.transformer.config.in_channels)
    assert joint.audio.shape[:2] == (2, policy.audio_frames(frames))
    assert torch.equal(policy.join(joint.video, joint.audio), latents)
    # The video part is what the stock pipeline packs from [B, C, F', H', W'] latents.
    unpacked = policy.pipeline._unpack_latents(joint.video, *joint.grid)
    assert torch.equal(policy.pipeline._pack_latents(unpacked), joint.video)
    with pytest.raises(ValueError, match="no 32x48 LTX-2 clip"):
        policy.split(latents[:, :-1], height=32, width=48)


def test_a_checkout_whose_connectors_keep_the_padding_is_refused(policy, monkeypatch):
    monkeypatch.setattr(policy.pipeline.connectors.audio_connector, "learnable_registers", None)
    with pytest.raises(ValueError, match="audio_connector has no learnable registers"):
        LTX2Policy(policy.pipeline, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def i2v_policy(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return load_policy(ensure_embedded_model("tiny-ltx2-i2v"))


def test_the_first_frame_is_the_one_the_stock_image_to_video_call_keeps(i2v_policy):
    """The stock call re-compresses, resizes and encodes the image into its first latent frame, which its loop
    never steps: its latents out hold that frame, to compare with ours (the image as sent, 30 x 50)."""
    pipe = i2v_policy.pipeline
    image = torch.randint(0, 256, (3, 30, 50), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    stock = pipe(image=to_pil(image), prompt="a cat", height=32, width=32, num_frames=5, num_inference_steps=2,
                 guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
                 audio_modality_scale=1.0, max_sequence_length=i2v_policy.max_sequence_length, output_type="latent",
                 generator=torch.Generator().manual_seed(1)).frames
    vae = pipe.vae
    ours = pipe._denormalize_latents(i2v_policy.first_frame(image, 32, 32), vae.latents_mean, vae.latents_std)
    # Leaving the H.264 re-compression out moves this frame by 0.9 at most: far beyond the tolerance.
    torch.testing.assert_close(ours[:, :, 0], stock[:, :, 0], atol=1e-5, rtol=0)
