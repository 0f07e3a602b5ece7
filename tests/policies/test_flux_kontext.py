"""The FLUX.1 Kontext adapter over the embedded tiny Kontext: the input image's resize and latents as the stock
FluxKontextPipeline has them, the image count checked. (Noise 0 == stock __call__ with the same input image,
replay ratio 1 and seed-only noise are in tests/conformance; through the whole graph in
tests/deployments/test_app_edit.py.)"""

import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from serve_app.errors import InvalidRequestError
from serve_app.media import to_pil
from serve_app.policies import detect_family, load_policy
from serve_app.policies.flux_kontext import STOCK_INPUT_IMAGE_AREA, FluxKontextPolicy
from serve_app.schemas import PromptTokens

from tests.policies.stock_resize import (
    near_ratios,
    ours_or_refused,
    released_pipeline,
    stock_resize,
    sweep_sizes,
    unusable,
)


@pytest.fixture(scope="module")
def kontext_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-flux-kontext")


@pytest.fixture(scope="module")
def policy(kontext_dir):
    return load_policy(kontext_dir)  # the family is detected from model_index.json


def _image(seed: int, height: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


class _Resized(Exception):
    pass


@pytest.mark.parametrize("height, width", [(24, 40), (40, 24), (100, 100), (30, 90), (1000, 1500), (777, 333)])
def test_at_the_stock_area_an_input_image_takes_the_size_the_stock_pipeline_gives_it(policy, monkeypatch, height, width):
    """The stock __call__ with `_auto_resize`, stopped where it resizes the input image: our geometry picks
    the same size for every aspect ratio (the generated image stays small: only the input is resized)."""
    assert isinstance(policy, FluxKontextPolicy) and policy.input_image_area == STOCK_INPUT_IMAGE_AREA
    asked = {}

    def resize(image, h, w, **_):
        asked["size"] = (h, w)
        raise _Resized

    monkeypatch.setattr(policy.pipeline.image_processor, "resize", resize)
    with pytest.raises(_Resized):
        policy.pipeline(image=to_pil(_image(0, height, width)), prompt="a cat", height=32, width=32,
                        max_area=32 * 32, num_inference_steps=2, output_type="pt")
    assert policy.geometry.input_image_size(height, width) == asked["size"]


def test_at_the_released_area_every_input_size_takes_the_size_the_stock_pipeline_gives_it(policy):
    """The stock __call__ at the released VAE factor (image processor and multiple_of at 16 px), each image
    stopped where it is preprocessed, over odd sides, sides beside multiples of 16, extreme aspect ratios and
    ratios within a pixel of halfway between two Kontext sizes: our geometry takes the same size, and refuses
    exactly the images the stock pipeline cannot size (under 16 px tall: it divides by zero)."""
    released = released_pipeline(policy.pipeline)
    geometry = FluxKontextPolicy(released, device=torch.device("cpu"), dtype=torch.float32).geometry
    assert geometry.input_image_multiple == 16 and geometry.input_image_area == STOCK_INPUT_IMAGE_AREA
    embeds, pooled, _ = policy.pipeline.encode_prompt(prompt="a cat", prompt_2=None, device="cpu",
                                                      max_sequence_length=policy.max_sequence_length)
    ratios = [w / h for w, h in PREFERRED_KONTEXT_RESOLUTIONS]
    ties = near_ratios([(a + b) / 2 for a, b in zip(ratios, ratios[1:])])
    sizes = sweep_sizes((30, 50), (50, 66), (230, 400), (600, 1000), (720, 1280), (1000, 1000), (1000, 1500), *ties)
    differ = []
    for height, width in sizes:
        stock = stock_resize(released, height, width, prompt_embeds=embeds, pooled_prompt_embeds=pooled,
                             max_area=32 * 32, max_sequence_length=policy.max_sequence_length)
        ours = ours_or_refused(geometry.input_image_size, height, width)
        agrees = (unusable(stock.preprocessed, geometry) if ours is None
                  else stock.error is None and ours == stock.resized == stock.preprocessed)
        if not agrees:
            differ.append(f"{height}x{width}: ours {ours}, stock {stock}")
    assert not differ, f"{len(differ)} of {len(sizes)} sizes differ:\n" + "\n".join(differ[:20])


def test_an_input_image_under_16_px_tall_is_refused_naming_it(policy):
    geometry = FluxKontextPolicy(released_pipeline(policy.pipeline), device=torch.device("cpu"),
                                 dtype=torch.float32).geometry
    with pytest.raises(InvalidRequestError, match="15x100 is less than 16 px tall") as info:
        geometry.input_image_size(15, 100, "images[0][0]")
    assert info.value.field == "images[0][0]"
    assert geometry.input_image_size(100, 15) == (1568, 672)  # a width under 16 is ratio 0 there: the tallest


def test_the_input_image_latents_are_the_stock_pipelines(policy):
    pipe = policy.pipeline
    image = _image(3, 24, 40)
    pixels = pipe.image_processor.preprocess(to_pil(image), 24, 40)  # the stock [-1, 1] float pixels
    stock = pipe._encode_vae_image(pixels, generator=None)
    stock = pipe._pack_latents(stock, *stock.shape)
    torch.testing.assert_close(policy.encode_images(image[None].float() / 255.0), stock, atol=1e-6, rtol=0)


def test_a_prompt_takes_exactly_one_input_image(policy):
    tokens = policy.text_processor().tokenize(["a cat"])[0]
    with pytest.raises(InvalidRequestError, match="takes 1 input image") as info:
        policy.encode_prompts([tokens])
    assert info.value.field == "prompts[0].images"
    two = PromptTokens(text=tokens.text, token_ids=tokens.token_ids, images=[_image(0, 32, 32), _image(1, 32, 32)])
    with pytest.raises(InvalidRequestError, match="got 2"):
        policy.encode_prompts([two])


def test_the_config_loads_the_embedded_kontext(flowgrpo_home, kontext_dir):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    assert detect_family(kontext_dir) == "flux_kontext"
    config = load_config("diffusion_rollout", ["model=tiny_flux_kontext", "model.distilled_guidance=2.0"])
    loaded = load_configured_policy(config.model)
    assert isinstance(loaded, FluxKontextPolicy) and loaded.distilled_guidance == 2.0
    geometry = loaded.geometry
    assert geometry.input_images == (1, 1) and loaded.input_image_area == 32 * 32
    # 24 x 40 is nearest Kontext's 800 x 1328 (height x width), scaled by 1/32 and floored to 8: 24 x 40.
    assert geometry.input_image_size(24, 40) == (24, 40)
    assert geometry.input_image_size(32, 32) == (32, 32)
