"""The text side shared by the families that condition on CLIP tower(s) and T5 (SD3, Flux): one
tokenization per tokenizer slot, each padded in full and truncated as the stock pipelines feed their
encoders (CLIP to the first CLIP tokenizer's ``model_max_length``, T5 to the family's
``max_sequence_length`` capped by the T5 tokenizer's own limit), and the loading of those tokenizers
from a pipeline directory. Free of diffusers, so the ingress loads it without the pipelines' modules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar


from serve_app.policies.base import TextProcessor, rows_of
from serve_app.schemas import PromptTokens
from serve_app.models.tokenizer_cache import load_tokenizer

DEFAULT_CLIP_LENGTH = 77  # the stock pipelines' fallback when they have no CLIP tokenizer


class ClipT5TextProcessor(TextProcessor):
    """Tokenizations for the CLIP slots and the T5 slot of a family (set by the subclass)."""

    family: ClassVar[str]
    clip_slots: ClassVar[tuple[str, ...]]
    t5_slot: ClassVar[str]
    t5_required: ClassVar[bool]  # False: a pipeline may be saved without T5 (its embeddings are then zeros)
    t5_default_length: ClassVar[int]  # the stock pipeline's default `max_sequence_length`

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        required = [*self.clip_slots, *([self.t5_slot] if self.t5_required else [])]
        missing = [slot for slot in required if tokenizers.get(slot) is None]
        if missing:
            raise ValueError(f"{self.family} needs its CLIP{' and T5' if self.t5_required else ''} tokenizers; "
                             f"missing: {', '.join(missing)}")
        present = {slot: tok for slot, tok in tokenizers.items() if tok is not None}
        super().__init__(present)
        self.clip_length = self.clip_length_of(present)
        self.max_sequence_length = self.t5_length_of(present)

    @classmethod
    def slots(cls) -> tuple[str, ...]:
        return (*cls.clip_slots, cls.t5_slot)

    @classmethod
    def clip_length_of(cls, tokenizers: dict[str, Any]) -> int:
        """The stock pipeline's ``tokenizer_max_length``: the first CLIP tokenizer's limit, for every tower."""
        tokenizer = tokenizers.get(cls.clip_slots[0])
        return int(tokenizer.model_max_length) if tokenizer is not None else DEFAULT_CLIP_LENGTH

    @classmethod
    def t5_length_of(cls, tokenizers: dict[str, Any]) -> int:
        """T5 tokens per prompt: the stock default, capped by the T5 tokenizer's own limit."""
        tokenizer = tokenizers.get(cls.t5_slot)
        if tokenizer is None:
            return cls.t5_default_length
        return min(cls.t5_default_length, int(tokenizer.model_max_length))

    @classmethod
    def load(cls, local_dir: str | Path) -> ClipT5TextProcessor:
        """The tokenizers of a pipeline directory (offline); an optional T5 slot may be absent."""
        tokenizers: dict[str, Any] = {}
        for slot in cls.slots():
            folder = Path(local_dir) / slot
            if slot == cls.t5_slot and not cls.t5_required and not folder.is_dir():
                continue
            tokenizers[slot] = load_tokenizer(folder)
        return cls(tokenizers)

    def format(self, prompt: str) -> str:
        return prompt  # no prompt template

    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]:
        texts = [self.format(p) for p in prompts]
        lengths = {**{slot: self.clip_length for slot in self.clip_slots}, self.t5_slot: self.max_sequence_length}
        ids = {
            slot: self._tokenizer(slot)(
                texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt"
            ).input_ids
            for slot, length in lengths.items() if slot in self._tokenizers
        }
        return rows_of(prompts, ids)


class SD3TextProcessor(ClipT5TextProcessor):
    """Three tokenizations per prompt: CLIP-L, CLIP-G and (when the pipeline has it) T5."""

    family = "SD3"
    clip_slots = ("tokenizer", "tokenizer_2")
    t5_slot = "tokenizer_3"
    t5_required = False
    t5_default_length = 256


class FluxTextProcessor(ClipT5TextProcessor):
    """Two tokenizations per prompt: CLIP (pooled output only) and T5."""

    family = "Flux"
    clip_slots = ("tokenizer",)
    t5_slot = "tokenizer_2"
    t5_required = True
    t5_default_length = 512  # the stock `max_sequence_length` (and its upper limit)


class ClipT5Tokenizers:
    """The policy side: the pipeline's tokenizers in the slots its ``text_processor_class`` names."""

    text_processor_class: ClassVar[type[ClipT5TextProcessor]]
    pipeline: Any

    def _tokenizers(self) -> dict[str, Any]:
        return {slot: getattr(self.pipeline, slot, None) for slot in self.text_processor_class.slots()}

    def _make_text_processor(self) -> ClipT5TextProcessor:
        return self.text_processor_class(self._tokenizers())

    @property
    def max_sequence_length(self) -> int:
        """T5 tokens per prompt (pass it as the stock pipeline's `max_sequence_length` to match)."""
        return self.text_processor_class.t5_length_of(self._tokenizers())
