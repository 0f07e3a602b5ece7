"""The Z-Image adapter over the embedded tiny Z-Image: chat-templated tokens, the encoder's inputs and
embeddings, the schedule and the transformer's time as the stock ZImagePipeline has them. (Noise 0 == stock
__call__, true CFG, replay ratio 1 and seed-only noise are in tests/conformance, run for every family.)"""

import contextlib

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

from serve_app.policies import detect_family, load_policy, load_text_processor
from serve_app.policies.z_image import ZImagePolicy, ZImageTextProcessor

PROMPTS = ["a cat", "", "word " * 100]  # empty, and one longer than max_sequence_length


@pytest.fixture(scope="module")
def z_image_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-z-image")


@pytest.fixture(scope="module")
def policy(z_image_dir):
    return load_policy(z_image_dir)  # the family is detected from model_index.json


@contextlib.contextmanager
def recorded_inputs(module):
    """The keyword and positional arguments of every forward of `module` while the block runs."""
    calls = []
    handle = module.register_forward_pre_hook(lambda _, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def _with_scheduler(policy, scheduler):
    """A policy over the same modules with another scheduler (a fresh one: schedules are cached per policy)."""
    pipe = ZImagePipeline(**{**policy.pipeline.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)
    return ZImagePolicy(pipe, device=policy.device, dtype=policy.dtype)


def _stock_sigmas(pipe, steps, height, width):
    """The sigmas the stock __call__ sets for a height x width image."""
    latents = torch.zeros(1, pipe.transformer.config.in_channels, height // pipe.vae_scale_factor,
                          width // pipe.vae_scale_factor)
    pipe(prompt="x", guidance_scale=0.0, num_inference_steps=steps, height=height, width=width, latents=latents,
         max_sequence_length=32, output_type="latent")
    return pipe.scheduler.sigmas.float()


def test_detected_family_geometry_and_frozen_parts(policy, z_image_dir):
    assert detect_family(z_image_dir) == "z_image" and isinstance(policy, ZImagePolicy)
    pipe = policy.pipeline
    for module in (pipe.text_encoder, pipe.vae):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    assert isinstance(load_text_processor(z_image_dir), ZImageTextProcessor)  # the ingress's weight-free loader
    assert policy.spatial_multiple == 8  # VAE 4 x 2x2 patches
    # The stock pipeline's own latents: unpacked, one per VAE pixel.
    stock = pipe.prepare_latents(1, pipe.transformer.in_channels, 32, 48, torch.float32, "cpu", None)
    assert stock.shape == (1, *policy.latent_shape(32, 48)) == (1, 4, 8, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        policy.check_size(36, 32)


def test_the_prompt_is_templated_as_qwen3s_chat_template(policy):
    text = policy.text_processor()
    # One user turn and the assistant header: no system prompt, no thinking block (enable_thinking=True).
    assert text.format("a cat") == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"


def test_the_encoder_gets_the_stock_token_ids_and_mask(policy, z_image_dir):
    pipe = policy.pipeline
    tokens = policy.text_processor().tokenize(PROMPTS)
    assert policy.max_sequence_length == 32  # 512 capped by the tokenizer's model_max_length
    assert len(tokens[2].token_ids["tokenizer"]) == 32  # truncated, as the stock call truncates
    with recorded_inputs(pipe.text_encoder) as calls:
        pipe.encode_prompt(list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=32)
        policy.encode_prompts(tokens)
    (_, stock), (_, ours) = calls
    assert torch.equal(ours["input_ids"], stock["input_ids"])
    assert ours["attention_mask"].dtype == stock["attention_mask"].dtype == torch.bool
    assert torch.equal(ours["attention_mask"], stock["attention_mask"])
    for a, b in zip(load_text_processor(z_image_dir).tokenize(PROMPTS), tokens):
        assert torch.equal(a.token_ids["tokenizer"], b.token_ids["tokenizer"])


def test_embeddings_are_the_stock_ones_at_the_real_tokens(policy):
    prompts = ["a cat", "two green triangles on a very long table"]
    embeds = policy.encode_prompts(policy.text_processor().tokenize(prompts))
    stock, _ = policy.pipeline.encode_prompt(list(prompts), do_classifier_free_guidance=False, max_sequence_length=32)
    lengths = embeds.mask.sum(dim=1).tolist()
    assert lengths == [len(s) for s in stock] and lengths[0] < lengths[1]
    assert embeds.embeds.shape == (2, lengths[1], policy.transformer.config.cap_feat_dim)
    for row, states in enumerate(stock):
        torch.testing.assert_close(embeds.embeds[row, : len(states)], states, atol=0, rtol=0)
        assert bool(embeds.mask[row, : len(states)].all()) and not bool(embeds.embeds[row, len(states):].any())


@pytest.mark.parametrize(("steps", "height", "width"), [(3, 32, 32), (5, 64, 96)])
def test_the_schedule_is_the_stock_one(policy, steps, height, width):
    torch.testing.assert_close(policy.sigma_schedule(steps, height, width),
                               _stock_sigmas(policy.pipeline, steps, height, width), atol=0, rtol=0)


def test_the_released_shift_is_static_and_a_dynamic_one_follows_the_image(policy):
    # Z-Image-Turbo's scheduler: 3 sigma / (1 + 2 sigma) of linspace(1, 1/N, N), whatever the size.
    sigmas = torch.linspace(1.0, 1 / 4, 4)
    torch.testing.assert_close(policy.sigma_schedule(4, 32, 32)[:-1], 3 * sigmas / (1 + 2 * sigmas))
    assert torch.equal(policy.sigma_schedule(4, 32, 32), policy.sigma_schedule(4, 256, 256))
    # A checkout whose scheduler shifts dynamically gets the stock mu of its image tokens.
    config = {**policy.pipeline.scheduler.config, "use_dynamic_shifting": True}
    dynamic = _with_scheduler(policy, FlowMatchEulerDiscreteScheduler.from_config(config))
    for height, width in ((32, 32), (128, 96)):
        torch.testing.assert_close(dynamic.sigma_schedule(4, height, width),
                                   _stock_sigmas(dynamic.pipeline, 4, height, width), atol=0, rtol=0)
    assert bool((dynamic.sigma_schedule(4, 128, 96)[1:-1] > dynamic.sigma_schedule(4, 32, 32)[1:-1]).all())


def test_the_transformer_gets_the_stock_time_and_captions(policy):
    """The stock loop feeds (1000 - t) / 1000 of the scheduler's timesteps: 0 at pure noise."""
    pipe = policy.pipeline
    latents = torch.randn(1, *policy.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    with recorded_inputs(pipe.transformer) as calls:
        pipe(prompt="a cat", guidance_scale=0.0, num_inference_steps=3, height=32, width=32, latents=latents,
             max_sequence_length=32, output_type="latent")
    sigmas = policy.sigma_schedule(3, 32, 32)[:-1]
    stock_times = torch.cat([args[1] for args, _ in calls])
    assert torch.equal(policy.timestep(sigmas), stock_times) and float(stock_times[0]) == 0.0
    cond = policy.encode_prompts(policy.text_processor().tokenize(["a cat"]))
    (caption,) = calls[0][0][2]
    torch.testing.assert_close(cond.embeds[0], caption, atol=0, rtol=0)
