"""The Qwen-Image-Edit-Plus adapter over the embedded tiny checkpoint: the template's token ids with the pictures
put in on the replica equal the stock pipeline's, and each input image's two copies are the sizes and pixels the
stock pipeline makes. (Noise 0 == stock __call__ with two input images of different sizes, replay ratio 1 and
seed-only noise are in tests/conformance; several images a prompt through the whole graph in
tests/deployments/test_app_edit.py.)"""

from dataclasses import replace

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

from serve_app.config import ConfigError, load_config
from serve_app.media import to_pil
from serve_app.policies import detect_family, load_policy
from serve_app.policies.base import ImageGeometry
from serve_app.policies.qwen_image_edit_plus import (
    STOCK_CONDITION_IMAGE_AREA,
    STOCK_VAE_IMAGE_AREA,
    QwenImageEditPlusPolicy,
)
from serve_app.policies.qwen_text import PICTURE_TEMPLATE

from tests.policies.stock_resize import (
    near_ratios,
    ours_or_refused,
    released_pipeline,
    stock_resize,
    sweep_sizes,
    unusable,
)
from tests.policies.test_qwen_image_edit import rounding_ties


@pytest.fixture(scope="module")
def plus_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-qwen-image-edit-plus")


@pytest.fixture(scope="module")
def policy(plus_dir):
    return load_policy(plus_dir)  # the family is detected from model_index.json


def _image(seed: int, height: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_the_checkpoint_is_detected_as_the_plus_family(plus_dir, policy):
    assert detect_family(plus_dir) == "qwen_image_edit_plus" and isinstance(policy, QwenImageEditPlusPolicy)


@pytest.mark.parametrize("images", [1, 2, 3])
@pytest.mark.parametrize("prompt", ["make the square red", "\nstarts on a new line", "  two spaces first",
                                    "!punctuation first", "第二张图的猫放到第一张图里", ""])
def test_the_ids_with_their_pictures_are_the_stock_templates(policy, prompt, images):
    """The ingress tokenizes the header and the instruction apart and the replica puts the pictures between them;
    the stock pipeline tokenizes the whole template with the pictures in it."""
    (tokens,) = policy.text_processor().tokenize([prompt])
    ours = policy._template_ids(replace(tokens, images=[_image(0, 8, 8)] * images))
    pictures = "".join(PICTURE_TEMPLATE.format(k + 1) for k in range(images))
    stock = policy.pipeline.tokenizer(policy.pipeline.prompt_template_encode.format(pictures + prompt))["input_ids"]
    assert ours.tolist() == stock


@pytest.mark.parametrize("height, width", [(24, 40), (40, 24), (100, 100), (30, 90), (1000, 1500), (777, 333)])
def test_each_input_image_gets_the_two_copies_the_stock_pipeline_makes(policy, height, width):
    """At the stock areas: the VAE copy's size (1024 x 1024 px area) and the encoder copy's size and pixels
    (384 x 384 px area, resized from the image as sent), as QwenImageEditPlusPipeline.__call__ makes them."""
    geometry = ImageGeometry("qwen_image_edit_plus", 16, 4096, input_images=(1, 3),
                             input_image_area=STOCK_VAE_IMAGE_AREA, condition_image_area=STOCK_CONDITION_IMAGE_AREA)
    image = _image(height * width, height, width)
    vae_width, vae_height = pipeline_qwenimage_edit_plus.calculate_dimensions(STOCK_VAE_IMAGE_AREA, width / height)
    assert geometry.input_image_size(height, width) == (vae_height, vae_width)
    condition_width, condition_height = pipeline_qwenimage_edit_plus.calculate_dimensions(
        STOCK_CONDITION_IMAGE_AREA, width / height)
    stock = policy.pipeline.image_processor.resize(to_pil(image), condition_height, condition_width)
    ours = geometry.resize_condition_image(image)
    assert ours.shape == (3, condition_height, condition_width)
    assert np.array_equal(ours.permute(1, 2, 0).numpy(), np.asarray(stock))


def test_at_the_released_areas_every_input_size_gets_the_two_copies_the_stock_pipeline_makes(policy):
    """The stock __call__ at the released VAE factor, each image stopped where its VAE copy is preprocessed, over
    odd sides, sides beside multiples of 32, extreme aspect ratios and ratios within a pixel of a rounding tie at
    either area: the encoder's copy and the VAE's are our sizes, and we refuse exactly the images the stock
    pipeline resizes to nothing (a side rounded to 0)."""
    released = released_pipeline(policy.pipeline)
    geometry = QwenImageEditPlusPolicy(released, device=torch.device("cpu"), dtype=torch.float32).geometry
    assert geometry.spatial_multiple == 16
    areas = (geometry.input_image_area, geometry.condition_image_area)
    assert areas == (STOCK_VAE_IMAGE_AREA, STOCK_CONDITION_IMAGE_AREA)
    ties = rounding_ties(STOCK_VAE_IMAGE_AREA) + rounding_ties(STOCK_CONDITION_IMAGE_AREA)
    sizes = sweep_sizes(*near_ratios(ties))
    differ = []
    for height, width in sizes:
        stock = stock_resize(released, height, width, prompt="make it red")
        vae = ours_or_refused(geometry.input_image_size, height, width)
        condition = ours_or_refused(geometry.condition_image_size, height, width)
        vae_agrees = unusable(stock.preprocessed, geometry) if vae is None else vae == stock.preprocessed
        condition_agrees = unusable(stock.resized, geometry) if condition is None else condition == stock.resized
        if stock.error is not None or not (vae_agrees and condition_agrees):
            differ.append(f"{height}x{width}: ours {vae} (VAE), {condition} (encoder), stock {stock}")
    assert not differ, f"{len(differ)} of {len(sizes)} sizes differ:\n" + "\n".join(differ[:20])


def test_a_prompt_without_its_encoder_copies_is_refused(policy):
    (tokens,) = policy.text_processor().tokenize(["make it red"])
    image = policy.geometry.resize_input_image(_image(0, 32, 32))
    with pytest.raises(ValueError, match="encoder copies"):
        policy.encode_prompts([replace(tokens, images=[image])])


def test_condition_image_area_is_for_the_plus_family_only():
    assert load_config("diffusion_rollout", ["model=tiny_qwen_image_edit_plus"]).model.condition_image_area == 32 * 32
    with pytest.raises(ConfigError, match="condition_image_area is for qwen_image_edit_plus"):
        load_config("diffusion_rollout", ["model=tiny_qwen_image_edit", "model.condition_image_area=1024"])
