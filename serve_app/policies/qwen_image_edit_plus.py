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
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

from serve_app.media import to_pil
from serve_app.models.tokenizer_cache import load_tokenizer
from serve_app.policies.base import stock_globals
from serve_app.policies.qwen_image_edit import (
    EDIT_TEMPLATE_HEADER,
    EDIT_TEMPLATE_PREFIX_TOKENS,
    EDIT_TEMPLATE_TAIL,
    QwenImageEditPolicy,
    QwenImageEditTextProcessor,
)
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptTokens

# QwenImageEditPlusPipeline's template is Qwen-Image-Edit's header (the 64 tokens dropped from the hidden
# states), then a picture per input image and the instruction in the user turn, then Qwen-Image-Edit's tail.
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
# The stock pipeline's areas (CONDITION_IMAGE_SIZE, VAE_IMAGE_SIZE).
STOCK_CONDITION_IMAGE_AREA = 384 * 384
STOCK_VAE_IMAGE_AREA = 1024 * 1024


class QwenImageEditPlusTextProcessor(QwenImageEditTextProcessor):
    """The template's 64-token header and the instruction's tail, tokenized apart; the pictures go between
    them on the replica (:meth:`QwenImageEditPlusPolicy._template_ids`, with :meth:`picture_ids`)."""

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        super().__init__(tokenizers)
        self._picture_ids: dict[int, torch.Tensor] = {}  # image count -> ids

    def format(self, prompt: str) -> str:
        return EDIT_TEMPLATE_HEADER + EDIT_TEMPLATE_TAIL.format(prompt)

    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]:
        tokenizer = self._tokenizer("tokenizer")
        header, *tails = tokenizer([EDIT_TEMPLATE_HEADER, *(EDIT_TEMPLATE_TAIL.format(p) for p in prompts)],
                                   padding=False)["input_ids"]
        if len(header) != EDIT_TEMPLATE_PREFIX_TOKENS:
            raise ValueError(f"the Qwen-Image-Edit-Plus template header is {len(header)} tokens with this tokenizer; "
                             f"the pipeline drops {EDIT_TEMPLATE_PREFIX_TOKENS}")
        return [PromptTokens(text=p, token_ids={"tokenizer": torch.tensor(header + tail, dtype=torch.long)})
                for p, tail in zip(prompts, tails)]

    def picture_ids(self, count: int) -> torch.Tensor:
        """Token ids of ``Picture 1: ...`` to ``Picture count: ...``, as the replica inserts them (kept per count)."""
        with self._lock:
            if count not in self._picture_ids:
                text = "".join(PICTURE_TEMPLATE.format(k + 1) for k in range(count))
                ids = self._tokenizer("tokenizer")(text, padding=False)["input_ids"]
                self._picture_ids[count] = torch.tensor(ids, dtype=torch.long)
            return self._picture_ids[count]


class QwenImageEditPlusPolicy(QwenImageEditPolicy):
    family = "qwen_image_edit_plus"
    pipeline_class = QwenImageEditPlusPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 3)
    input_image_area: int = STOCK_VAE_IMAGE_AREA
    condition_image_area: int = STOCK_CONDITION_IMAGE_AREA

    def _make_text_processor(self) -> QwenImageEditPlusTextProcessor:
        return QwenImageEditPlusTextProcessor({"tokenizer": self.pipeline.tokenizer})

    @classmethod
    def load_text_processor(cls, local_dir: str | Path) -> QwenImageEditPlusTextProcessor:
        return QwenImageEditPlusTextProcessor({"tokenizer": load_tokenizer(Path(local_dir) / "tokenizer")})

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
