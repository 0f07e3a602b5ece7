"""FLUX.1 Kontext: Flux conditioned on an input image through its VAE latents, joined to the noisy latents
along the sequence.

What the stock ``FluxKontextPipeline`` (diffusers 0.42) does, and so what this adapter does:

- The input image is resized to the Kontext resolution (``_auto_resize``: 17 sizes of about 1024 x 1024 px)
  nearest the aspect ratio of its sides floored to the VAE factor x 2 (its image processor's
  ``get_default_height_width``), that size's sides floored to the same multiple; the ingress does it
  (:meth:`ImageGeometry.resize_input_image`). At an ``input_image_area`` other than 1024 x 1024 the same
  sizes are scaled to that area (:func:`kontext_resolutions`).
- Its VAE latents are the posterior's mode, shifted and scaled as the generated latents are, and packed
  2x2; their rotary ids are the generated image's with the first coordinate 1 instead of 0.
- The transformer sees [noisy latents ; image latents] and its output is cut back to the noisy latents'
  tokens. The text side is Flux's (CLIP pooled + T5), which never sees the image; true CFG runs the
  negative prompt over the same image latents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from diffusers import FluxKontextPipeline
from diffusers.pipelines.flux import pipeline_flux_kontext
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from serve_app.media import to_pil
from serve_app.policies.base import ImageGeometry, per_input_image_shapes, stack_padded, stock_globals
from serve_app.policies.flux import FluxPolicy
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

# The area PREFERRED_KONTEXT_RESOLUTIONS are sized for.
STOCK_INPUT_IMAGE_AREA = 1024 * 1024


def kontext_resolutions(area: int) -> tuple[tuple[int, int], ...]:
    """Kontext's preferred (width, height) sizes scaled from 1024 x 1024 px to `area`; the stock ones at the stock
    area. Sides are truncated to whole pixels, as the stock pipeline resizes to them: truncating keeps each
    side's floor to a multiple what it is for the exact scaled side."""
    scale = math.sqrt(area / STOCK_INPUT_IMAGE_AREA)
    return tuple((int(w * scale), int(h * scale)) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)


class FluxKontextPolicy(FluxPolicy):
    family = "flux_kontext"
    pipeline_class = FluxKontextPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    input_image_area: int = STOCK_INPUT_IMAGE_AREA

    @property
    def geometry(self) -> ImageGeometry:
        # The pipeline's image processor and its multiple_of are both at the VAE factor x 2.
        return super().geometry.with_input_resolutions(kontext_resolutions(self.input_image_area),
                                                       multiple=self.spatial_multiple)

    # -- conditioning --------------------------------------------------------------------------

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] -> packed latents [B, tokens, channels] (the posterior's mode,
        shifted and scaled as FluxKontextPipeline._encode_vae_image does)."""
        vae = self.pipeline.vae
        self.check_size(*images.shape[-2:])
        latents = vae.encode(images.to(self.device, vae.dtype) * 2.0 - 1.0).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        return self.pipeline._pack_latents(latents, *latents.shape)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """Flux's text conditioning, and each prompt's input image (uint8 [3, h, w], already at its
        conditioning size) as packed VAE latents."""
        for i, p in enumerate(prompts):
            self.geometry.check_input_image_count(len(p.images), f"prompts[{i}].images")
        text = super().encode_prompts(prompts)
        side = self.spatial_multiple
        latents = [self.encode_images(p.images[0][None].float() / 255.0)[0] for p in prompts]
        shapes = torch.tensor([[(1, p.images[0].shape[-2] // side, p.images[0].shape[-1] // side)] for p in prompts],
                              dtype=torch.long)
        return PromptEmbeds(text.embeds, text.mask, text.pooled, image_latents=stack_padded(latents).to(self.dtype),
                            image_shapes=shapes.to(self.device))

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        """The transformer over [latents ; each sample's image latents], its output cut to the latents' tokens."""
        if cond.image_latents is None:
            raise ValueError(f"{self.family} conditions on an input image; the prompt embeddings carry none")
        image_latents = cond.image_latents
        ids = self._token_ids(height, width, latents.device)
        side = self.spatial_multiple

        def run(rows: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
            def pick(t: torch.Tensor | None) -> torch.Tensor | None:
                return t if rows is None or t is None else t[rows]

            ((_, image_rows, image_cols),) = shapes
            image_ids = self._token_ids(image_rows * side, image_cols * side, latents.device, image=1)
            noisy = pick(latents)
            hidden = torch.cat([noisy, pick(image_latents)[:, : image_rows * image_cols].to(noisy.dtype)], dim=1)
            text = PromptEmbeds(pick(cond.embeds), pick(cond.mask), pick(cond.pooled))
            return self._transformer(hidden, pick(sigma), text, torch.cat([ids, image_ids]))[:, : latents.shape[1]]

        return per_input_image_shapes(cond, run)

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock ``FluxKontextPipeline.__call__`` on `images` (one uint8 [3, H, W] as sent: the pipeline resizes
        it, ``_auto_resize``), generating params.height x params.width (``max_area`` set to it: the stock default
        rescales the output to 1024 x 1024). At an ``input_image_area`` other than 1024 x 1024 its resolution list
        is replaced by :func:`kontext_resolutions` for the call (the tiny checkpoint conditions on about 32 x 32 px)."""
        if len(images) != 1:
            raise ValueError(f"{self.family} takes exactly one input image; got {len(images)}")
        cfg = params.guidance_scale > 1
        area = self.input_image_area
        resolutions = {} if area == STOCK_INPUT_IMAGE_AREA else {
            "PREFERRED_KONTEXT_RESOLUTIONS": list(kontext_resolutions(area))}
        with stock_globals(pipeline_flux_kontext, **resolutions):
            return self.pipeline(
                image=to_pil(images[0]), prompt=prompt, negative_prompt=params.negative_prompt if cfg else None,
                true_cfg_scale=params.guidance_scale, guidance_scale=self.distilled_guidance,
                height=params.height, width=params.width, max_area=params.height * params.width,
                num_inference_steps=params.num_steps, max_sequence_length=self.max_sequence_length,
                latents=latents.clone(), num_images_per_prompt=len(latents), output_type="pt",
            ).images
