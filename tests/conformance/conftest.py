"""The conformance suite's matrix: which engines, on which families, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family by adding its embedded checkpoint to FAMILIES and its stock call to STOCK_CALLS.
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
    "sd3": "tiny-sd3",
    "flux": "tiny-flux",
    "wan": "tiny-wan",
}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {"wan": {"num_frames": 5}}


def _stock_qwen_image(policy: DiffusionPolicy, prompt: str, params: SamplingParams, latents: torch.Tensor):
    cfg = params.guidance_scale > 1
    return policy.pipeline(
        prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, true_cfg_scale=params.guidance_scale,
        height=params.height, width=params.width, num_inference_steps=params.num_steps,
        latents=latents.clone(), num_images_per_prompt=len(latents), output_type="pt",
    ).images


def _stock_sd3(policy: DiffusionPolicy, prompt: str, params: SamplingParams, latents: torch.Tensor):
    return policy.pipeline(
        prompt=prompt, negative_prompt=params.negative_prompt, guidance_scale=params.guidance_scale,
        height=params.height, width=params.width, num_inference_steps=params.num_steps,
        max_sequence_length=policy.max_sequence_length, latents=latents.clone(), num_images_per_prompt=len(latents),
        output_type="pt",
    ).images


def _stock_flux(policy: DiffusionPolicy, prompt: str, params: SamplingParams, latents: torch.Tensor):
    cfg = params.guidance_scale > 1
    return policy.pipeline(
        prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, true_cfg_scale=params.guidance_scale,
        guidance_scale=policy.distilled_guidance,
        height=params.height, width=params.width, num_inference_steps=params.num_steps,
        max_sequence_length=policy.max_sequence_length, latents=latents.clone(), num_images_per_prompt=len(latents),
        output_type="pt",
    ).images


def _stock_wan(policy: DiffusionPolicy, prompt: str, params: SamplingParams, latents: torch.Tensor):
    cfg = params.guidance_scale > 1
    return policy.pipeline(
        prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, guidance_scale=params.guidance_scale,
        height=params.height, width=params.width, num_frames=params.num_frames, num_inference_steps=params.num_steps,
        max_sequence_length=policy.max_sequence_length, latents=latents.clone(), num_videos_per_prompt=len(latents),
        output_type="pt",
    ).frames


# Each family's stock diffusers `__call__` from given initial latents: images [B, 3, H, W] (videos
# [B, F, 3, H, W]) in [0, 1].
STOCK_CALLS = {"qwen_image": _stock_qwen_image, "sd3": _stock_sd3, "flux": _stock_flux, "wan": _stock_wan}


def family_sampling(family: str, params: SamplingParams) -> SamplingParams:
    """`params` with what `family` needs on top (FAMILY_SAMPLING)."""
    return params.model_copy(update=FAMILY_SAMPLING.get(family, {}))


@pytest.fixture(scope="session")
def conformance_policies(flowgrpo_home):
    """family -> a policy of its own (weight versions change it; no other test shares it), loaded once."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    loaded: dict[str, DiffusionPolicy] = {}

    def get(family: str) -> DiffusionPolicy:
        if family not in loaded:
            loaded[family] = load_policy(ensure_embedded_model(FAMILIES[family]), family=family)
        return loaded[family]

    return get
