"""Flux.1: a CLIP text encoder (pooled output only) + T5, a FluxTransformer2DModel over 2x2-packed
latents with rotary position ids, a 2-D VAE.

Mirrors the stock ``FluxPipeline.__call__`` (diffusers 0.42):

* CLIP sees the prompt padded to ``tokenizer.model_max_length`` and contributes its pooled output;
  T5 sees it padded to ``max_sequence_length`` (512, capped here by the T5 tokenizer's own limit) and
  every position conditions the transformer (no mask). Text position ids are zeros.
* Latents [B, (H/2f)(W/2f), 4C] are packed 2x2 patches; image position ids are (0, row, col).
* The schedule is ``linspace(1, 1/N, N)`` shifted by mu = calculate_shift(image tokens) (Flux's
  dynamic shift), and the transformer gets ``timestep / 1000`` of the scheduler's timesteps.
* Guidance-distilled transformers (``guidance_embeds``) take the pipeline's ``guidance_scale`` as an
  input: :attr:`FluxPolicy.distilled_guidance` here, a property of the policy, not of a request.
  SamplingParams.guidance_scale is true CFG (the stock ``true_cfg_scale`` with a negative prompt),
  combined without renormalisation, as the stock pipeline does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from serve_app.policies.base import PackedLatentPolicy, PolicySettings
from serve_app.policies.clip_t5 import ClipT5Tokenizers, FluxTextProcessor
from serve_app.config.sampling import MAX_IMAGE_SIDE, SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

DEFAULT_DISTILLED_GUIDANCE = 3.5  # the stock `guidance_scale`
CLIP_SLOT = FluxTextProcessor.clip_slots[0]
T5_SLOT = FluxTextProcessor.t5_slot


class FluxPolicy(ClipT5Tokenizers, PackedLatentPolicy):
    family = "flux"
    pipeline_class = FluxPipeline
    cfg_renormalize = False

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype,
                 settings: PolicySettings | None = None) -> None:
        super().__init__(pipeline, device=device, dtype=dtype, settings=settings)
        given = self.settings.distilled_guidance
        self.distilled_guidance = DEFAULT_DISTILLED_GUIDANCE if given is None else given

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.text_encoder_2, pipeline.vae]

    text_processor_class = FluxTextProcessor

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def max_tokens_per_axis(self) -> int:
        # Rotary embeddings are computed from the position ids on every call: no table bounds the size.
        return MAX_IMAGE_SIDE // self.spatial_multiple

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        config = scheduler.config
        mu = calculate_shift(
            self.latent_shape(height, width)[0],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = None if config.get("use_flow_sigmas", False) else np.linspace(1.0, 1.0 / num_steps, num_steps)
        if sigmas is None:
            scheduler.set_timesteps(num_steps, mu=mu, device="cpu")
        else:
            scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")

    # -- model calls -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        pipe = self.pipeline
        missing = [slot for slot in FluxTextProcessor.slots() if any(slot not in p.token_ids for p in prompts)]
        if missing or not prompts:
            raise ValueError(
                f"Flux needs token ids for {', '.join(FluxTextProcessor.slots())} (use the family's TextProcessor); "
                f"missing: {', '.join(missing) or 'prompts'}"
            )
        clip_ids = torch.stack([p.token_ids[CLIP_SLOT] for p in prompts]).to(self.device)
        pooled = pipe.text_encoder(clip_ids, output_hidden_states=False).pooler_output.to(pipe.text_encoder.dtype)
        t5_ids = torch.stack([p.token_ids[T5_SLOT] for p in prompts]).to(self.device)
        embeds = pipe.text_encoder_2(t5_ids, output_hidden_states=False)[0].to(pipe.text_encoder_2.dtype)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return PromptEmbeds(embeds.to(self.dtype), mask, pooled.to(self.dtype))

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        return self._transformer(latents, sigma, cond, self._token_ids(height, width, latents.device))

    def _token_ids(self, height: int, width: int, device: torch.device, *, image: int = 0) -> torch.Tensor:
        """[tokens, 3] rotary position ids of an image's packed latents: (image, row, column); the generated
        image is image 0 (Kontext's input image: 1)."""
        side = self.spatial_multiple
        ids = self.pipeline._prepare_latent_image_ids(1, height // side, width // side, device, self.dtype)
        ids[..., 0] = image
        return ids

    def _transformer(self, hidden: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds,
                     img_ids: torch.Tensor) -> torch.Tensor:
        """One forward over `hidden` [B, tokens, C] (the latents, and any input image's after them)."""
        if cond.pooled is None:
            raise ValueError("Flux needs pooled CLIP embeddings (PromptEmbeds.pooled)")
        pipe = self.pipeline
        batch = hidden.shape[0]
        txt_ids = torch.zeros(cond.embeds.shape[1], 3, device=hidden.device, dtype=self.dtype)
        # The stock loop passes the scheduler's timestep (sigma * 1000, float32) in the latents' dtype,
        # divided by 1000; the same rounding keeps noise 0 equal to it.
        timestep = (sigma.to(device=hidden.device, dtype=torch.float32)
                    * pipe.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        guidance = None
        if pipe.transformer.config.guidance_embeds:
            guidance = torch.full((batch,), self.distilled_guidance, device=hidden.device, dtype=torch.float32)
        return pipe.transformer(
            hidden_states=hidden.to(self.dtype),
            timestep=timestep,
            guidance=guidance,
            pooled_projections=cond.pooled.to(self.dtype),
            encoder_hidden_states=cond.embeds.to(self.dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        unpacked = pipe._unpack_latents(latents, height, width, self._vae_factor).to(vae.dtype)
        images = vae.decode(unpacked / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        cfg = params.guidance_scale > 1
        return self.pipeline(
            prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, true_cfg_scale=params.guidance_scale,
            guidance_scale=self.distilled_guidance,
            height=params.height, width=params.width, num_inference_steps=params.num_steps,
            max_sequence_length=self.max_sequence_length, latents=latents.clone(), num_images_per_prompt=len(latents),
            output_type="pt",
        ).images
