"""The Qwen-Image-Edit adapter's input image size, as the stock QwenImageEditPipeline has it for any size sent.
(Noise 0 == stock __call__, replay ratio 1 and seed-only noise are in tests/conformance; through the whole graph
in tests/deployments/test_app_edit.py.)"""

import pytest
import torch

from serve_app.policies import load_policy
from serve_app.policies.qwen_image_edit import STOCK_INPUT_IMAGE_AREA, QwenImageEditPolicy

from tests.policies.stock_resize import (
    near_ratios,
    ours_or_refused,
    released_pipeline,
    stock_resize,
    sweep_sizes,
    unusable,
)


@pytest.fixture(scope="module")
def policy(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return load_policy(ensure_embedded_model("tiny-qwen-image-edit"))


def rounding_ties(area: int, multiple: int = 32) -> list[float]:
    """Aspect ratios at which a side of `area` px at that ratio is halfway between two multiples."""
    halves = [(k + 0.5) * multiple for k in range(8, 48)]
    return [side * side / area for side in halves] + [area / (side * side) for side in halves]


def test_at_the_released_area_every_input_size_takes_the_size_the_stock_pipeline_gives_it(policy):
    """The stock __call__ at the released VAE factor, each image stopped where it is preprocessed, over odd sides,
    sides beside multiples of 32, extreme aspect ratios and ratios within a pixel of a rounding tie: the VAE's
    input and the encoder's image (the same resize) are our size, and we refuse exactly the images the stock
    pipeline resizes to nothing (a side rounded to 0)."""
    released = released_pipeline(policy.pipeline)
    geometry = QwenImageEditPolicy(released, device=torch.device("cpu"), dtype=torch.float32).geometry
    assert geometry.spatial_multiple == 16 and geometry.input_image_area == STOCK_INPUT_IMAGE_AREA
    sizes = sweep_sizes(*near_ratios(rounding_ties(STOCK_INPUT_IMAGE_AREA)))
    differ = []
    for height, width in sizes:
        stock = stock_resize(released, height, width, prompt="make it red")
        ours = ours_or_refused(geometry.input_image_size, height, width)
        agrees = (unusable(stock.preprocessed, geometry) if ours is None
                  else stock.error is None and ours == stock.resized == stock.preprocessed)
        if not agrees:
            differ.append(f"{height}x{width}: ours {ours}, stock {stock}")
    assert not differ, f"{len(differ)} of {len(sizes)} sizes differ:\n" + "\n".join(differ[:20])
