"""Qwen-Image: a Qwen2.5-VL text encoder, an MMDiT over 2x2-packed latents, a video-style VAE."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from diffusers import QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from serve_app.policies.base import PackedLatentPolicy
from serve_app.policies.qwen_text import TEMPLATE_PREFIX_TOKENS, QwenImageTextProcessor
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

def right_padded(ids: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, longest] padded on the right, and their attention mask (right padding: causal
    attention keeps the real tokens' states exact)."""
    longest = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)] = torch.as_tensor(x)
        attention_mask[row, : len(x)] = 1
    return input_ids, attention_mask


def without_prefix(hidden: torch.Tensor, lengths: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden states [B, T, D] of each row's tokens after the template's first `prefix`, left-aligned
    and zero-padded to the longest, with their bool mask: what the transformer attends to."""
    kept = (lengths - prefix).tolist()
    embeds = hidden.new_zeros(len(kept), max(kept), hidden.shape[-1])
    mask = torch.zeros(len(kept), max(kept), dtype=torch.bool, device=hidden.device)
    for row, n in enumerate(kept):
        embeds[row, :n] = hidden[row, prefix : prefix + n]
        mask[row, :n] = True
    return embeds, mask


class QwenImagePolicy(PackedLatentPolicy):
    family = "qwen_image"
    pipeline_class = QwenImagePipeline
    cfg_renormalize = True

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.vae]

    def _make_text_processor(self) -> QwenImageTextProcessor:
        return QwenImageTextProcessor({"tokenizer": self.pipeline.tokenizer})

    @property
    def max_tokens_per_axis(self) -> int:
        # QwenEmbedRope precomputes its rotary frequencies for 4096 positions per axis.
        return int(self.pipeline.transformer.pos_embed.pos_freqs.shape[0])

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        seq_len = self.latent_shape(height, width)[0]
        config = scheduler.config
        mu = calculate_shift(
            seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu, device="cpu")

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        return self.embed_prompts(prompts)

    def embed_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """encode_prompts with autograd on: pretraining trains the text encoder through it."""
        ids = [p.token_ids["tokenizer"] for p in prompts]
        lengths = torch.tensor([len(x) for x in ids])
        if int(lengths.min()) <= TEMPLATE_PREFIX_TOKENS:
            raise ValueError("token ids must include the Qwen-Image prompt template (use the family's TextProcessor)")
        input_ids, attention_mask = right_padded(ids, self.pipeline.tokenizer.pad_token_id or 0)
        # The base model alone: its last (normed) hidden state is the pipeline's hidden_states[-1], without
        # the 152k-wide LM head the stock call computes and throws away.
        hidden = self.pipeline.text_encoder.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
        ).last_hidden_state
        embeds, mask = without_prefix(hidden, lengths, TEMPLATE_PREFIX_TOKENS)
        return PromptEmbeds(embeds.to(self.dtype), mask)

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        grid = (1, height // self.spatial_multiple, width // self.spatial_multiple)
        mask = None if bool(cond.mask.all()) else cond.mask
        return self.pipeline.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=sigma.to(device=latents.device, dtype=self.dtype),
            encoder_hidden_states=cond.embeds.to(self.dtype),
            encoder_hidden_states_mask=mask,
            img_shapes=[[grid]] * latents.shape[0],
            return_dict=False,
        )[0]

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] -> packed latents [B, tokens, channels]; decode's inverse
        (exactly so for a pixel-space VAE). Uses the VAE posterior's mode."""
        pipe, vae = self.pipeline, self.pipeline.vae
        height, width = images.shape[-2:]
        self.check_size(height, width)
        pixels = (images.to(self.device, vae.dtype) * 2.0 - 1.0).unsqueeze(2)  # the pipeline's [-1, 1]
        latents = vae.encode(pixels).latent_dist.mode()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=latents.device, dtype=latents.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=latents.device, dtype=latents.dtype).view(shape)
        latents = ((latents - mean) / std)[:, :, 0]
        return pipe._pack_latents(latents, latents.shape[0], vae.config.z_dim, latents.shape[-2], latents.shape[-1])

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        unpacked = pipe._unpack_latents(latents, height, width, self._vae_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean, device=unpacked.device, dtype=unpacked.dtype).view(shape)
        std = torch.tensor(vae.config.latents_std, device=unpacked.device, dtype=unpacked.dtype).view(shape)
        images = vae.decode(unpacked * std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(images, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        cfg = params.guidance_scale > 1
        return self.pipeline(
            prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, true_cfg_scale=params.guidance_scale,
            height=params.height, width=params.width, num_inference_steps=params.num_steps,
            latents=latents.clone(), num_images_per_prompt=len(latents), output_type="pt",
        ).images
