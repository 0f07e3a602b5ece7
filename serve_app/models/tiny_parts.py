"""Parts the tiny checkpoints share: the seeded build of the components and the cast every in-memory
build applies to them (:func:`seeded_components`), the scratch Qwen2 tokenizer and the save of a built
pipeline; and, for SD3 and Flux, CLIP and T5 text encoders over the Qwen2 vocabulary, a small 2-D KL VAE,
and the tokenizer slots (every slot holds the Qwen2 BPE tokenizer).

Each part is built from its config alone; the builders seed torch right before calling one, so a
build is bit-reproducible.
"""

from __future__ import annotations

import contextlib
import copy
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, T5Config, T5EncoderModel

from .tokenizer import QWEN2_PAD_ID, QWEN2_VOCAB_SIZE, build_qwen2_tokenizer, place_tokenizer_json
from .tokenizer_cache import load_tokenizer


def clip_text_config(dim: int, *, layers: int, max_length: int, heads: int = 2, **extra: Any) -> CLIPTextConfig:
    """A CLIP text config over the Qwen2 ids. The Qwen tokenizer adds no BOS/EOS, so CLIP pools at
    its `eos_token_id`, the pad id: the first padding position, just after the prompt."""
    return CLIPTextConfig(
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, max_position_embeddings=max_length, hidden_act="gelu",
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


def kl_vae(channels: tuple[int, ...], latent_channels: int, *, scaling_factor: float, shift_factor: float,
           layers_per_block: int = 1, norm_num_groups: int = 4, sample_size: int = 32) -> AutoencoderKL:
    """A 2-D KL VAE of len(channels) levels (factor 2^(levels-1)), `layers_per_block` blocks each, carrying
    the real family's latent normalisation constants so the pipeline's latent code paths match."""
    levels = len(channels)
    return AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=channels, layers_per_block=layers_per_block, latent_channels=latent_channels,
        norm_num_groups=norm_num_groups, sample_size=sample_size, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=False, use_post_quant_conv=False,
    )


def tokenizer_slots(tokenizer_dir: Path, lengths: Mapping[str, int]) -> dict[str, Any]:
    """slot -> the Qwen2 tokenizer with that slot's `model_max_length`. Loading the 151k-token tokenizer
    takes about a second; the slots differ only in their length, so they are shallow copies sharing
    one backend."""
    base = load_tokenizer(tokenizer_dir)
    slots = {}
    for slot, length in lengths.items():
        slots[slot] = copy.copy(base)
        slots[slot].model_max_length = length
    return slots


Module = TypeVar("Module", bound=torch.nn.Module)


def cast_like_loaded(module: Module, dtype: torch.dtype) -> Module:
    """`module` with its floating-point parameters and buffers cast to `dtype` in place, except those
    of the submodules its class keeps in float32 (``_keep_in_fp32_modules``, matched against the parts
    of each dotted name): what diffusers' and transformers' ``from_pretrained(..., torch_dtype=dtype)``
    give, so a pipeline built in memory computes like one loaded from disk. float32 changes nothing."""
    if dtype == torch.float32:
        return module
    kept = set(getattr(module, "_keep_in_fp32_modules", None) or [])
    for name, sub in module.named_modules():
        if kept & set(name.split(".")):
            continue
        for param in sub.parameters(recurse=False):
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for key, buffer in list(sub.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                setattr(sub, key, buffer.to(dtype))
    return module


def seeded_components(makers: Sequence[tuple[str, Callable[[], torch.nn.Module], int]],
                      dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """name -> component for each (name, make, seed): made in float32 right after ``torch.manual_seed(seed)``,
    so a build is bit-reproducible, then cast to `dtype` (:func:`cast_like_loaded`) before the next is
    made, so a large build never holds more than one component in float32."""
    components = {}
    for name, make, seed in makers:
        torch.manual_seed(seed)
        components[name] = cast_like_loaded(make(), dtype)
    return components


@contextlib.contextmanager
def qwen2_tokenizer(tokenizer_dir: Path | None) -> Iterator[Path]:
    """`tokenizer_dir` (a :func:`build_qwen2_tokenizer` output), or one built into a scratch folder that
    lasts as long as the block (~3 s)."""
    if tokenizer_dir is not None:
        yield Path(tokenizer_dir)
        return
    with tempfile.TemporaryDirectory() as scratch:
        yield build_qwen2_tokenizer(Path(scratch) / "tokenizer")


def build_with_qwen2_tokenizer(make: Callable[[Any], Any], out_dir: Path, tokenizer_dir: Path | None) -> Path:
    """Save ``make(tokenizer)``, a pipeline built on the CPU over the Qwen2 tokenizer (:func:`qwen2_tokenizer`),
    which its one ``tokenizer`` slot then holds."""
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizer = load_tokenizer(tokenizer_dir)
        with torch.device("cpu"):
            pipe = make(tokenizer)
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=["tokenizer"])


def save_pipeline(pipe: Any, out_dir: Path, *, tokenizer_dir: Path, slots: Iterable[str]) -> Path:
    """Save a built pipeline (float32 safetensors) and put the tokenizer's fast-tokenizer file in each slot."""
    out_dir = Path(out_dir)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    for slot in slots:
        place_tokenizer_json(tokenizer_dir, out_dir / slot)
    return out_dir
