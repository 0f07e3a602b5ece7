"""Parts the tiny checkpoints share: the seeded build of a component, the scratch Qwen2 tokenizer and the
save of a built pipeline; and, for SD3 and Flux, CLIP and T5 text encoders over the Qwen2 vocabulary, a
small 2-D KL VAE, and the tokenizer slots (every slot holds the Qwen2 BPE tokenizer).

Each part is built from its config alone, right after seeding torch (:func:`seeded`), so a build is
bit-reproducible whatever was built before it.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from diffusers import AutoencoderKL
from transformers import AutoTokenizer, CLIPTextConfig, T5Config, T5EncoderModel

from .tokenizer import QWEN2_PAD_ID, QWEN2_VOCAB_SIZE, build_qwen2_tokenizer, place_tokenizer_json

T = TypeVar("T")


def seeded(seed: int, build: Callable[[], T]) -> T:
    """``build()`` on the CPU right after ``torch.manual_seed(seed)``."""
    with torch.device("cpu"):
        torch.manual_seed(seed)
        return build()


@contextlib.contextmanager
def qwen2_tokenizer(tokenizer_dir: Path | None) -> Iterator[Path]:
    """`tokenizer_dir` (a :func:`build_qwen2_tokenizer` output), or one built into a scratch folder that
    lasts as long as the block (~3 s)."""
    if tokenizer_dir is not None:
        yield Path(tokenizer_dir)
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield build_qwen2_tokenizer(Path(scratch) / "tokenizer")


def save_pipeline(pipe: Any, out_dir: Path, *, tokenizer_dir: Path, slots: Iterable[str]) -> Path:
    """Save a built pipeline (float32 safetensors) and put the tokenizer's fast-tokenizer file in each slot."""
    out_dir = Path(out_dir)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    for slot in slots:
        place_tokenizer_json(tokenizer_dir, out_dir / slot)
    return out_dir


def clip_text_config(dim: int, *, layers: int, max_length: int, **extra: Any) -> CLIPTextConfig:
    """A CLIP text config over the Qwen2 ids. The Qwen tokenizer adds no BOS/EOS, so CLIP pools at
    its `eos_token_id`, the pad id: the first padding position, just after the prompt."""
    return CLIPTextConfig(
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=max_length, hidden_act="gelu",
        pad_token_id=QWEN2_PAD_ID, bos_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_PAD_ID, **extra,
    )


def t5_encoder(dim: int) -> T5EncoderModel:
    """One gated-GELU T5 encoder layer of width `dim` over the Qwen2 ids."""
    config = T5Config(
        vocab_size=QWEN2_VOCAB_SIZE, d_model=dim, d_kv=8, d_ff=2 * dim, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_PAD_ID,
    )
    return T5EncoderModel(config).eval()


def kl_vae(channels: tuple[int, ...], latent_channels: int, *, scaling_factor: float, shift_factor: float) -> AutoencoderKL:
    """A 2-D KL VAE with one block per level (len(channels) levels: factor 2^(levels-1)), carrying the
    real family's latent normalisation constants so the pipeline's latent code paths match."""
    levels = len(channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=channels, layers_per_block=1, latent_channels=latent_channels, norm_num_groups=4,
        sample_size=32, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def tokenizer_slots(tokenizer_dir: Path, lengths: Mapping[str, int]) -> dict[str, Any]:
    """slot -> the Qwen2 tokenizer with that slot's `model_max_length`. Loading the 151k-token tokenizer
    takes about a second; the slots differ only in their length, so they are shallow copies sharing
    one backend."""
    base = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    slots = {}
    for slot, length in lengths.items():
        slots[slot] = copy.copy(base)
        slots[slot].model_max_length = length
    return slots
