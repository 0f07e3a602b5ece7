"""Qwen-Image-Edit-Plus (Qwen-Image-Edit-2509): Qwen-Image-Edit with one to three input images per prompt.

What the stock ``QwenImageEditPlusPipeline`` does differently from ``QwenImageEditPipeline``, and so what
this adapter adds to :class:`~serve_app.policies.qwen_image_edit.QwenImageEditPolicy`:

- Each input image is resized twice from the image as sent: to about 384 x 384 px for the Qwen2.5-VL
  encoder (``condition_image_area``) and to about 1024 x 1024 px for the VAE (``input_image_area``); the
  ingress makes both (:meth:`ImageGeometry.resize_condition_image`), so the prompt carries both.
- The template's user turn holds ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` for each image
  before the instruction. The ingress tokenizes the template without them (it tokenizes before it knows a
  prompt's images); the replica inserts the pictures' tokens after the 64-token prefix the pipeline drops.
  The ingress tokenizes that prefix and the instruction apart, as the pipeline's tokenizer splits them at
  ``<|vision_end|>``, so the ids equal the stock ones for any instruction.
- The transformer sees [noisy latents ; every image's latents], with ``img_shapes`` of one entry per image.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, cast

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

from serve_app.media import to_pil
from serve_app.policies.base import stock_globals
from serve_app.policies.qwen_image_edit import QwenImageEditPolicy
from serve_app.policies.qwen_text import EDIT_TEMPLATE_PREFIX_TOKENS, QwenImageEditPlusTextProcessor
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptTokens

# The stock pipeline's areas (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE).
STOCK_CONDITION_IMAGE_AREA = 384 * 384
STOCK_VAE_IMAGE_AREA = 1024 * 1024


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    family = "qwen_image_edit_plus"
    pipeline_class = QwenImageEditPlusPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 3)
    input_image_area: int = STOCK_VAE_IMAGE_AREA
    condition_image_area: int = STOCK_CONDITION_IMAGE_AREA

    def _make_text_processor(self) -> QwenImageEditPlusTextProcessor:
        return QwenImageEditPlusTextProcessor({"tokenizer": self.pipeline.tokenizer})

    def _vision_images(self, prompt: PromptTokens, index: int) -> list[torch.Tensor]:
        if len(prompt.condition_images) != len(prompt.images):
            raise ValueError(f"prompts[{index}] carries {len(prompt.condition_images)} encoder copies of its "
                             f"{len(prompt.images)} input images (the ingress makes one of each)")
        return prompt.condition_images

    def _template_ids(self, prompt: PromptTokens) -> torch.Tensor:
        ids = prompt.token_ids["tokenizer"].to(torch.long)
        at = EDIT_TEMPLATE_PREFIX_TOKENS
        processor = cast(QwenImageEditPlusTextProcessor, self.text_processor())
        return torch.cat([ids[:at], processor.picture_ids(len(prompt.images)), ids[at:]])

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock ``QwenImageEditPlusPipeline.__call__`` on `images` (uint8 [3, H, W] as sent: the pipeline
        resizes each twice). At areas other than the pipeline's, its two constants are replaced for the call."""
        self.geometry.check_input_image_count(len(images), "images")
        cfg = params.guidance_scale > 1
        areas = {"CONDITION_IMAGE_SIZE": self.condition_image_area, "VAE_IMAGE_SIZE": self.input_image_area}
        with stock_globals(pipeline_qwenimage_edit_plus, **areas):
            return self.pipeline(
                image=[to_pil(image) for image in images], prompt=prompt,
                negative_prompt=params.negative_prompt if cfg else None, true_cfg_scale=params.guidance_scale,
                height=params.height, width=params.width, num_inference_steps=params.num_steps,
                latents=latents.clone(), num_images_per_prompt=len(latents), output_type="pt",
            ).images
