"""The text side of families with one tokenizer in the checkout's ``tokenizer`` folder (Wan, LTX-2, Z-Image,
FLUX.2): each formats a prompt its own way; the tokenization, its length and the policy's wiring are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from serve_app.models.tokenizer_cache import load_tokenizer
from serve_app.policies.base import TextProcessor
from serve_app.schemas import PromptTokens

TOKENIZER_SLOT = "tokenizer"


class SingleTokenizerTextProcessor(TextProcessor):
    """Formatted prompts (:meth:`format`), truncated to ``max_sequence_length`` tokens and left unpadded: the
    policy pads them as its stock pipeline does."""

    family_name: ClassVar[str]  # as errors name the family
    default_max_length: ClassVar[int]  # the stock `__call__`'s max_sequence_length
    add_special_tokens: ClassVar[bool] = True  # as the stock pipeline tokenizes the formatted text

    @staticmethod
    def unwrap(tokenizer: Any) -> Any:
        """The tokenizer proper of what the checkout's slot holds (a processor may wrap one)."""
        return tokenizer

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        if tokenizers.get(TOKENIZER_SLOT) is None:
            raise ValueError(f"{self.family_name} needs its tokenizer (the checkout's `{TOKENIZER_SLOT}` folder)")
        super().__init__(tokenizers)
        self.max_sequence_length = self.length_of(tokenizers[TOKENIZER_SLOT])

    @classmethod
    def load(cls, local_dir: str | Path) -> SingleTokenizerTextProcessor:
        return cls({TOKENIZER_SLOT: load_tokenizer(Path(local_dir) / TOKENIZER_SLOT)})

    @classmethod
    def length_of(cls, tokenizer: Any) -> int:
        """Text positions the encoder sees: the stock default, capped by the tokenizer's own limit."""
        return min(cls.default_max_length, int(cls.unwrap(tokenizer).model_max_length))

    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]:
        encoded = self.unwrap(self._tokenizer(TOKENIZER_SLOT))(
            [self.format(p) for p in prompts], max_length=self.max_sequence_length, truncation=True, padding=False,
            add_special_tokens=self.add_special_tokens,
        )
        return [PromptTokens(text=p, token_ids={TOKENIZER_SLOT: torch.tensor(ids, dtype=torch.long)})
                for p, ids in zip(prompts, encoded["input_ids"])]


def padded_ids(prompts: Sequence[PromptTokens], length: int, pad_id: int, *, left: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's token ids padded to `length` with `pad_id` ([P, length] long) and their attention mask (1 on the
    ids, long): what a tokenizer call with padding="max_length" gives, on the left with `left`. Prompts tokenized
    by a SingleTokenizerTextProcessor are no longer than that."""
    ids = torch.full((len(prompts), length), int(pad_id), dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens = prompt.token_ids[TOKENIZER_SLOT][:length]
        start = length - len(tokens) if left else 0
        ids[row, start:start + len(tokens)] = tokens
        mask[row, start:start + len(tokens)] = 1
    return ids, mask


class SingleTokenizer:
    """The policy side: the pipeline's ``tokenizer`` under its ``text_processor_class``."""

    text_processor_class: ClassVar[type[SingleTokenizerTextProcessor]]
    pipeline: Any

    def _make_text_processor(self) -> SingleTokenizerTextProcessor:
        return self.text_processor_class({TOKENIZER_SLOT: self.pipeline.tokenizer})

    @property
    def max_sequence_length(self) -> int:
        """Text positions per prompt (pass it as the stock pipeline's `max_sequence_length` to match)."""
        return self.text_processor_class.length_of(self.pipeline.tokenizer)


# -- the families' text sides ------------------------------------------------------------------


class WanTextProcessor(SingleTokenizerTextProcessor):
    """Cleaned prompts (ftfy when installed, HTML unescaping, whitespace), as the stock ``prompt_clean``."""

    family_name = "Wan"
    default_max_length = 512  # the stock `__call__`'s max_sequence_length

    def format(self, prompt: str) -> str:
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # on first use: the module pulls diffusers

        return prompt_clean(prompt)


class LTX2TextProcessor(SingleTokenizerTextProcessor):
    """Stripped prompts; the policy pads them on the left, as the stock pipeline does."""

    family_name = "LTX-2"
    default_max_length = 1024  # the stock `__call__`'s max_sequence_length

    def format(self, prompt: str) -> str:
        return prompt.strip()


class ZImageTextProcessor(SingleTokenizerTextProcessor):
    """The chat-templated prompt; the policy pads it to ``max_sequence_length``, as the stock tokenizer call does."""

    family_name = "Z-Image"
    default_max_length = 512  # the stock `__call__`'s max_sequence_length

    def format(self, prompt: str) -> str:
        return self._tokenizer(TOKENIZER_SLOT).apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=True,
        )


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer proper: a released FLUX.2 [dev] checkout's "tokenizer" is a PixtralProcessor holding one."""
    return getattr(tokenizer, "tokenizer", tokenizer)


class Flux2TextProcessor(SingleTokenizerTextProcessor):
    """FLUX.2 [dev]'s chat text, truncated to ``max_sequence_length`` tokens; unpadded (the policy pads it as the
    stock tokenizer call's padding="max_length" does)."""

    family_name = "FLUX.2"
    default_max_length = 512  # the stock `__call__`'s max_sequence_length
    # apply_chat_template tokenizes without special tokens (a processor too, its template writing the BOS itself).
    add_special_tokens: ClassVar[bool] = False

    unwrap = staticmethod(text_tokenizer)

    def format(self, prompt: str) -> str:
        # On first use: the pipeline's modules pull diffusers.
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

        (messages,) = format_input([prompt], system_message=SYSTEM_MESSAGE)
        return self._tokenizer(TOKENIZER_SLOT).apply_chat_template(messages, tokenize=False,
                                                                   add_generation_prompt=False)


class Flux2KleinTextProcessor(Flux2TextProcessor):
    """FLUX.2 [klein]'s chat text: one user turn, the answer opened with thinking off."""

    add_special_tokens: ClassVar[bool] = True  # the klein pipeline tokenizes the rendered text with the defaults

    def format(self, prompt: str) -> str:
        return self._tokenizer(TOKENIZER_SLOT).apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True, enable_thinking=False,
        )
