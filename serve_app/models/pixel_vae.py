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

import math

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput
from diffusers.models.modeling_utils import ModelMixin
from torch.nn import functional as F

__all__ = ["ModelMixin", "PixelPatchVAE"]


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
