"""A randomly initialised miniature CLIP (``CLIPModel`` + ``CLIPProcessor``) built offline.

It exists so that the CLIP-based rewards (serve_app/rewards/clip_score.py) are tested through
the same ``from_pretrained(dir, local_files_only=True)`` path a real checkpoint takes. Its
weights are random: scores test plumbing, never quality.

The tokenizer is the stock ``CLIPTokenizer`` class (byte-level BPE, lower-casing, ``</w>``
word ends, ``<|startoftext|>``/``<|endoftext|>`` around the text) over a vocabulary of the 256
byte symbols, each alone and as a word end, and no merges: every word becomes one token per
byte. Real CLIP has 49408 tokens; the pooling rule (the first ``<|endoftext|>``) is the same.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["TINY_CLIP_NAME", "build_tiny_clip", "ensure_tiny_clip"]

TINY_CLIP_NAME = "tiny-clip"

_IMAGE_SIZE = 32
_MAX_TEXT_LENGTH = 77  # CLIP's context length, so long prompts truncate as with the real model
_WIDTH = 32
_PROJECTION = 16
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"


def _vocab() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + [_BOS, _EOS]
    return {t: i for i, t in enumerate(tokens)}


def build_tiny_clip(out_dir: Path, *, seed: int = 0) -> Path:
    """Builds the tiny CLIP into ``out_dir`` (float32 safetensors, processor files); ~1 MB.

    Bit-reproducible for a given ``seed``: the weights are drawn on CPU right after
    ``torch.manual_seed(seed)``.
    """
    import torch
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    vocab = _vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=_MAX_TEXT_LENGTH)
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": _IMAGE_SIZE},
        crop_size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE},
    )
    config = CLIPConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": _WIDTH,
            "intermediate_size": 2 * _WIDTH,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": _MAX_TEXT_LENGTH,
            # Pooling reads the first eos id; the pad token is the eos token, as in real CLIP.
            "bos_token_id": vocab[_BOS],
            "eos_token_id": vocab[_EOS],
            "pad_token_id": vocab[_EOS],
        },
        vision_config={
            "hidden_size": _WIDTH,
            "intermediate_size": 2 * _WIDTH,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": _IMAGE_SIZE,
            "patch_size": 8,
        },
        projection_dim=_PROJECTION,
    )
    with torch.device("cpu"):
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(str(out_dir))
    return out_dir


def ensure_tiny_clip() -> Path:
    """``flowgrpo_home()/models/tiny-clip-<BUILD_VERSION>``, built on first use (~1 s)."""
    from .registry import BUILD_VERSION, _build_once, flowgrpo_home

    target = flowgrpo_home() / "models" / f"{TINY_CLIP_NAME}-{BUILD_VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    return _build_once(target, lambda tmp: build_tiny_clip(tmp, seed=0))
