"""The Wan2.1 text-to-video adapter over the embedded tiny Wan: tokens, embeddings, schedule (and the
UniPC -> flow-matching choice for real checkouts), 5-D latents and frames, noise 0 == the stock
WanPipeline.__call__, replay ratio 1, batch independence. (The engine-level contract is in
tests/conformance, run for every family, wan included.)"""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

from serve_app.errors import InvalidRequestError
from serve_app.flowgrpo.sampler import denoise, encode_conditioning, initial_latents, replay_step, sample_group
from serve_app.flowgrpo.sde import sde_step
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies import SUPPORTED_FAMILIES, detect_family, load_policy, load_text_processor
from serve_app.policies.wan import WanPolicy, WanTextProcessor, flow_match_scheduler
from serve_app.schemas import SamplingParams

PROMPT = "a red circle moving left to right"
PARAMS = SamplingParams(height=32, width=32, num_frames=5, num_steps=4, guidance_scale=4.0, noise_level=1.0,
                        sde_window_size=2, sde_window_range=(0, 2), seed=7)


@pytest.fixture(scope="module")
def wan_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-wan")


@pytest.fixture(scope="module")
def policy(wan_dir):
    return load_policy(wan_dir)  # the family is detected from model_index.json


def _with(policy, **components):
    """A policy over the same modules with some pipeline components replaced."""
    pipe = WanPipeline(**{**policy.pipeline.components, **components})
    pipe.set_progress_bar_config(disable=True)
    return WanPolicy(pipe, device=policy.device, dtype=policy.dtype)


def test_detected_family_geometry_and_frozen_parts(policy, wan_dir):
    assert detect_family(wan_dir) == "wan" and "wan" in SUPPORTED_FAMILIES
    assert isinstance(policy, WanPolicy) and not policy.cfg_renormalize
    pipe = policy.pipeline
    for module in (pipe.text_encoder, pipe.vae):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    geometry = policy.geometry
    assert (geometry.spatial_multiple, geometry.temporal_factor, geometry.max_side) == (8, 4, 256)  # VAE 4 x patch 2
    assert geometry.max_frames == 125  # 32 rotary positions in time, 4 frames each after the first
    # 5-D latents: channels, latent frames ((F - 1) / 4 + 1), H / 4, W / 4.
    assert policy.latent_shape(32, 48, 5) == (4, 2, 8, 12)
    assert policy.latent_shape(32, 32, 1) == (4, 1, 8, 8) and policy.latent_shape(32, 32, 9) == (4, 3, 8, 8)
    assert geometry.tokens(32, 32, 9) == 3 * 16  # latent frames x 4x4 patches


def test_num_frames_is_checked_against_the_vaes_temporal_factor(policy, tiny_policy):
    for frames in (1, 5, 9, 125):
        policy.check_size(32, 32, frames)
    for frames, message in ((4, "multiple of 4"), (6, "multiple of 4"), (129, "at most 125 frames")):
        with pytest.raises(InvalidRequestError, match=message) as info:
            policy.check_size(32, 32, frames)
        assert info.value.field == "sampling.num_frames"
    # Image families take exactly one frame.
    tiny_policy.check_size(32, 32, 1)
    with pytest.raises(InvalidRequestError, match="generates images: must be 1; got 5") as info:
        tiny_policy.check_size(32, 32, 5)
    assert info.value.field == "sampling.num_frames"


def test_tokens_and_embeddings_are_what_the_stock_pipeline_feeds(policy, wan_dir):
    pipe = policy.pipeline
    prompts = ["a cat", "", "word " * 100, " two  &amp; dogs "]  # empty, too long, whitespace and HTML to clean
    length = policy.max_sequence_length
    assert length == 32  # 512 capped by the tokenizer's model_max_length
    tokens = policy.text_processor().tokenize(prompts)
    assert [len(t.token_ids["tokenizer"]) for t in tokens][1:3] == [0, 32]
    alone = load_text_processor(wan_dir)  # the ingress's weight-free loader
    assert isinstance(alone, WanTextProcessor) and alone.format(" two  &amp; dogs ") == "two & dogs"
    for a, b in zip(alone.tokenize(prompts), tokens):
        assert torch.equal(a.token_ids["tokenizer"], b.token_ids["tokenizer"])
    embeds = policy.encode_prompts(tokens)
    stock, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=length)
    # Ours travel trimmed to the longest prompt; zero-padded they are the stock embeddings exactly.
    assert embeds.embeds.shape == (4, 32, 16) and embeds.mask.sum(dim=1).tolist()[:3] == [2, 0, 32]
    torch.testing.assert_close(torch.nn.functional.pad(embeds.embeds, (0, 0, 0, length - embeds.embeds.shape[1])),
                               stock, atol=0, rtol=0)
    short = policy.encode_prompts(tokens[:2])
    assert short.embeds.shape[1] == 2  # not padded to a fixed maximum
    torch.testing.assert_close(short.embeds, embeds.embeds[:2, :2], atol=0, rtol=0)


def test_the_schedule_is_the_stock_flow_match_one(policy):
    latents = torch.zeros(1, *policy.latent_shape(32, 32, 5))
    policy.pipeline(prompt="x", guidance_scale=1.0, num_inference_steps=5, height=32, width=32, num_frames=5,
                    latents=latents, output_type="latent", max_sequence_length=policy.max_sequence_length)
    ours = policy.sigma_schedule(5, 32, 32)
    assert ours.shape == (6,) and float(ours[0]) == 1.0 and float(ours[-1]) == 0.0
    torch.testing.assert_close(ours, policy.pipeline.scheduler.sigmas.float(), atol=0, rtol=0)
    # A fixed shift of 3: the frame size does not move it (unlike Flux's dynamic shift).
    torch.testing.assert_close(policy.sigma_schedule(5, 64, 96), ours, atol=0, rtol=0)


def test_a_unipc_checkout_is_sampled_with_flow_match_sigmas_at_its_flow_shift(policy):
    # What a Wan2.1 checkout ships (480p: flow_shift 3.0); its multistep solver is not our one-step transition.
    unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                    num_train_timesteps=1000)
    checkout = _with(policy, scheduler=unipc)
    assert checkout.pipeline.scheduler is unipc  # the stock pipeline keeps its solver
    chosen = flow_match_scheduler(unipc)
    assert isinstance(chosen, FlowMatchEulerDiscreteScheduler) and chosen.config.shift == 3.0
    # The tiny model's scheduler is FlowMatchEuler(shift=3): the same schedule, step for step.
    torch.testing.assert_close(checkout.sigma_schedule(6, 32, 32), policy.sigma_schedule(6, 32, 32), atol=0, rtol=0)
    shift5 = _with(policy, scheduler=UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=5.0,
                                                             prediction_type="flow_prediction"))
    assert bool((shift5.sigma_schedule(6, 32, 32)[1:-1] > policy.sigma_schedule(6, 32, 32)[1:-1]).all())
    with pytest.raises(ValueError, match="flow_shift"):
        _with(policy, scheduler=UniPCMultistepScheduler())  # a schedule of no flow-matching model


def _ode_videos(policy, prompt, params, latents, generators):
    """Our sampler at noise 0 from `latents` [B, ...], every sample of `prompt`: (videos float, log_probs)."""
    tokens = policy.text_processor().tokenize([prompt])
    conditioning = encode_conditioning(policy, tokens, torch.zeros(len(latents), dtype=torch.long), None, params)
    sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width)
    result = denoise(policy, conditioning, latents, sigmas, list(range(params.num_steps - 1)), params, generators)
    return policy.decode(result.final_latents, height=params.height, width=params.width), result.log_probs


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_noise_zero_reproduces_the_stock_pipeline(policy, guidance_scale):
    params = PARAMS.model_copy(update={"noise_level": 0.0, "guidance_scale": guidance_scale, "sde_window_size": None})
    generators = sample_generators(torch.tensor([123, 456]))
    latents = initial_latents(policy, params, generators)
    assert latents.shape == (2, 4, 2, 8, 8)
    stock = policy.pipeline(
        prompt=PROMPT, negative_prompt=params.negative_prompt if guidance_scale > 1 else None,
        guidance_scale=guidance_scale, height=32, width=32, num_frames=5, num_inference_steps=params.num_steps,
        max_sequence_length=policy.max_sequence_length, latents=latents.clone(), num_videos_per_prompt=2,
        output_type="pt",
    ).frames
    video, log_probs = _ode_videos(policy, PROMPT, params, latents, generators)
    assert video.shape == stock.shape == (2, 5, 3, 32, 32) and float(stock.std()) > 1e-2
    torch.testing.assert_close(video, stock, atol=1e-5, rtol=0)
    assert torch.equal(log_probs, torch.zeros(2, params.num_steps - 1))


def test_true_cfg_changes_the_video(policy, ode_sample):
    generators = sample_generators(torch.tensor([123]))
    videos = []
    for scale in (1.0, 6.0):
        params = PARAMS.model_copy(update={"noise_level": 0.0, "guidance_scale": scale, "sde_window_size": None,
                                           "negative_prompt": "a blue square"})
        videos.append(ode_sample(policy, PROMPT, params, initial_latents(policy, params, generators), generators)[0])
    assert float((videos[0] - videos[1]).abs().max()) > 1e-3


@pytest.fixture(scope="module")
def group(policy):
    return sample_group(policy, policy.text_processor().tokenize(["a cat", "a dog on grass"]), 2, PARAMS,
                        policy_version=0)


def test_rollout_records_5d_window_latents_and_uint8_videos(policy, group):
    assert group.latents.shape == (4, 3, 4, 2, 8, 8)  # [B, K+1, C, F', H', W']
    assert group.images.shape == (4, 5, 3, 32, 32) and group.images.dtype == torch.uint8
    assert group.log_probs.shape == (4, 2) and bool(torch.isfinite(group.log_probs).all())
    assert group.prompt_embeds.pooled is None and group.negative_embeds is not None


def test_the_log_prob_is_the_mean_over_every_latent_dimension_frames_included(policy, group):
    k = 0
    step = replay_step(policy, group, k)
    x_next = group.latents[:, k + 1].float()
    per_dim = (-((x_next - step.mean) ** 2) / (2 * step.std**2) - torch.log(step.std)
               - 0.5 * torch.log(torch.tensor(2 * torch.pi)))
    assert per_dim.shape == (4, 4, 2, 8, 8)
    torch.testing.assert_close(group.log_probs[:, k], per_dim.mean(dim=(1, 2, 3, 4)), atol=1e-5, rtol=0)
    # The last frame's dims count as much as the first's: dropping a frame moves the mean.
    assert float((per_dim[:, :, :1].mean(dim=(1, 2, 3, 4)) - per_dim.mean(dim=(1, 2, 3, 4))).abs().max()) > 1e-4


def test_replay_gives_ratio_one(policy, group):
    for k in range(group.log_probs.shape[1]):
        replayed = replay_step(policy, group, k)
        ratio = torch.exp(replayed.log_prob - group.log_probs[:, k])
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
    alone = replay_step(policy, group, 1, rows=torch.tensor([3]))
    torch.testing.assert_close(alone.log_prob, group.log_probs[3:, 1], atol=1e-6, rtol=0)


def test_a_samples_video_does_not_depend_on_its_batch(policy, group):
    # Sample 1 of prompt 0 in a batch of four vs the same seed alone in a request of one prompt.
    row = 1
    alone = sample_group(policy, policy.text_processor().tokenize(["a cat"]), 2, PARAMS, policy_version=0).take(
        torch.tensor([row]))
    assert int(alone.seeds[0]) == int(group.seeds[row])
    torch.testing.assert_close(alone.latents[0], group.latents[row], atol=1e-5, rtol=0)
    torch.testing.assert_close(alone.log_probs[0], group.log_probs[row], atol=1e-6, rtol=0)
    assert int((alone.images[0].int() - group.images[row].int()).abs().max()) <= 1
    assert float((group.latents[0, -1] - group.latents[1, -1]).abs().max()) > 1e-2  # the seed does matter


def test_sde_step_takes_5d_latents(policy):
    x = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    v = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(1))
    out = sde_step(v, x, 0.8, 0.6, noise_level=1.0, generator=sample_generators(torch.tensor([1, 2])))
    assert out.prev_sample.shape == x.shape and out.log_prob.shape == (2,) and out.std.shape == (2, 1, 1, 1, 1)


def test_the_config_loads_the_embedded_wan(flowgrpo_home):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    config = load_config("diffusion_rollout", ["model=tiny_wan", "reward=video_brightness", "model.device=cpu"])
    assert config.model.family == "wan" and config.model.embedded == "tiny-wan"
    assert isinstance(load_configured_policy(config.model), WanPolicy)
