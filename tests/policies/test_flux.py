"""The Flux.1 adapter over the embedded tiny Flux: tokens, embeddings, schedule, guidance input and
packing as the stock FluxPipeline has them. (Noise 0 == stock __call__, replay ratio 1 and seed-only
noise are in tests/conformance, run for every family.)"""

import pytest
import torch

from serve_app.flowgrpo.sampler import initial_latents
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies import SUPPORTED_FAMILIES, detect_family, load_policy, load_text_processor
from serve_app.policies.flux import FluxPolicy, FluxTextProcessor
from serve_app.schemas import SamplingParams

TINY_FLUX = "tiny-flux"


@pytest.fixture(scope="module")
def flux_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model(TINY_FLUX)


@pytest.fixture(scope="module")
def policy(flux_dir):
    return load_policy(flux_dir)  # the family is detected from model_index.json


def test_detected_family_geometry_and_frozen_parts(policy, flux_dir):
    assert detect_family(flux_dir) == "flux" and "flux" in SUPPORTED_FAMILIES
    assert isinstance(policy, FluxPolicy) and not policy.cfg_renormalize
    pipe = policy.pipeline
    for module in (pipe.text_encoder, pipe.text_encoder_2, pipe.vae):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    assert policy.spatial_multiple == 8  # VAE 4 x 2x2 packing
    assert policy.latent_shape(32, 48) == (4 * 6, 16)  # tokens, 4 latent channels x 2x2
    with pytest.raises(ValueError, match="multiple of 8"):
        policy.check_size(36, 32)


def test_tokens_are_what_the_stock_pipeline_feeds(policy, flux_dir):
    pipe = policy.pipeline
    prompts = ["a cat", "", "word " * 100]  # empty, and one longer than both slots
    tokens = policy.text_processor().tokenize(prompts)
    assert policy.max_sequence_length == 32  # 512 capped by the T5 slot's model_max_length
    for slot, tokenizer, length in (("tokenizer", pipe.tokenizer, 77), ("tokenizer_2", pipe.tokenizer_2, 32)):
        stock = tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        got = torch.stack([t.token_ids[slot] for t in tokens])
        assert got.dtype == torch.long and torch.equal(got, stock.input_ids), slot
    alone = load_text_processor(flux_dir)  # the ingress's weight-free loader
    assert isinstance(alone, FluxTextProcessor)
    for a, b in zip(alone.tokenize(prompts), tokens):
        assert a.token_ids.keys() == b.token_ids.keys() == {"tokenizer", "tokenizer_2"}
        assert all(torch.equal(a.token_ids[k], b.token_ids[k]) for k in a.token_ids)


def test_embeddings_match_the_stock_encode_prompt(policy):
    prompts = ["a cat", "two green triangles on a very long table"]
    embeds = policy.encode_prompts(policy.text_processor().tokenize(prompts))
    stock, stock_pooled, text_ids = policy.pipeline.encode_prompt(
        prompts, None, max_sequence_length=policy.max_sequence_length
    )
    assert embeds.embeds.shape == stock.shape == (2, 32, 16) and embeds.pooled.shape == stock_pooled.shape == (2, 8)
    torch.testing.assert_close(embeds.embeds, stock, atol=0, rtol=0)
    torch.testing.assert_close(embeds.pooled, stock_pooled, atol=0, rtol=0)
    assert bool(embeds.mask.all()) and not text_ids.any()  # no mask; text positions all zero
    assert not torch.equal(embeds.embeds[0], embeds.embeds[1])


@pytest.mark.parametrize(("height", "width"), [(32, 32), (64, 96)])
def test_sigma_schedule_is_the_stock_dynamically_shifted_one(policy, height, width):
    latents = torch.zeros(1, *policy.latent_shape(height, width))
    policy.pipeline(prompt="x", guidance_scale=3.5, num_inference_steps=5, height=height, width=width,
                    latents=latents, output_type="latent", max_sequence_length=policy.max_sequence_length)
    ours = policy.sigma_schedule(5, height, width)
    assert ours.shape == (6,) and float(ours[-1]) == 0.0
    torch.testing.assert_close(ours, policy.pipeline.scheduler.sigmas.float(), atol=0, rtol=0)


def test_the_shift_grows_with_the_image(policy):
    small, large = policy.sigma_schedule(5, 32, 32), policy.sigma_schedule(5, 256, 256)
    assert bool((large[1:-1] > small[1:-1]).all())  # more tokens: mu up, more time at high noise


def test_the_distilled_guidance_is_a_model_input_matching_the_stock_guidance_scale(policy, ode_sample):
    params = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=1.0, noise_level=0.0, sde_window_size=None)
    generators = sample_generators(torch.tensor([5]))
    latents = initial_latents(policy, params, generators)
    images = {}
    try:
        for guidance in (1.0, 6.0):
            policy.distilled_guidance = guidance
            images[guidance], _ = ode_sample(policy, "a cat", params, latents, generators)
            stock = policy.pipeline(prompt="a cat", guidance_scale=guidance, height=32, width=32, num_inference_steps=3,
                                    max_sequence_length=policy.max_sequence_length, latents=latents.clone(),
                                    output_type="pt").images
            torch.testing.assert_close(images[guidance], stock, atol=1e-5, rtol=0)
    finally:
        policy.distilled_guidance = 3.5
    assert float((images[1.0] - images[6.0]).abs().max()) > 1e-3  # the guidance embedding is live


def test_latents_pack_as_the_stock_pipeline_packs(policy):
    pipe = policy.pipeline
    unpacked = torch.randn(2, 4, 8, 12, generator=torch.Generator().manual_seed(0))  # [B, C, H/4, W/4]
    packed = pipe._pack_latents(unpacked, 2, 4, 8, 12)
    assert packed.shape == (2, *policy.latent_shape(32, 48))
    torch.testing.assert_close(pipe._unpack_latents(packed, 32, 48, pipe.vae_scale_factor), unpacked, atol=0, rtol=0)


def test_the_config_loads_the_embedded_flux(flowgrpo_home):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    config = load_config("diffusion_rollout", ["model=tiny_flux", "model.device=cpu", "model.distilled_guidance=2.0"])
    assert config.model.family == "flux"
    loaded = load_configured_policy(config.model)
    assert isinstance(loaded, FluxPolicy) and loaded.distilled_guidance == 2.0  # replicas and trainer alike


def test_unsupported_pipelines_and_families_still_list_the_supported_ones(tmp_path, flux_dir):
    (tmp_path / "model_index.json").write_text('{"_class_name": "CogVideoXPipeline"}')
    with pytest.raises(ValueError, match="CogVideoXPipeline") as info:
        detect_family(tmp_path)
    assert "FluxPipeline" in str(info.value) and "WanPipeline" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown model family 'cogvideox'.*qwen_image, qwen_image_edit, qwen_image_edit_plus, sd3, flux, flux_kontext, wan"):
        load_policy(flux_dir, family="cogvideox")
