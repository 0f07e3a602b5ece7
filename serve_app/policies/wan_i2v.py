"""Wan image-to-video (Wan2.1-I2V, Wan2.2-I2V-A14B): Wan text-to-video whose video starts from an input image.

Mirrors the stock ``WanImageToVideoPipeline.__call__`` (diffusers 0.42):

* The input image (the request's one image per prompt) is resized to the video's height x width (the video
  processor's Lanczos resize, aspect ratio not kept); the ingress does it
  (``ImageGeometry.input_image_joins == "channels"``).
* The first-frame conditioning: the VAE encodes [image ; num_frames - 1 black frames] (pixels in [-1, 1], the
  posterior's mode), normalised with the VAE's latents_mean / latents_std; a mask of the VAE's temporal factor
  in channels is 1 on the first latent frame and 0 elsewhere. The transformer takes
  [noisy latents ; mask ; condition latents] along the channels every step, and its output (the velocity of the
  noisy latents' channels) is what the sampler steps. The conditioning depends on the frame count, so it is
  encoded per request (:meth:`WanImageToVideoPolicy.encode_prompts_for`).
* Wan2.1-I2V (``transformer.config.image_dim``): a CLIP vision encoder sees the image as sent, through the
  checkout's ``image_processor``; its penultimate hidden states go to the transformer as
  ``encoder_hidden_states_image``. Wan2.2-I2V-A14B has no image encoder, and two experts as Wan2.2-T2V-A14B.
* True CFG runs the negative prompt over the same image conditioning, as the stock loop does.

Everything else (schedule, experts, decoding) is the text-to-video adapter's (serve_app/policies/wan.py). The log-prob
covers the noisy latents only: the conditioning channels are inputs, never sampled.

Not supported, refused at load: Wan2.2-TI2V-5B's image-to-video (``expand_timesteps``: the first frame's latents
replace the noise, with timestep 0 on their tokens) and a last-frame image (first-last-frame-to-video).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import WanImageToVideoPipeline
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

from serve_app.config.sampling import SamplingParams
from serve_app.media import to_pil
from serve_app.policies.base import ImageGeometry, stock_globals
from serve_app.policies.wan import HIGH_NOISE_EXPERT, WanPolicy, expert_problems, present_experts
from serve_app.schemas import PromptEmbeds, PromptTokens


def unsupported_i2v_parts(pipeline: Any) -> list[str]:
    """What in a WanImageToVideoPipeline this adapter cannot run, one line each (empty: it runs it)."""
    problems = expert_problems(pipeline)
    if pipeline.config.get("expand_timesteps", False):
        problems.append("expand_timesteps: Wan2.2-TI2V-5B's image-to-video (first-frame latents in place of the "
                        "noise, per-token timesteps) is not supported")
    z_dim = pipeline.vae.config.z_dim
    mask_channels = int(pipeline.vae_scale_factor_temporal)
    for name, expert in present_experts(pipeline).items():
        config = expert.config
        if config.in_channels != 2 * z_dim + mask_channels or config.out_channels != z_dim:
            problems.append(f"{name}.config in_channels/out_channels = {config.in_channels}/{config.out_channels}: "
                            f"image-to-video takes {2 * z_dim + mask_channels} in (z_dim {z_dim} latents, "
                            f"{mask_channels} mask channels, {z_dim} first-frame latents) and gives {z_dim}")
    primary = getattr(pipeline, HIGH_NOISE_EXPERT, None)
    if primary is not None and primary.config.get("image_dim") is not None:
        if getattr(pipeline, "image_encoder", None) is None or getattr(pipeline, "image_processor", None) is None:
            problems.append(f"transformer.config.image_dim = {primary.config.image_dim} but no `image_encoder` and "
                            "`image_processor`: the image embeddings the transformer takes cannot be made")
    return problems


class WanImageToVideoPolicy(WanPolicy):
    family = "wan_i2v"
    pipeline_class = WanImageToVideoPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    supports = "image-to-video Wan2.1-I2V / Wan2.2-I2V-A14B"
    unsupported = staticmethod(unsupported_i2v_parts)

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        encoder = getattr(pipeline, "image_encoder", None)
        return [pipeline.text_encoder, pipeline.vae, *([encoder] if encoder is not None else [])]

    @property
    def uses_image_encoder(self) -> bool:
        """Whether the transformer takes CLIP image embeddings (Wan2.1-I2V), as the stock pipeline decides."""
        return self.pipeline.transformer.config.get("image_dim") is not None

    @property
    def geometry(self) -> ImageGeometry:
        return dataclasses.replace(super().geometry, input_image_joins="channels",
                                   condition_image_as_sent=self.uses_image_encoder)

    # -- conditioning --------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """The conditioning of the shortest video the model takes (a health probe's); samples of a request
        get :meth:`encode_prompts_for` its frame count."""
        return self._encode(prompts, self.geometry.min_frames)

    @torch.no_grad()
    def encode_prompts_for(self, prompts: Sequence[PromptTokens], params: SamplingParams) -> PromptEmbeds:
        """Text, the first-frame conditioning of a `params.num_frames` video, and (Wan2.1) the CLIP states of
        each prompt's image; each image must already be at the video's size (the ingress resizes it)."""
        for i, p in enumerate(prompts):
            if p.images and tuple(p.images[0].shape[-2:]) != (params.height, params.width):
                raise ValueError(f"prompts[{i}]'s input image is {tuple(p.images[0].shape[-2:])}, not the video's "
                                 f"{(params.height, params.width)}: resize it with the family's geometry")
        return self._encode(prompts, params.num_frames)

    def _encode(self, prompts: Sequence[PromptTokens], num_frames: int) -> PromptEmbeds:
        for i, p in enumerate(prompts):
            self.geometry.check_input_image_count(len(p.images), f"prompts[{i}].images")
        text = super().encode_prompts(prompts)
        conditions = [self.first_frame_condition(p.images[0], num_frames) for p in prompts]
        channels = conditions[0].shape[0]
        shapes = torch.tensor([[tuple(c.shape[1:])] for c in conditions], dtype=torch.long)
        tokens = torch.stack([c.permute(1, 2, 3, 0).reshape(-1, channels) for c in conditions])
        image_embeds = None
        if self.uses_image_encoder:
            image_embeds = torch.cat([self.clip_states(p.condition_images[0]) for p in prompts]).to(self.dtype)
        return PromptEmbeds(text.embeds, text.mask, image_latents=tokens.to(self.dtype),
                            image_shapes=shapes.to(self.device), image_embeds=image_embeds)

    def first_frame_condition(self, image: torch.Tensor, num_frames: int) -> torch.Tensor:
        """uint8 [3, H, W] at the video's size -> [mask channels + z_dim, F', H', W'] float32: the mask (1 on the
        first latent frame) and the normalised latents of [image ; num_frames - 1 black frames]."""
        vae = self.pipeline.vae
        pixels = image.to(self.device, torch.float32) / 255.0 * 2.0 - 1.0
        video = torch.cat([pixels[None, :, None], pixels.new_zeros(1, 3, num_frames - 1, *pixels.shape[-2:])], dim=2)
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        mean, inv_std = self._latent_statistics(latents)
        latents = ((latents - mean) * inv_std)[0]
        mask = latents.new_zeros(int(self.pipeline.vae_scale_factor_temporal), *latents.shape[1:])
        mask[:, 0] = 1.0
        return torch.cat([mask, latents])

    def clip_states(self, image: torch.Tensor) -> torch.Tensor:
        """uint8 [3, H, W] as sent -> [1, L, D]: the image encoder's penultimate hidden states of the checkout's
        image processor's copy, as the stock ``encode_image``."""
        pixels = self.pipeline.image_processor(images=to_pil(image), return_tensors="pt")["pixel_values"]
        encoder = self.pipeline.image_encoder
        return encoder(pixel_values=pixels.to(self.device), output_hidden_states=True).hidden_states[-2]

    def _transformer_inputs(self, latents: torch.Tensor, cond: PromptEmbeds
                            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """[noisy latents ; mask ; first-frame latents] along the channels, and the CLIP states when the
        transformer takes them."""
        if cond.image_latents is None or cond.image_shapes is None:
            raise ValueError(f"{self.family} conditions on a first frame; the prompt embeddings carry none")
        shapes = cond.image_shapes[:, 0]
        if not bool((shapes == shapes[0]).all()) or tuple(shapes[0].tolist()) != tuple(latents.shape[2:]):
            raise ValueError(f"first-frame conditioning of latent shapes {shapes.tolist()} for latents of "
                             f"{tuple(latents.shape[2:])}: encode it for the samples' frame count and size")
        frames, rows, cols = latents.shape[2:]
        condition = cond.image_latents[:, : frames * rows * cols].reshape(len(latents), frames, rows, cols, -1)
        hidden = torch.cat([latents, condition.permute(0, 4, 1, 2, 3).to(latents.dtype)], dim=1)
        if cond.image_embeds is None:
            return hidden, {}
        return hidden, {"encoder_hidden_states_image": cond.image_embeds.to(latents.dtype)}

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock ``WanImageToVideoPipeline.__call__`` on `images` (one uint8 [3, H, W] as sent: the pipeline
        resizes it), one sample a call: with CLIP embeddings the stock call repeats them per prompt, not per
        video, so several videos of a prompt in one call do not fit the transformer. The image-to-video module's
        prompt cleaning calls ftfy without checking that it is installed; the call runs with the text-to-video
        module's, which does check (the same cleaning otherwise, and what the policy's text processor runs)."""
        if len(images) != 1:
            raise ValueError(f"{self.family} takes exactly one input image; got {len(images)}")
        cfg = params.guidance_scale > 1
        with stock_globals(pipeline_wan_i2v, basic_clean=pipeline_wan.basic_clean):
            return self._stock_videos(prompt, params, latents, images[0], cfg)

    def _stock_videos(self, prompt: str, params: SamplingParams, latents: torch.Tensor, image: torch.Tensor,
                      cfg: bool) -> torch.Tensor:
        return torch.cat([self.pipeline(
            image=to_pil(image), prompt=prompt, negative_prompt=params.negative_prompt if cfg else None,
            guidance_scale=params.guidance_scale, guidance_scale_2=params.guidance_scale_2,
            height=params.height, width=params.width, num_frames=params.num_frames,
            num_inference_steps=params.num_steps, max_sequence_length=self.max_sequence_length,
            latents=sample[None].clone(), output_type="pt",
        ).frames for sample in latents])
