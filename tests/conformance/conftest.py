"""The conformance suite's matrix: which engines, on which checkpoints, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family, or a new layout of one (Wan2.2's two experts, its per-token timesteps), by its row's tiny checkpoint in
serve_app.families (its policy's ``stock_call`` is the stock pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from serve_app.families import FAMILIES, families_that
from serve_app.serving.engine import DiffusersEngine
from serve_app.policies.base import DiffusionPolicy, PolicySettings
from serve_app.schemas import SamplingParams

from tests.conformance.fake_engine import fake_bf16_engine

# Engines that must fulfil the contract, and engines the suite must catch.
ENGINES: dict[str, Callable] = {"diffusers": DiffusersEngine}
FLAGGED_ENGINES: dict[str, Callable] = {"fake_bf16": fake_bf16_engine}

# Embedded checkpoint -> its family: every family's tiny checkpoints (serve_app.families). tiny-wan22's 3-step
# schedule crosses its boundary after step 0, so the suite's window (steps 0-1) lies across it and its noise-0
# run uses both experts.
CHECKPOINTS = {checkpoint.name: row.name for row in FAMILIES.values() for checkpoint in row.checkpoints
               if checkpoint.role == "tiny"}
# Each tiny checkpoint's model config (configs/model/<config>.yaml), whose policy settings its policy gets.
CHECKPOINT_CONFIGS = {checkpoint.name: checkpoint.config for row in FAMILIES.values() for checkpoint in row.checkpoints}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {name: {"num_frames": 5} for name in families_that(lambda row: row.produces == "videos")}


def checkpoint_settings(checkpoint: str) -> PolicySettings:
    """The policy settings the checkpoint's model config states (input areas, distilled guidance)."""
    import yaml

    from serve_app.config import ModelConfig, default_config_dir

    path = default_config_dir() / "model" / f"{CHECKPOINT_CONFIGS[checkpoint]}.yaml"
    model = ModelConfig.model_validate(yaml.safe_load(path.read_text()))
    return PolicySettings(distilled_guidance=model.distilled_guidance, input_image_area=model.input_image_area,
                          condition_image_area=model.condition_image_area)


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
    "wan_i2v": lambda prompts: {"images": [[_input_image(i)] for i in range(prompts)]},
    "ltx2_i2v": lambda prompts: {"images": [[_input_image(i)] for i in range(prompts)]},
    # FLUX.2's pipelines take reference images of 64 px a side or more and center-crop them to multiples of 16 (the
    # tiny VAE factor x 2): 72 x 100 crops to 64 x 96, 66 x 81 to 64 x 80 (klein: two references of different sizes).
    "flux2": lambda prompts: {"images": [[_input_image(i, 72, 100)] for i in range(prompts)]},
    "flux2_klein": lambda prompts: {"images": [[_input_image(i, 72, 100), _input_image(50 + i, 66, 81)]
                                               for i in range(prompts)]},
}
assert set(FAMILY_REQUEST) == set(families_that(lambda row: row.input_images)), "every image family needs its images"


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
            loaded[checkpoint] = load_policy(ensure_embedded_model(checkpoint), family=CHECKPOINTS[checkpoint],
                                             settings=checkpoint_settings(checkpoint))
        return loaded[checkpoint]

    return get
