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

    @classmethod
    def load_text_processor(cls, local_dir: str | Path) -> SingleTokenizerTextProcessor:
        return cls.text_processor_class({TOKENIZER_SLOT: load_tokenizer(Path(local_dir) / TOKENIZER_SLOT)})

    @property
    def max_sequence_length(self) -> int:
        """Text positions per prompt (pass it as the stock pipeline's `max_sequence_length` to match)."""
        return self.text_processor_class.length_of(self.pipeline.tokenizer)
