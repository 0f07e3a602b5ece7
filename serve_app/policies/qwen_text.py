"""The text side of the Qwen2.5-VL families (Qwen-Image, -Edit, -Edit-2509): chat templates and tokenization.
Free of diffusers, so the ingress loads it without the pipelines' modules (serve_app.families: text_processor)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serve_app.models.tokenizer_cache import load_tokenizer
from serve_app.policies.base import TextProcessor
from serve_app.schemas import PromptTokens

# The pipeline's own template: the encoder's hidden states of the first 34 tokens (the system
# prompt and the user header) are dropped.
PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_PREFIX_TOKENS = 34
MAX_PROMPT_TOKENS = 1024

# QwenImageEditPipeline's template and the hidden states it drops (prompt_template_encode_start_idx).
# The header is the 64 dropped tokens (system prompt and user header), shared with Qwen-Image-Edit-Plus.
EDIT_TEMPLATE_HEADER = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
EDIT_TEMPLATE_TAIL = "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PROMPT_TEMPLATE = EDIT_TEMPLATE_HEADER + "<|vision_start|><|image_pad|><|vision_end|>" + EDIT_TEMPLATE_TAIL
EDIT_TEMPLATE_PREFIX_TOKENS = 64
IMAGE_PAD = "<|image_pad|>"

# QwenImageEditPlusPipeline's template is Qwen-Image-Edit's header (the 64 tokens dropped from the hidden
# states), then a picture per input image and the instruction in the user turn, then Qwen-Image-Edit's tail.
PICTURE_TEMPLATE = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"


class QwenTextProcessor(TextProcessor):
    """A Qwen2.5-VL family's text side, over the checkout's ``tokenizer`` folder."""

    @classmethod
    def load(cls, local_dir: str | Path) -> QwenTextProcessor:
        return cls({"tokenizer": load_tokenizer(Path(local_dir) / "tokenizer")})


class QwenImageTextProcessor(QwenTextProcessor):
    def format(self, prompt: str) -> str:
        return PROMPT_TEMPLATE.format(prompt)

    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]:
        tokenizer = self._tokenizer("tokenizer")
        encoded = tokenizer(
            [self.format(p) for p in prompts],
            max_length=MAX_PROMPT_TOKENS + TEMPLATE_PREFIX_TOKENS,
            truncation=True,
            padding=False,
        )
        return [
            PromptTokens(text=p, token_ids={"tokenizer": torch.tensor(ids, dtype=torch.long)})
            for p, ids in zip(prompts, encoded["input_ids"])
        ]


class QwenImageEditTextProcessor(QwenTextProcessor):
    """Template + token ids with one ``<|image_pad|>`` per input image; the replica expands each into the
    image's vision tokens once it has the image's patch grid (:meth:`QwenImageEditPolicy.encode_prompts`)."""

    def format(self, prompt: str) -> str:
        return EDIT_PROMPT_TEMPLATE.format(prompt)

    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]:
        # The stock pipeline truncates nothing here; the ingress bounds a prompt's characters.
        encoded = self._tokenizer("tokenizer")([self.format(p) for p in prompts], padding=False)
        return [PromptTokens(text=p, token_ids={"tokenizer": torch.tensor(ids, dtype=torch.long)})
                for p, ids in zip(prompts, encoded["input_ids"])]


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
