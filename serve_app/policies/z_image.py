"""Z-Image: a Qwen3 text encoder, the single-stream ZImageTransformer2DModel (text and image tokens in one
sequence, 2x2 patches), the Flux.1 VAE.

Mirrors the stock ``ZImagePipeline.__call__`` (diffusers 0.42):

* A prompt goes through the tokenizer's chat template as one user message with the generation prompt and
  ``enable_thinking=True`` (Qwen3's template then adds no thinking block), is truncated to and padded to
  ``max_sequence_length`` (512, capped here by the tokenizer's own limit), and conditions the transformer by
  the encoder's ``hidden_states[-2]`` at its real tokens only: the transformer takes one caption of its own
  length per sample.
* Latents are the stock's unpacked [B, C, H/f, W/f] (the transformer patchifies them itself, one frame).
* The schedule is ``linspace(1, 1/N, N)`` (the pipeline's own float32 one) given to the scheduler with
  mu = calculate_shift(image tokens), which only a dynamically shifting scheduler reads (the release's
  shifts statically, by 3).
* The transformer runs in the other time direction: it gets ``(1000 - t) / 1000`` = 1 - sigma for the
  scheduler's timestep t = 1000 sigma, and predicts d x / d(1 - sigma); the stock loop negates it before the
  scheduler step, and :meth:`ZImagePolicy.predict` returns it negated too: d x / d sigma, as every family's.
* True CFG: the stock combines ``pos + s (pos - neg)`` and runs it for any ``guidance_scale`` s > 0; that is
  the usual ``neg + w (pos - neg)`` at w = s + 1, so SamplingParams.guidance_scale is w (CFG when w > 1) and
  ``stock_call`` passes s = w - 1. The stock extras are off by default and stay off: ``cfg_normalization``
  False (no renormalisation) and ``cfg_truncation`` 1.0 (1 - sigma never exceeds it, so CFG runs every step).
* Decoding un-normalises with the VAE's scaling and shift factors, as Flux's does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas

from serve_app.config.sampling import SamplingParams
from serve_app.policies.base import DiffusionPolicy, stack_padded
from serve_app.policies.single_tokenizer import TOKENIZER_SLOT, SingleTokenizer, ZImageTextProcessor, padded_ids
from serve_app.schemas import PromptEmbeds, PromptTokens

PATCH_SIZE = 2  # the stock pipeline's: it sizes latents by vae_scale_factor x 2 and calls the transformer's default
# The stock loop's time transform: the transformer's time runs from 0 (noise) to 1 (image).
TIME_SCALE = 1000.0


class ZImagePolicy(SingleTokenizer, DiffusionPolicy):
    family = "z_image"
    pipeline_class = ZImagePipeline
    cfg_renormalize = False  # the stock cfg_normalization's default

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.vae]

    text_processor_class = ZImageTextProcessor

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def _vae_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor)

    @property
    def spatial_multiple(self) -> int:
        return self._vae_factor * PATCH_SIZE

    @property
    def max_tokens_per_axis(self) -> int:
        # The rotary tables are precomputed for axes_lens positions along (caption/frame, row, column).
        _, rows, columns = self.pipeline.transformer.config.axes_lens
        return int(min(rows, columns))

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        channels = self.pipeline.transformer.config.in_channels
        return (channels, height // self._vae_factor, width // self._vae_factor)

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        config = scheduler.config
        tokens = (height // self.spatial_multiple) * (width // self.spatial_multiple)
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(num_steps), mu=mu, device="cpu")

    # -- model calls -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """The encoder's second-to-last hidden states at each prompt's real tokens, left-aligned."""
        if not prompts or any(TOKENIZER_SLOT not in p.token_ids for p in prompts):
            raise ValueError("Z-Image needs token ids for `tokenizer` (use the family's TextProcessor)")
        tokenizer = self.pipeline.tokenizer
        ids, mask = padded_ids(prompts, self.max_sequence_length, tokenizer.pad_token_id,
                               left=tokenizer.padding_side == "left")
        ids, mask = ids.to(self.device), mask.to(self.device).bool()
        encoded = self.pipeline.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden = encoded.hidden_states[-2]
        embeds = stack_padded([states[real] for states, real in zip(hidden, mask)])
        lengths = mask.sum(dim=1, keepdim=True)
        kept = torch.arange(embeds.shape[1], device=embeds.device) < lengths
        return PromptEmbeds(embeds.to(self.dtype), kept)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's time of sigmas, as the stock loop computes it from the scheduler's timestep
        (1000 sigma in float32): (1000 - t) / 1000."""
        t = sigma.to(torch.float32) * self.pipeline.scheduler.config.num_train_timesteps
        return (TIME_SCALE - t) / TIME_SCALE

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        """d x / d sigma: the transformer's output negated (it predicts along 1 - sigma)."""
        # One [C, 1, h, w] single-frame image and one caption of its own length per sample, as the stock passes.
        images = list(latents.to(self.dtype).unsqueeze(2).unbind(0))
        embeds = cond.embeds.to(self.dtype)
        captions = [embeds[row, :n] for row, n in enumerate(cond.mask.sum(dim=1).tolist())]
        out = self.pipeline.transformer(images, self.timestep(sigma.to(latents.device)), captions, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor,
                            return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        """The stock call from our initial latents (its own layout), its guidance_scale our w - 1."""
        cfg = params.guidance_scale > 1
        return self.pipeline(
            prompt=prompt, negative_prompt=params.negative_prompt if cfg else None,
            guidance_scale=params.guidance_scale - 1 if cfg else 0.0, cfg_normalization=False, cfg_truncation=1.0,
            height=params.height, width=params.width, num_inference_steps=params.num_steps,
            max_sequence_length=self.max_sequence_length, latents=latents.clone(), num_images_per_prompt=len(latents),
            output_type="pt",
        ).images
