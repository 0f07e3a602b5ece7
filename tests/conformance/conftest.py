"""The conformance suite's matrix: which engines, on which checkpoints, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family, or a new layout of one (Wan2.2's two experts, its per-token timesteps), by adding its embedded
checkpoint to CHECKPOINTS (its policy's ``stock_call`` is the stock pipeline).
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

# Embedded checkpoint -> its family. tiny-wan22's 3-step schedule crosses its boundary after step 0, so
# the suite's window (steps 0-1) lies across it and its noise-0 run uses both experts.
CHECKPOINTS = {
    "tiny-qwen-image": "qwen_image",
    "tiny-qwen-image-edit": "qwen_image_edit",
    "tiny-qwen-image-edit-plus": "qwen_image_edit_plus",
    "tiny-sd3": "sd3",
    "tiny-flux": "flux",
    "tiny-flux-kontext": "flux_kontext",
    "tiny-wan": "wan",
    "tiny-wan22": "wan",
    "tiny-wan22-ti2v": "wan",
}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {"wan": {"num_frames": 5}}


# Settings of a family's policy that its embedded checkpoint's config states (configs/model/*.yaml).
FAMILY_POLICY = {
    "qwen_image_edit": {"input_image_area": 32 * 32},
    "qwen_image_edit_plus": {"input_image_area": 32 * 32, "condition_image_area": 32 * 32},
    "flux_kontext": {"input_image_area": 32 * 32},
}


def _input_image(index: int, height: int = 30, width: int = 50) -> torch.Tensor:
    """A uint8 [3, 30, 50] input image, one per prompt. Not square, so the resize to the input area matters; its
    sides no multiples of 8 (the tiny checkpoints' VAE factor x 2), so a resize that sizes it from other sides
    than the stock pipeline does fails the noise-0 test (FLUX.1 Kontext's pipeline takes its ratio as 24 x 48's:
    16 x 40 px at the tiny area, where the ratio of 30 x 50 would give 24 x 40)."""
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(100 + index))


# What a family's request carries beside its prompts: image-conditioned families get one input image a prompt,
# Qwen-Image-Edit-Plus two (the second wider, 19 x 49: 32 x 64 px at the input area, so a prompt's images differ
# in size).
FAMILY_REQUEST: dict[str, Callable[[int], dict]] = {
    "qwen_image_edit": lambda prompts: {"images": [[_input_image(i)] for i in range(prompts)]},
    "qwen_image_edit_plus": lambda prompts: {"images": [[_input_image(i), _input_image(50 + i, 19, 49)]
                                                        for i in range(prompts)]},
    "flux_kontext": lambda prompts: {"images": [[_input_image(i)] for i in range(prompts)]},
}


def checkpoint_sampling(checkpoint: str, params: SamplingParams) -> SamplingParams:
    """`params` with what the checkpoint's family needs on top (FAMILY_SAMPLING)."""
    return params.model_copy(update=FAMILY_SAMPLING.get(CHECKPOINTS[checkpoint], {}))


def family_request(family: str, prompts: int) -> dict:
    """The RolloutRequest fields `family` needs for `prompts` prompts beside them (FAMILY_REQUEST)."""
    return FAMILY_REQUEST[family](prompts) if family in FAMILY_REQUEST else {}


def checkpoint_inputs(checkpoint: str) -> dict:
    """The keyword arguments of the stock call and of `ode_sample` for the request's first prompt: its input
    images as sent (the stock pipeline resizes them itself)."""
    images = family_request(CHECKPOINTS[checkpoint], 1).get("images")
    return {"images": images[0]} if images else {}


@pytest.fixture(scope="session")
def conformance_policies(flowgrpo_home):
    """checkpoint -> a policy of its own (weight versions change it; no other test shares it), loaded once."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    loaded: dict[str, DiffusionPolicy] = {}

    def get(checkpoint: str) -> DiffusionPolicy:
        if checkpoint not in loaded:
            family = CHECKPOINTS[checkpoint]
            loaded[checkpoint] = load_policy(ensure_embedded_model(checkpoint), family=family)
            for name, value in FAMILY_POLICY.get(family, {}).items():
                setattr(loaded[checkpoint], name, value)
        return loaded[checkpoint]

    return get
