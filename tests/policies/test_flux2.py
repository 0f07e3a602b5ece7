"""The FLUX.2 adapters over the embedded tiny FLUX.2 [dev] and [klein]: tokens, embeddings, schedule, guidance input
and packing as the stock Flux2Pipeline / Flux2KleinPipeline have them. (Noise 0 == stock __call__ with and without
true CFG, replay ratio 1 and seed-only noise are in tests/conformance, run for every family.)"""

import dataclasses
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from transformers import Qwen3Config

from serve_app.errors import InvalidRequestError
from serve_app.flowgrpo.sampler import initial_latents
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies import detect_family, load_policy, load_text_processor
from serve_app.policies.flux2 import Flux2KleinPolicy, Flux2KleinTextProcessor, Flux2Policy, Flux2TextProcessor
from serve_app.schemas import SamplingParams

CHECKPOINTS = {"flux2": "tiny-flux2", "flux2_klein": "tiny-flux2-klein"}
POLICIES = {"flux2": (Flux2Policy, Flux2TextProcessor), "flux2_klein": (Flux2KleinPolicy, Flux2KleinTextProcessor)}


@pytest.fixture(scope="module")
def checkout(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return {family: ensure_embedded_model(name) for family, name in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def policies(checkout):
    return {family: load_policy(path) for family, path in checkout.items()}  # the family from model_index.json


@pytest.fixture(params=list(CHECKPOINTS))
def family(request):
    return request.param


def _stock_encoder_inputs(policy, prompts, monkeypatch):
    """The token ids and attention mask the stock encode_prompt feeds its text encoder."""
    seen = {}
    encoder = policy.pipeline.text_encoder
    forward = encoder.forward

    def record(*args, **kwargs):
        seen.update(ids=kwargs["input_ids"], mask=kwargs["attention_mask"])
        return forward(*args, **kwargs)

    monkeypatch.setattr(encoder, "forward", record)
    policy.pipeline.encode_prompt(prompts, max_sequence_length=policy.max_sequence_length,
                                  text_encoder_out_layers=policy.hidden_state_layers)
    return seen["ids"], seen["mask"]


def test_detected_family_geometry_and_frozen_parts(policies, checkout, family):
    policy = policies[family]
    policy_class, processor_class = POLICIES[family]
    assert detect_family(checkout[family]) == family and type(policy) is policy_class
    assert not policy.cfg_renormalize
    for module in (policy.pipeline.text_encoder, policy.pipeline.vae):
        assert not any(p.requires_grad for p in module.parameters())
    assert all(p.requires_grad for p in policy.transformer.parameters())
    assert policy.spatial_multiple == 16  # VAE 8 x 2x2 patches
    assert policy.latent_shape(32, 48) == (2 * 3, 16)  # tokens, 4 latent channels x 2x2
    assert type(load_text_processor(checkout[family])) is processor_class  # the ingress's weight-free loader
    with pytest.raises(InvalidRequestError, match="multiple of 16"):
        policy.check_size(40, 32)


def test_tokens_are_what_the_stock_pipeline_feeds_its_encoder(policies, checkout, family, monkeypatch):
    policy = policies[family]
    # Empty; an [IMG] marker (the dev pipeline drops it); longer than max_sequence_length (truncated).
    prompts = ["a cat", "", "a [IMG] dog", "word " * 100]
    tokens = policy.text_processor().tokenize(prompts)
    assert all(len(t.token_ids["tokenizer"]) <= policy.max_sequence_length for t in tokens)
    assert len(tokens[-1].token_ids["tokenizer"]) == policy.max_sequence_length
    ids, mask = policy.encoder_inputs(tokens)
    stock_ids, stock_mask = _stock_encoder_inputs(policy, prompts, monkeypatch)
    assert ids.shape == (4, policy.max_sequence_length)
    assert torch.equal(ids, stock_ids) and torch.equal(mask, stock_mask)
    alone = load_text_processor(checkout[family]).tokenize(prompts)
    assert all(torch.equal(a.token_ids["tokenizer"], b.token_ids["tokenizer"]) for a, b in zip(alone, tokens))


def test_embeddings_match_the_stock_encode_prompt(policies, family):
    policy = policies[family]
    prompts = ["a cat", "two green triangles on a very long table"]
    embeds = policy.encode_prompts(policy.text_processor().tokenize(prompts))
    stock, text_ids = policy.pipeline.encode_prompt(prompts, max_sequence_length=policy.max_sequence_length,
                                                    text_encoder_out_layers=policy.hidden_state_layers)
    width = policy.pipeline.text_encoder.config.get_text_config().hidden_size
    assert embeds.embeds.shape == stock.shape == (2, policy.max_sequence_length, 3 * width)
    torch.testing.assert_close(embeds.embeds, stock, atol=0, rtol=0)
    assert bool(embeds.mask.all())  # the transformer takes no text mask: every position conditions it
    assert torch.equal(text_ids[0, :, 3], torch.arange(policy.max_sequence_length)) and not text_ids[..., :3].any()
    assert not torch.equal(embeds.embeds[0], embeds.embeds[1])


@pytest.mark.parametrize(("steps", "height", "width"), [(3, 32, 32), (8, 64, 96)])
def test_sigma_schedule_is_the_stock_empirically_shifted_one(policies, family, steps, height, width):
    policy = policies[family]
    side = policy.spatial_multiple
    channels = policy.transformer.config.in_channels
    policy.pipeline(prompt="x", num_inference_steps=steps, height=height, width=width, guidance_scale=1.0,
                    latents=torch.zeros(1, channels, height // side, width // side), output_type="latent",
                    max_sequence_length=policy.max_sequence_length, text_encoder_out_layers=policy.hidden_state_layers)
    ours = policy.sigma_schedule(steps, height, width)
    assert ours.shape == (steps + 1,) and float(ours[-1]) == 0.0
    torch.testing.assert_close(ours, policy.pipeline.scheduler.sigmas.float(), atol=0, rtol=0)


def test_the_shift_depends_on_the_image_and_the_step_count(policies):
    policy = policies["flux2"]
    small, large = policy.sigma_schedule(5, 32, 32), policy.sigma_schedule(5, 256, 256)
    assert bool((large[1:-1] > small[1:-1]).all())  # more tokens: mu up, more time at high noise
    assert compute_empirical_mu(16, 5) != compute_empirical_mu(16, 20)  # FLUX.2's fit reads the step count too


def _ours_and_stock(policy, ode_sample, guidance_scale: float, seed: int):
    """Text to image from the same initial latents: our sampler at noise 0, and the stock call."""
    params = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=guidance_scale, noise_level=0.0,
                            sde_window_size=None)
    generators = sample_generators(torch.tensor([seed]))
    latents = initial_latents(policy, params, generators)
    ours, _ = ode_sample(policy, "a cat", params, latents, generators)
    return ours, policy.stock_call("a cat", params, latents)


def test_the_distilled_guidance_is_a_model_input_matching_the_stock_guidance_scale(policies, ode_sample):
    policy = policies["flux2"]
    assert policy.pipeline.transformer.config.guidance_embeds and policy.distilled_guidance == 4.0
    images = {}
    try:
        for guidance in (1.0, 7.0):
            policy.distilled_guidance = guidance
            images[guidance], stock = _ours_and_stock(policy, ode_sample, 1.0, seed=5)
            torch.testing.assert_close(images[guidance], stock, atol=1e-5, rtol=0)
    finally:
        policy.distilled_guidance = 4.0
    assert float((images[1.0] - images[7.0]).abs().max()) > 1e-3  # the guidance embedding is live


def test_klein_has_no_guidance_input(policies):
    policy = policies["flux2_klein"]
    assert not policy.transformer.config.guidance_embeds and policy._guidance(2, policy.device) is None
    assert not policy.pipeline.config.is_distilled  # the base model: its pipeline runs true CFG


def test_a_step_distilled_klein_refuses_true_cfg(policies):
    policy = policies["flux2_klein"]
    params = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=4.0, sde_window_size=None)
    assert policy.guidance_scale_at(torch.tensor(1.0), params) == 4.0
    distilled = Flux2KleinPolicy(Flux2KleinPipeline(**policy.pipeline.components, is_distilled=True),
                                 device=policy.device, dtype=policy.dtype)
    with pytest.raises(InvalidRequestError, match="step-distilled"):
        distilled.guidance_scale_at(torch.tensor(1.0), params)
    assert distilled.guidance_scale_at(torch.tensor(1.0), params.model_copy(update={"guidance_scale": 1.0})) == 1.0


def test_latents_pack_as_the_stock_pipeline_packs(policies):
    policy = policies["flux2"]
    pipe = policy.pipeline
    patchified = torch.randn(2, 16, 2, 3, generator=torch.Generator().manual_seed(0))  # [B, 4C, H/16, W/16]
    packed = pipe._pack_latents(patchified)
    assert packed.shape == (2, *policy.latent_shape(32, 48))
    torch.testing.assert_close(policy._patchified(packed, 32, 48), patchified, atol=0, rtol=0)
    stock_ids = pipe._prepare_latent_ids(patchified)[0]
    assert torch.equal(policy._image_ids(32, 48), stock_ids)  # (0, row, column, 0), row-major like the tokens
    torch.testing.assert_close(pipe._unpack_latents_with_ids(packed, stock_ids[None].expand(2, -1, -1)), patchified,
                               atol=0, rtol=0)


def test_an_encoder_too_shallow_for_the_stacked_layers_is_refused(policies):
    shallow = SimpleNamespace(text_encoder=SimpleNamespace(config=Qwen3Config(num_hidden_layers=20)))
    with pytest.raises(ValueError, match=r"has 20 layers.*\(9, 18, 27\)"):
        Flux2KleinPolicy(shallow, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize(("config", "policy_class"), [("tiny_flux2", Flux2Policy), ("tiny_flux2_klein", Flux2KleinPolicy)])
def test_the_configs_load_the_embedded_checkpoints(flowgrpo_home, config, policy_class):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    loaded = load_configured_policy(load_config("diffusion_rollout", [f"model={config}", "model.device=cpu"]).model)
    assert type(loaded) is policy_class
    if policy_class is Flux2Policy:
        assert loaded.distilled_guidance == 4.0  # the config states the stock default


# -- reference images ---------------------------------------------------------------------------


def _image(seed: int, height: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _stock_transformer_inputs(policy, images, monkeypatch):
    """hidden_states and img_ids of the stock pipeline's first transformer call on reference `images` (as sent)."""
    seen = {}
    transformer = policy.pipeline.transformer
    forward = transformer.forward

    def record(*args, **kwargs):
        seen.setdefault("call", kwargs)
        return forward(*args, **kwargs)

    monkeypatch.setattr(transformer, "forward", record)
    params = SamplingParams(height=32, width=32, num_steps=1, guidance_scale=1.0, noise_level=0.0, sde_window_size=None)
    policy.stock_call("a cat", params, initial_latents(policy, params, sample_generators(torch.tensor([1]))),
                      images=images)
    return seen["call"]["hidden_states"], seen["call"]["img_ids"]


@pytest.mark.parametrize("area", [None, 64 * 96])  # the stock cap (no resize here), and one the images exceed
def test_reference_latents_and_ids_are_what_the_stock_pipeline_feeds_its_transformer(checkout, family, area,
                                                                                      monkeypatch):
    from serve_app.policies.base import PolicySettings

    policy = load_policy(checkout[family], settings=PolicySettings(input_image_area=area))
    images = [_image(1, 72, 100), _image(2, 150, 101)]
    resized, _ = policy.geometry.conditioning_images(images)
    # Cropped as sent; at the smaller area resized to 66 x 92 and 95 x 64 first.
    assert [tuple(r.shape[1:]) for r in resized] == ([(64, 96), (144, 96)] if area is None else [(64, 80), (80, 64)])
    tokens = [replace(t, images=resized) for t in policy.text_processor().tokenize(["a cat"])]
    embeds = policy.encode_prompts(tokens)
    stock_hidden, stock_ids = _stock_transformer_inputs(policy, images, monkeypatch)
    noisy = policy.latent_shape(32, 32)[0]
    torch.testing.assert_close(embeds.image_latents[0], stock_hidden[0, noisy:], atol=0, rtol=0)
    shapes = [tuple(s) for s in embeds.image_shapes[0].tolist()]
    ours = torch.cat([policy._image_ids(32, 32), policy._reference_ids(shapes)])
    assert torch.equal(ours, stock_ids[0]) and set(stock_ids[0, noisy:, 0].tolist()) == {10, 20}


def test_reference_images_are_cropped_and_capped_as_the_pipeline_does(policies):
    geometry = policies["flux2"].geometry
    assert geometry.input_images == (0, 10) and geometry.input_image_multiple == 16
    image = _image(3, 70, 101)
    cropped = geometry.resize_input_image(image)
    assert torch.equal(cropped, image[:, 3:67, 2:98])  # 64 x 96 from the center: no resize within the area
    capped = dataclasses.replace(geometry, input_image_area=64 * 64)
    assert capped.input_image_size(100, 200) == (32, 80)  # resized to 45 x 90 (truncated), then cropped
    for size, match in (((63, 200), "too small"), ((64, 600), "too elongated")):
        with pytest.raises(InvalidRequestError, match=match):
            geometry.resize_input_image(_image(4, *size), "images[0][0]")
    with pytest.raises(InvalidRequestError, match="0 to 10 input image"):
        geometry.check_input_image_count(11, "images[0]")


def test_a_prompt_without_reference_images_samples_as_the_stock_text_to_image_call(policies, ode_sample, family):
    # The suite sends reference images: this is the text-to-image path, with true CFG.
    ours, stock = _ours_and_stock(policies[family], ode_sample, 4.0, seed=7)
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)


def test_prompts_with_and_without_references_predict_as_each_alone(policies):
    policy = policies["flux2_klein"]
    (plain,) = policy.text_processor().tokenize(["a cat"])
    with_one = replace(plain, images=policy.geometry.conditioning_images([_image(5, 64, 80)])[0])
    with_two = replace(plain, images=policy.geometry.conditioning_images([_image(6, 64, 64), _image(7, 80, 64)])[0])
    prompts = [with_one, plain, with_two]
    latents = torch.randn(3, *policy.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((3,), 0.7)
    with torch.no_grad():
        together = policy.predict(latents, sigma, policy.encode_prompts(prompts), height=32, width=32)
        for row, prompt in enumerate(prompts):
            alone = policy.predict(latents[row:row + 1], sigma[:1], policy.encode_prompts([prompt]), height=32, width=32)
            torch.testing.assert_close(together[row:row + 1], alone, atol=1e-6, rtol=0)
    assert not torch.allclose(together[0], together[1], atol=1e-4)  # the references condition the prediction
