"""LTX-2 image-to-video: LTX-2 text-to-video whose first latent frame is an input image's, given, not sampled.

Mirrors the stock ``LTX2ImageToVideoPipeline.__call__`` (diffusers 0.42):

* The input image (the request's one image per prompt) is re-compressed as one H.264 frame at the checkout's
  conditioning CRF (33 for Gemma 3 checkouts: the compression LTX-2 was trained against), then resized to the
  video's height x width and encoded by the VAE (the posterior's mode), normalised with latents_mean /
  latents_std. Those latents are the clip's first latent frame.
* Every step the transformer sees the first frame's tokens clean, at timestep 0, before the sampled frames' at
  the step's timestep (the stock conditioning mask); the audio at the step's timestep. Only the sampled frames
  and the audio move: the velocity the transformer gives the first frame is dropped, as the stock loop steps
  frames 1.. only. So a sample's latent holds the sampled video frames and the audio; the log-prob covers
  exactly those, and the first frame travels as conditioning (``PromptEmbeds.image_latents``), which decoding
  puts back in front.
* True CFG runs the negative prompt over the same first frame.

Everything else (text, schedule, audio, decoding) is the text-to-video adapter's (serve_app/policies/ltx2.py).
The first frame depends on the video's size, not its length: the ingress resizes the image to the video's size
(for the rewards that see it) and passes the image as sent, which the replica re-compresses and resizes as the
stock pipeline does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import PIL.Image
import torch
from diffusers import LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf

from serve_app.config.sampling import SamplingParams
from serve_app.media import to_pil
from serve_app.policies.base import ImageGeometry
from serve_app.policies.ltx2 import LTX2Policy
from serve_app.schemas import PromptEmbeds, PromptTokens


class LTX2ImageToVideoPolicy(LTX2Policy):
    family = "ltx2_i2v"
    pipeline_class = LTX2ImageToVideoPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    given_frames: ClassVar[int] = 1

    @property
    def geometry(self) -> ImageGeometry:
        return dataclasses.replace(super().geometry, input_image_joins="first_frame", condition_image_as_sent=True)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """Text, and each prompt's first latent frame at the size its image was resized to (the video's)."""
        for i, p in enumerate(prompts):
            self.geometry.check_input_image_count(len(p.images), f"prompts[{i}].images")
        text = super().encode_prompts(prompts)
        frames = [self.first_frame(p.condition_images[0], *p.images[0].shape[-2:]) for p in prompts]
        shapes = torch.tensor([[(1, *f.shape[-2:])] for f in frames], dtype=torch.long, device=self.device)
        tokens = torch.stack([self.pipeline._pack_latents(f)[0] for f in frames])
        return PromptEmbeds(text.embeds, text.mask, image_latents=tokens.to(self.dtype), image_shapes=shapes)

    def first_frame(self, image: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """uint8 [3, H, W] as sent -> the normalised latents [1, C, 1, h, w] of the clip's first frame, made as the
        stock pipeline makes them (CRF re-compression, resize, VAE mode)."""
        pipe = self.pipeline
        crf = resolve_default_image_crf(pipe.text_encoder)
        picture = to_pil(image)
        if crf:
            picture = PIL.Image.fromarray(apply_image_conditioning_crf(np.array(picture.convert("RGB")), crf))
        pixels = pipe.video_processor.preprocess(picture, height=height, width=width)
        latents = pipe.vae.encode(pixels.to(self.device, pipe.vae.dtype)[:, :, None]).latent_dist.mode()
        return pipe._normalize_latents(latents.to(torch.float32), pipe.vae.latents_mean, pipe.vae.latents_std)

    def given_tokens(self, cond: PromptEmbeds | None) -> torch.Tensor | None:
        if cond is None or cond.image_latents is None:
            raise ValueError(f"{self.family} conditions on a first frame; the prompt embeddings carry none")
        return cond.image_latents

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock call on `images` (one uint8 [3, H, W] as sent). Given latents, the stock pipeline takes their
        first frame as the image's and never encodes the image itself, so the first frame goes in as this policy
        encodes it (tests/policies/test_ltx2.py checks that encoding against the stock one)."""
        if len(images) != 1:
            raise ValueError(f"{self.family} takes exactly one input image; got {len(images)}")
        given = self.pipeline._pack_latents(self.first_frame(images[0], params.height, params.width))[0]
        return self._stock_frames(prompt, params, latents, given=given, image=to_pil(images[0]))

