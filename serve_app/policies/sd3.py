"""Stable Diffusion 3: CLIP-L + CLIP-G + T5 text encoders, an MMDiT over 2x2 patches, a 2-D VAE.

The text side mirrors the stock ``StableDiffusion3Pipeline.encode_prompt``: both CLIP towers see
their prompt padded to ``tokenizer.model_max_length`` (77) and contribute ``hidden_states[-2]``
(clip_skip None) and their projected pooled output; T5 sees its prompt padded to
``max_sequence_length``. Nothing is masked: every position of the padded sequences conditions the
transformer, exactly as in the stock pipeline, so the tokenizer pads in full rather than per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from serve_app.policies.base import DiffusionPolicy
from serve_app.policies.clip_t5 import ClipT5Tokenizers, SD3TextProcessor
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

CLIP_SLOTS = SD3TextProcessor.clip_slots
T5_SLOT = SD3TextProcessor.t5_slot


class SD3Policy(ClipT5Tokenizers, DiffusionPolicy):
    family = "sd3"
    pipeline_class = StableDiffusion3Pipeline
    cfg_renormalize = False

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        encoders = [pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3]
        return [m for m in encoders if m is not None] + [pipeline.vae]

    text_processor_class = SD3TextProcessor

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def _vae_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor)

    @property
    def _patch_size(self) -> int:
        return int(self.pipeline.transformer.config.patch_size)

    @property
    def spatial_multiple(self) -> int:
        return self._vae_factor * self._patch_size

    @property
    def max_tokens_per_axis(self) -> int:
        # SD3 crops a pos_embed_max_size x pos_embed_max_size table of patch positions.
        config = self.pipeline.transformer.config
        return int(config.pos_embed_max_size or config.sample_size // self._patch_size)

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        channels = self.pipeline.transformer.config.in_channels
        return (channels, height // self._vae_factor, width // self._vae_factor)

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        config = scheduler.config
        kwargs: dict[str, Any] = {}
        if config.get("use_dynamic_shifting", None):
            _, latent_h, latent_w = self.latent_shape(height, width)
            image_seq_len = (latent_h // self._patch_size) * (latent_w // self._patch_size)
            kwargs["mu"] = calculate_shift(
                image_seq_len,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),  # the SD3 pipeline's fallback (Flux/Qwen use 1.15)
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)

    # -- model calls -------------------------------------------------------------------------

    def _clip(self, encoder: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = encoder(ids.to(self.device), output_hidden_states=True)
        dtype = self.pipeline.text_encoder.dtype
        return out.hidden_states[-2].to(dtype), out[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        pipe = self.pipeline
        missing = [slot for slot in CLIP_SLOTS if any(slot not in p.token_ids for p in prompts)]
        if missing or not prompts:
            raise ValueError(
                f"SD3 needs token ids for {', '.join(SD3TextProcessor.slots())} (use the family's TextProcessor); "
                f"missing: {', '.join(missing) or 'prompts'}"
            )
        clip_l, pooled_l = self._clip(pipe.text_encoder, torch.stack([p.token_ids["tokenizer"] for p in prompts]))
        clip_g, pooled_g = self._clip(pipe.text_encoder_2, torch.stack([p.token_ids["tokenizer_2"] for p in prompts]))
        clip = torch.cat([clip_l, clip_g], dim=-1)

        if pipe.text_encoder_3 is None:
            length = (
                prompts[0].token_ids[T5_SLOT].shape[0] if T5_SLOT in prompts[0].token_ids else self.max_sequence_length
            )
            t5 = torch.zeros(
                (len(prompts), length, pipe.transformer.config.joint_attention_dim),
                device=self.device,
                dtype=pipe.text_encoder.dtype,
            )
        else:
            if any(T5_SLOT not in p.token_ids for p in prompts):
                raise ValueError(f"SD3 needs token ids for {T5_SLOT} (use the family's TextProcessor)")
            t5_ids = torch.stack([p.token_ids[T5_SLOT] for p in prompts]).to(self.device)
            t5 = pipe.text_encoder_3(t5_ids)[0].to(pipe.text_encoder_3.dtype)

        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        embeds = torch.cat([clip, t5], dim=-2)
        pooled = torch.cat([pooled_l, pooled_g], dim=-1)
        mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return PromptEmbeds(embeds.to(self.dtype), mask, pooled.to(self.dtype))

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        if cond.pooled is None:
            raise ValueError("SD3 needs pooled prompt embeddings (PromptEmbeds.pooled)")
        # The stock pipeline passes scheduler.timesteps = sigmas * num_train_timesteps (float32).
        num_train_timesteps = self.pipeline.scheduler.config.num_train_timesteps
        timestep = sigma.to(device=latents.device, dtype=torch.float32) * num_train_timesteps
        return self.pipeline.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timestep,
            encoder_hidden_states=cond.embeds.to(self.dtype),
            pooled_projections=cond.pooled.to(self.dtype),
            return_dict=False,
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        latents = (latents.to(vae.dtype) / vae.config.scaling_factor) + vae.config.shift_factor
        images = vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        return self.pipeline(
            prompt=prompt, negative_prompt=params.negative_prompt, guidance_scale=params.guidance_scale,
            height=params.height, width=params.width, num_inference_steps=params.num_steps,
            max_sequence_length=self.max_sequence_length, latents=latents.clone(), num_images_per_prompt=len(latents),
            output_type="pt",
        ).images
