"""The Qwen2-VL processor of the edit pipelines, for still images only.

``transformers.Qwen2VLProcessor`` also holds a video processor, which needs torchvision; the edit
pipelines never pass it a video. This subclass has the same call (chat text with ``<|image_pad|>``
placeholders + images -> input ids, pixel values, image grids) without the video half, so a Qwen-Image-Edit
checkout loads on an install without torchvision.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

__all__ = ["RELEASED_PROCESSOR_CLASS", "Qwen2VLImageOnlyProcessor"]

# How a released Qwen-Image-Edit checkout's model_index.json names its processor; ours are saved the same way.
RELEASED_PROCESSOR_CLASS = ["transformers", "Qwen2VLProcessor"]


class Qwen2VLImageOnlyProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` with an image processor and a tokenizer only (no video processor)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        # Qwen2VLProcessor.__init__ would check a video processor's class; ProcessorMixin takes the two parts.
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)
