"""The conformance suite's matrix: which engines, on which families, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family by adding its embedded checkpoint to FAMILIES (its policy's ``stock_call`` is the stock pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from serve_app.serving.engine import DiffusersEngine
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import SamplingParams

from tests.conformance.fake_engine import fake_bf16_engine

# Engines that must fulfil the contract, and engines the suite must catch.
ENGINES: dict[str, Callable] = {"diffusers": DiffusersEngine}
FLAGGED_ENGINES: dict[str, Callable] = {"fake_bf16": fake_bf16_engine}

FAMILIES = {
    "qwen_image": "tiny-qwen-image",
    "qwen_image_edit": "tiny-qwen-image-edit",
    "sd3": "tiny-sd3",
    "flux": "tiny-flux",
    "wan": "tiny-wan",
}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {"wan": {"num_frames": 5}}

# Settings of a family's policy that its embedded checkpoint's config states (configs/model/*.yaml).
FAMILY_POLICY = {"qwen_image_edit": {"input_image_area": 32 * 32}}


def _input_image(index: int) -> torch.Tensor:
    """A uint8 [3, 24, 40] input image (not square, so the resize to the input area matters), one per prompt."""
    return torch.randint(0, 256, (3, 24, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(100 + index))


# What a family's request carries beside its prompts: image-conditioned families get one input image a prompt.
FAMILY_REQUEST: dict[str, Callable[[int], dict]] = {
    "qwen_image_edit": lambda prompts: {"images": [[_input_image(i)] for i in range(prompts)]},
}


def family_sampling(family: str, params: SamplingParams) -> SamplingParams:
    """`params` with what `family` needs on top (FAMILY_SAMPLING)."""
    return params.model_copy(update=FAMILY_SAMPLING.get(family, {}))


def family_request(family: str, prompts: int) -> dict:
    """The RolloutRequest fields `family` needs for `prompts` prompts beside them (FAMILY_REQUEST)."""
    return FAMILY_REQUEST[family](prompts) if family in FAMILY_REQUEST else {}


def family_inputs(family: str) -> dict:
    """The keyword arguments of the stock call and of `ode_sample` for the request's first prompt: its input images
    as sent (the stock pipeline resizes them itself)."""
    images = family_request(family, 1).get("images")
    return {"images": images[0]} if images else {}


@pytest.fixture(scope="session")
def conformance_policies(flowgrpo_home):
    """family -> a policy of its own (weight versions change it; no other test shares it), loaded once."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    loaded: dict[str, DiffusionPolicy] = {}

    def get(family: str) -> DiffusionPolicy:
        if family not in loaded:
            loaded[family] = load_policy(ensure_embedded_model(FAMILIES[family]), family=family)
            for name, value in FAMILY_POLICY.get(family, {}).items():
                setattr(loaded[family], name, value)
        return loaded[family]

    return get
