"""Built-in rewards: cheap image statistics that need no model weights.

Each factory returns a reward ``(images uint8 [B, 3, H, W], prompts) -> float32 [B]`` on the
images' device (JPEG rewards: on CPU). Prompts are ignored; they are part of the signature so that
every reward is called the same way.
"""

from __future__ import annotations

import importlib
import io
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from .registry import RewardFn, check_image_batch, register_reward


def _jpeg_kb(images: torch.Tensor, quality: int) -> torch.Tensor:
    """JPEG size of each image in kB (1000 bytes), as DDPO measures it."""
    arrays = images.detach().cpu().permute(0, 2, 3, 1).contiguous().numpy()
    sizes = []
    for arr in arrays:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


def _check_quality(quality: int) -> None:
    if not 1 <= quality <= 95:
        # PIL documents 95 as the useful maximum; above it JPEG stops compressing sensibly.
        raise ValueError(f"JPEG quality must be in [1, 95], got {quality}")


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(quality: int = 95) -> RewardFn:
    """DDPO's ``jpeg_incompressibility``: reward = JPEG size in kB (unscaled)."""
    _check_quality(quality)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        return _jpeg_kb(images, quality)

    return reward


@register_reward("jpeg_compressibility")
def jpeg_compressibility(quality: int = 95) -> RewardFn:
    """DDPO's ``jpeg_compressibility``: reward = -(JPEG size in kB) / 500.

    The /500 is DDPO's scale (a 512x512 image is roughly 10-200 kB), so typical values lie in
    about [-0.4, 0]; the group normalisation of the advantages removes the scale anyway.
    """
    _check_quality(quality)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        return -_jpeg_kb(images, quality) / 500.0

    return reward


def _unit_interval(name: str, value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


@register_reward("brightness")
def brightness(target: float = 0.8) -> RewardFn:
    """reward = -|mean pixel value in [0, 1] - target|, so 0 at the target and at worst -1."""
    target = _unit_interval("target", target)

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        mean = images.float().mean(dim=(1, 2, 3)) / 255.0
        return -(mean - target).abs()

    return reward


@register_reward("color_target")
def color_target(rgb: Sequence[float]) -> RewardFn:
    """reward = -RMS over channels of (image mean RGB in [0, 1] - ``rgb``); in [-1, 0], 0 on target.

    Only the image's average colour matters, so many images reach the optimum: a simple signal
    that a policy learns within a few steps, which makes it a good smoke test of training.
    """
    if isinstance(rgb, (str, bytes)) or len(rgb) != 3:
        raise ValueError(f"rgb must be three floats in [0, 1], got {rgb!r}")
    target_list = [_unit_interval(f"rgb[{i}]", c) for i, c in enumerate(rgb)]

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        mean_rgb = images.float().mean(dim=(2, 3)) / 255.0
        target = torch.tensor(target_list, dtype=torch.float32, device=images.device)
        return -(mean_rgb - target).square().mean(dim=1).sqrt()

    return reward


@register_reward("saturation")
def saturation() -> RewardFn:
    """reward = mean HSV saturation ``(max - min) / max`` over pixels, in [0, 1] (black counts 0)."""

    def reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        check_image_batch(images, prompts)
        x = images.float()
        hi = x.amax(dim=1)
        lo = x.amin(dim=1)
        sat = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1.0), torch.zeros_like(hi))
        return sat.mean(dim=(1, 2))

    return reward


# The model-based and remote rewards live in modules of their own and register on import, wherever
# the built-ins are loaded; they import transformers/HTTP machinery only when a reward is built.
for _module in ("clip_score", "remote"):
    importlib.import_module(f".{_module}", __package__)
# Video rewards (`frames` over any image reward, `temporal_consistency`): torch only, no codec.
importlib.import_module(".video", __package__)
