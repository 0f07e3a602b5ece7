"""The SD3 adapter over the embedded tiny SD3: stock-pipeline parity, replay, family detection."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from serve_app.flowgrpo.sampler import initial_latents, replay_step, sample_group
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies import SUPPORTED_FAMILIES, detect_family, load_policy, load_text_processor
from serve_app.policies.sd3 import SD3Policy, SD3TextProcessor
from serve_app.schemas import SamplingParams

PROMPT = "a red circle on a blue square"
# The stock SD3 pipeline's default negative prompt is "" (ours defaults to " "): match it.
PARAMS = SamplingParams(height=32, width=32, num_steps=4, guidance_scale=4.0, noise_level=1.0, negative_prompt="",
                        sde_window_size=2, sde_window_range=(0, 2), seed=7)


@pytest.fixture(scope="module")
def sd3_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-sd3")


@pytest.fixture(scope="module")
def policy(sd3_dir):
    return load_policy(sd3_dir)  # the family is detected from model_index.json


@pytest.fixture(scope="module")
def text(policy):
    return policy.text_processor()


def _with(policy, **components):
    """A policy over the same modules with some pipeline components replaced."""
    pipe = StableDiffusion3Pipeline(**{**policy.pipeline.components, **components})
    pipe.set_progress_bar_config(disable=True)
    return SD3Policy(pipe, device=policy.device, dtype=policy.dtype)


def test_detected_family_and_frozen_parts(policy):
    assert isinstance(policy, SD3Policy) and policy.family == "sd3" and not policy.cfg_renormalize
    pipe = policy.pipeline
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    assert policy.spatial_multiple == 8  # VAE 4 x patch 2
    assert policy.latent_shape(32, 48) == (4, 8, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        policy.check_size(36, 32)


def test_tokens_are_what_the_stock_pipeline_feeds(policy, text, sd3_dir):
    pipe = policy.pipeline
    prompts = ["a cat", "", "word " * 100]  # empty, and one longer than every slot
    tokens = text.tokenize(prompts)
    assert policy.max_sequence_length == 32  # 256 capped by the T5 slot's model_max_length
    for slot, tokenizer, length, extra in (
        ("tokenizer", pipe.tokenizer, 77, {}),
        ("tokenizer_2", pipe.tokenizer_2, 77, {}),
        ("tokenizer_3", pipe.tokenizer_3, 32, {"add_special_tokens": True}),
    ):
        stock = tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                          return_tensors="pt", **extra)
        got = torch.stack([t.token_ids[slot] for t in tokens])
        assert got.dtype == torch.long and torch.equal(got, stock.input_ids), slot
    assert [t.text for t in tokens] == prompts and text.format("x y") == "x y"
    # The ingress's weight-free loader tokenizes identically.
    alone = load_text_processor(sd3_dir)
    assert isinstance(alone, SD3TextProcessor)
    for a, b in zip(alone.tokenize(prompts), tokens):
        assert a.token_ids.keys() == b.token_ids.keys()
        assert all(torch.equal(a.token_ids[k], b.token_ids[k]) for k in a.token_ids)


@pytest.mark.parametrize("with_t5", [True, False])
def test_embeddings_match_the_stock_encode_prompt(policy, with_t5):
    target = policy if with_t5 else _with(policy, text_encoder_3=None)
    prompts = ["a cat", "two green triangles on a very long table"]
    embeds = target.encode_prompts(policy.text_processor().tokenize(prompts))  # same tokenizers
    stock, _, stock_pooled, _ = target.pipeline.encode_prompt(
        prompts, None, None, do_classifier_free_guidance=False, max_sequence_length=target.max_sequence_length
    )
    assert embeds.embeds.shape == stock.shape == (2, 77 + 32, 16)
    torch.testing.assert_close(embeds.embeds, stock, atol=0, rtol=0)
    torch.testing.assert_close(embeds.pooled, stock_pooled, atol=0, rtol=0)
    assert embeds.mask.shape == (2, 77 + 32) and bool(embeds.mask.all())
    if not with_t5:
        assert not embeds.embeds[:, 77:].any()


@pytest.mark.parametrize("dynamic", [False, True])
def test_sigma_schedule_is_the_stock_one(policy, dynamic):
    target = policy
    if dynamic:
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=True,
                                                    base_image_seq_len=4, max_image_seq_len=64)
        target = _with(policy, scheduler=scheduler)
    latents = torch.zeros(1, *target.latent_shape(32, 48))
    target.pipeline(prompt="x", guidance_scale=1.0, num_inference_steps=5, height=32, width=48,
                    latents=latents, output_type="latent", max_sequence_length=target.max_sequence_length)
    stock = target.pipeline.scheduler.sigmas
    ours = target.sigma_schedule(5, 32, 48)
    assert ours.shape == (6,) and float(ours[-1]) == 0.0
    torch.testing.assert_close(ours, stock.float(), atol=0, rtol=0)
    if dynamic:  # the resolution-dependent shift really moved the schedule
        assert not torch.equal(ours, policy.sigma_schedule(5, 32, 48))


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_noise_zero_reproduces_the_stock_pipeline(policy, ode_sample, guidance_scale):
    params = PARAMS.model_copy(update={"noise_level": 0.0, "guidance_scale": guidance_scale, "sde_window_size": None})
    generators = sample_generators(torch.tensor([123]))
    latents = initial_latents(policy, params, generators)
    stock = policy.pipeline(
        prompt=PROMPT,
        negative_prompt=params.negative_prompt,
        guidance_scale=guidance_scale,
        height=32, width=32, num_inference_steps=params.num_steps,
        max_sequence_length=policy.max_sequence_length,
        latents=latents.clone(), output_type="pt",
    ).images
    image, log_probs = ode_sample(policy, PROMPT, params, latents, generators)
    assert image.shape == stock.shape == (1, 3, 32, 32)
    torch.testing.assert_close(image, stock, atol=1e-5, rtol=0)
    assert torch.equal(log_probs, torch.zeros(1, params.num_steps - 1))


def test_replay_gives_ratio_one(policy, text):
    traj = sample_group(policy, text.tokenize(["a cat", "a dog on grass"]), 2, PARAMS, policy_version=0)
    assert traj.latents.shape == (4, 3, *policy.latent_shape(32, 32))
    assert traj.prompt_embeds.pooled is not None and traj.negative_embeds.pooled is not None
    assert torch.isfinite(traj.log_probs).all()
    for k in range(traj.log_probs.shape[1]):
        replayed = replay_step(policy, traj, k)
        ratio = torch.exp(replayed.log_prob - traj.log_probs[:, k])
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
    alone = replay_step(policy, traj, 0, rows=torch.tensor([3]))
    torch.testing.assert_close(alone.log_prob, traj.log_probs[3:, 0], atol=1e-6, rtol=0)


def test_asking_for_the_wrong_family(tiny_qwen_dir):
    assert detect_family(tiny_qwen_dir) == "qwen_image"
    with pytest.raises(ValueError, match=r"qwen_image.*'sd3'"):
        load_policy(tiny_qwen_dir, family="sd3")
    with pytest.raises(ValueError, match=r"qwen_image.*'sd3'"):
        load_text_processor(tiny_qwen_dir, family="sd3")


def test_not_a_pipeline_directory(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="model_index.json") as info:
        load_policy(tmp_path)
    message = str(info.value)
    assert "model.safetensors" in message and all(f in message for f in SUPPORTED_FAMILIES)
    with pytest.raises(ValueError, match="nothing"):
        detect_family(tmp_path / "missing")


def test_an_unsupported_pipeline_class(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "CogVideoXPipeline"}')
    with pytest.raises(ValueError, match="CogVideoXPipeline") as info:
        detect_family(tmp_path)
    assert all(name in str(info.value) for name in ("StableDiffusion3Pipeline", "QwenImagePipeline", "FluxPipeline"))


def test_unknown_family_lists_the_supported_ones(sd3_dir):
    with pytest.raises(ValueError, match=r"unknown model family 'cogvideox'.*qwen_image, qwen_image_edit, qwen_image_edit_plus, sd3, flux, flux_kontext, wan"):
        load_policy(sd3_dir, family="cogvideox")
    with pytest.raises(ValueError, match=r"unknown model family 'cogvideox'.*qwen_image, qwen_image_edit, qwen_image_edit_plus, sd3, flux, flux_kontext, wan"):
        load_text_processor(sd3_dir, family="cogvideox")
