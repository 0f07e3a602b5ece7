"""A pixel-space "VAE" for QwenImagePipeline: space-to-depth and back, no weights.

For a model that works on small images directly (flat-coloured procedural scenes, say), a learned
autoencoder would add a lossy stage and a training run in front of what RL should fix, so this
component only rearranges pixels: ``encode`` folds each ``patch_size x patch_size`` block of RGB
into ``3 * patch_size**2`` channels, ``decode`` unfolds them. Both are exact inverses, values stay
in the pipeline's [-1, 1] pixel range, and the latent statistics are identity (mean 0, std 1).

It keeps the interface QwenImagePipeline and our QwenImagePolicy use of AutoencoderKLQwenImage:
5-D video tensors ``[B, C, 1, H, W]``, ``config.z_dim``, ``config.latents_mean/std``,
``encode(x).latent_dist`` and ``decode(z, return_dict=False)[0]``; the pipeline derives its
``vae_scale_factor`` as ``2 ** len(vae.temperal_downsample)``.

A checkpoint's ``model_index.json`` names it as ``["serve_app.models.pixel_vae", "PixelPatchVAE"]``.
diffusers imports no module a checkpoint names, so a model config lists it under ``components``
(``vae: serve_app.models.pixel_vae:PixelPatchVAE``) and the policy loads it itself."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput
from diffusers.models.modeling_utils import ModelMixin
from torch.nn import functional as F

__all__ = ["ModelMixin", "PixelPatchVAE", "PixelPatchVideoVAE", "save_pixel_space_pipeline"]


class PixelPatchVAE(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 3,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
    ) -> None:
        super().__init__()
        if patch_size < 1 or patch_size & (patch_size - 1):
            raise ValueError(f"patch_size must be a power of two, got {patch_size}")
        # z_dim and the identity latent statistics are derived, but live in the config because the
        # pipeline and the policy read them from there (as from AutoencoderKLQwenImage's).
        derived = in_channels * patch_size**2
        if z_dim not in (None, derived):
            raise ValueError(f"z_dim is in_channels * patch_size**2 = {derived}, got {z_dim}")
        if (latents_mean or [0.0]) != [0.0] * len(latents_mean or [0.0]) or (latents_std or [1.0]) != [1.0] * len(latents_std or [1.0]):
            raise ValueError("a pixel-space VAE has identity latent statistics (mean 0, std 1)")
        self.register_to_config(z_dim=derived, latents_mean=[0.0] * derived, latents_std=[1.0] * derived)
        # The pipeline's scale factor is 2 ** len(temperal_downsample) (AutoencoderKLQwenImage's name).
        self.temperal_downsample = [False] * int(math.log2(patch_size))
        # A parameter-free module has no dtype or device for ModelMixin to report; this buffer
        # carries them (and is the one tensor in the saved weights file).
        self.register_buffer("pixel_scale", torch.ones(()), persistent=True)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        """[B, 3, 1, H, W] in [-1, 1] -> latent_dist over [B, z_dim, 1, H/p, W/p] (exact: zero variance)."""
        if x.ndim != 5 or x.shape[2] != 1:
            raise ValueError(f"expected [B, C, 1, H, W] images, got {tuple(x.shape)}")
        z = F.pixel_unshuffle(x[:, :, 0] * self.pixel_scale, self.config.patch_size).unsqueeze(2)
        dist = DiagonalGaussianDistribution(torch.cat([z, torch.zeros_like(z)], dim=1), deterministic=True)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        """[B, z_dim, 1, h, w] -> [B, 3, 1, h*p, w*p]."""
        if z.ndim != 5 or z.shape[2] != 1:
            raise ValueError(f"expected [B, C, 1, h, w] latents, got {tuple(z.shape)}")
        x = (F.pixel_shuffle(z[:, :, 0], self.config.patch_size) / self.pixel_scale).unsqueeze(2)
        return DecoderOutput(sample=x) if return_dict else (x,)


class PixelPatchVideoVAE(PixelPatchVAE):
    """The same space-to-depth for WanPipeline's videos, frame by frame: ``[B, 3, F, H, W]`` in
    [-1, 1] <-> ``[B, 3 p^2, F, H/p, W/p]``, any number of frames (temporal factor 1).

    It keeps the interface WanPipeline and our WanPolicy use of AutoencoderKLWan: ``config.z_dim``,
    ``latents_mean/std`` (identity), ``scale_factor_temporal`` / ``scale_factor_spatial`` (which the
    pipeline reads from the config), ``encode(x).latent_dist`` and ``decode(z, return_dict=False)[0]``.
    A checkpoint's ``model_index.json`` names it as ``["serve_app.models.pixel_vae", "PixelPatchVideoVAE"]``.
    """

    @register_to_config
    def __init__(
        self,
        patch_size: int = 2,
        in_channels: int = 3,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
        scale_factor_temporal: int = 1,
        scale_factor_spatial: int | None = None,
    ) -> None:
        super().__init__(patch_size, in_channels, z_dim, latents_mean, latents_std)
        if scale_factor_temporal != 1 or scale_factor_spatial not in (None, patch_size):
            raise ValueError("a pixel-space video VAE folds no frames (temporal factor 1) and patch_size pixels "
                             f"per side (spatial factor {patch_size})")
        self.register_to_config(scale_factor_temporal=1, scale_factor_spatial=patch_size)

    def _frames(self, x: torch.Tensor, fold) -> torch.Tensor:
        batch, _, frames = x.shape[:3]
        per_frame = fold(x.transpose(1, 2).flatten(0, 1))  # [B F, C', H', W']
        return per_frame.unflatten(0, (batch, frames)).transpose(1, 2)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        """[B, 3, F, H, W] in [-1, 1] -> latent_dist over [B, z_dim, F, H/p, W/p] (exact: zero variance)."""
        if x.ndim != 5:
            raise ValueError(f"expected [B, C, F, H, W] videos, got {tuple(x.shape)}")
        z = self._frames(x * self.pixel_scale, lambda f: F.pixel_unshuffle(f, self.config.patch_size))
        dist = DiagonalGaussianDistribution(torch.cat([z, torch.zeros_like(z)], dim=1), deterministic=True)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def decode(self, z: torch.Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        """[B, z_dim, F, h, w] -> [B, 3, F, h*p, w*p]."""
        if z.ndim != 5:
            raise ValueError(f"expected [B, C, F, h, w] latents, got {tuple(z.shape)}")
        x = self._frames(z, lambda f: F.pixel_shuffle(f, self.config.patch_size)) / self.pixel_scale
        return DecoderOutput(sample=x) if return_dict else (x,)


def save_pixel_space_pipeline(pipe: Any, out_dir: Path, *, dtype: torch.dtype | None = None) -> None:
    """``save_pretrained`` of a pipeline whose VAE is one of these (transformer and text encoder cast
    to ``dtype`` first when given), with model_index.json naming the VAE by its defining module:
    ``save_pretrained`` records the top-level package, and diffusers looks the class up in the
    module a checkpoint names. An edit pipeline's processor is named as a released checkout names
    it (``transformers.Qwen2VLProcessor``; the policy loads it as
    :class:`~serve_app.models.vl_processor.Qwen2VLImageOnlyProcessor`)."""
    out_dir = Path(out_dir)
    if dtype is not None:
        for module in (pipe.transformer, pipe.text_encoder):
            module.to(dtype)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    index_file = out_dir / "model_index.json"
    index = json.loads(index_file.read_text())
    index["vae"] = [type(pipe.vae).__module__, type(pipe.vae).__name__]
    if getattr(pipe, "processor", None) is not None:
        from .vl_processor import RELEASED_PROCESSOR_CLASS

        index["processor"] = RELEASED_PROCESSOR_CLASS
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
