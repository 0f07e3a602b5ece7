"""Randomly initialised, architecturally faithful miniatures of Qwen-Image.

The pipeline is the stock ``diffusers.QwenImagePipeline``; only the widths and depths are
shrunk. The tokenizer is the real Qwen2 BPE (see :mod:`serve_app.models.tokenizer`), so
the text encoder's embedding table keeps Qwen2.5-VL's 152064 rows and the text width
(== the transformer's ``joint_attention_dim``) is what keeps it small.

Image sizes: the pipeline floors height/width to a multiple of ``2 * vae_scale_factor``
(latents are packed into 2x2 patches) and only warns otherwise. ``vae_scale_factor`` is
``2 ** len(temperal_downsample)``:

* ``tiny``  - VAE downsamples by 4, so sizes must be multiples of 8; smallest is 8x8
  (a single image token). 32x32 gives 16 image tokens.
* ``small`` - VAE downsamples by 8 like the real model, so sizes must be multiples of 16;
  smallest is 16x16. 64x64 gives 16 image tokens.
* ``full`` - Qwen-Image's released transformer and VAE dimensions (a ~20B-parameter transformer)
  with a two-layer stand-in of the 3584-wide Qwen2.5-VL-7B text encoder: for GPU benchmarks
  (benchmarks/gpu_rollout.py), built in memory with :func:`qwen_image_pipeline`, never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from .tiny_parts import qwen2_tokenizer, save_pipeline, seeded_components
from .tokenizer import QWEN2_EOS_ID, QWEN2_PAD_ID
from .tokenizer_cache import load_tokenizer

__all__ = [
    "QWEN_IMAGE_SCHEDULER_CONFIG", "QwenImageSize", "build_tiny_qwen_image", "min_image_size", "qwen25vl_text_encoder",
    "qwen_image_pipeline", "qwen_image_transformer",
]

QwenImageSize = Literal["tiny", "small", "full"]

# scheduler_config.json of Qwen/Qwen-Image: resolution-dependent exponential time shift
# with a terminal sigma of 0.02 instead of 0.
QWEN_IMAGE_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "invert_sigmas": False,
    "shift_terminal": 0.02,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}

# Qwen2.5-VL's embedding rows (padded past the 151665 tokenizer ids, as in the real model).
_TEXT_VOCAB_SIZE = 152064


@dataclass(frozen=True)
class _Spec:
    layers: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int]  # (frame, height, width); must sum to head_dim
    text_dim: int  # Qwen2.5-VL hidden size == transformer joint_attention_dim
    text_layers: int
    text_heads: int
    text_mrope: tuple[int, int, int]  # must sum to text head_dim / 2
    z_dim: int
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    vae_res_blocks: int = 1
    # The released VAE's latent statistics (its constructor's defaults); False: identity normalisation,
    # since random latents have no statistics worth matching.
    vae_released_statistics: bool = False


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(
        layers=2,
        heads=2,
        head_dim=16,
        rope_axes=(4, 6, 6),
        text_dim=16,
        text_layers=2,
        text_heads=2,
        text_mrope=(1, 1, 2),
        z_dim=4,
        vae_base_dim=8,
        vae_dim_mult=(1, 2, 4),
    ),
    "small": _Spec(
        layers=4,
        heads=4,
        head_dim=64,
        rope_axes=(16, 24, 24),
        text_dim=32,
        text_layers=2,
        text_heads=2,
        text_mrope=(2, 3, 3),
        z_dim=16,
        vae_base_dim=16,
        vae_dim_mult=(1, 2, 4, 4),
    ),
    # Qwen/Qwen-Image: the transformer and VAE as released (diffusers' constructor defaults); the text
    # encoder has Qwen2.5-VL-7B's width, heads and mrope sections but 2 of its 28 layers.
    "full": _Spec(layers=60, heads=24, head_dim=128, rope_axes=(16, 56, 56), text_dim=3584, text_layers=2, text_heads=28,
                  text_mrope=(16, 24, 24), z_dim=16, vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4), vae_res_blocks=2,
                  vae_released_statistics=True),
}


def min_image_size(size: QwenImageSize) -> int:
    """Smallest valid height/width in pixels (also the step between valid sizes)."""
    return 2 * 2 ** (len(_SPECS[size].vae_dim_mult) - 1)


def qwen_image_transformer(
    *, z_dim: int, layers: int, heads: int, head_dim: int, text_dim: int, rope_axes: tuple[int, int, int]
) -> QwenImageTransformer2DModel:
    """A QwenImageTransformer2DModel over 2x2-packed latents of ``z_dim`` channels."""
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=z_dim * 4,  # 2x2 packed latent patches
        out_channels=z_dim,
        num_layers=layers,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=text_dim,
        guidance_embeds=False,
        axes_dims_rope=rope_axes,
    )


def _transformer(spec: _Spec) -> QwenImageTransformer2DModel:
    return qwen_image_transformer(z_dim=spec.z_dim, layers=spec.layers, heads=spec.heads, head_dim=spec.head_dim,
                                  text_dim=spec.text_dim, rope_axes=spec.rope_axes)


def _vae(spec: _Spec) -> AutoencoderKLQwenImage:
    downsamples = len(spec.vae_dim_mult) - 1
    statistics = {} if spec.vae_released_statistics else {"latents_mean": [0.0] * spec.z_dim,
                                                          "latents_std": [1.0] * spec.z_dim}
    return AutoencoderKLQwenImage(
        base_dim=spec.vae_base_dim,
        z_dim=spec.z_dim,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=spec.vae_res_blocks,
        attn_scales=[],
        # Same pattern as the real VAE: no temporal downsampling in the first stage.
        temperal_downsample=[i > 0 for i in range(downsamples)],
        dropout=0.0,
        **statistics,
    )


def qwen25vl_text_encoder(
    *,
    vocab_size: int,
    hidden_size: int,
    layers: int,
    heads: int,
    mrope_section: tuple[int, int, int],
    pad_id: int,
    eos_id: int,
    bos_id: int,
    max_positions: int = 2048,
    rope_theta: float = 1_000_000.0,
    vision_patch_size: int = 14,
    vision_token_ids: dict[str, int] | None = None,
) -> Qwen2_5_VLForConditionalGeneration:
    """A small Qwen2.5-VL text model (QwenImagePipeline's text encoder class), with a minimal vision tower
    over `vision_patch_size` px patches (the edit pipelines run it; 14 as released). `vision_token_ids`:
    the ids of a vocabulary other than Qwen2's (``image_token_id``, ``vision_start_token_id``, ...)."""
    head_dim = hidden_size // heads
    if 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"mrope sections {mrope_section} do not cover head_dim {head_dim}")
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": max_positions,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": list(mrope_section)},
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
        },
        # QwenImagePipeline never runs the vision tower, but the class requires one; the edit pipelines run it.
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden_size,
            "fullatt_block_indexes": [0],
            "patch_size": vision_patch_size,
        },
        # Sharing the embedding table with lm_head halves the checkpoint.
        tie_word_embeddings=True,
        **(vision_token_ids or {}),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _text_encoder(spec: _Spec) -> Qwen2_5_VLForConditionalGeneration:
    # bos is <|endoftext|> as in Qwen2.5-VL's config.json (the tokenizer never emits one).
    return qwen25vl_text_encoder(
        vocab_size=_TEXT_VOCAB_SIZE, hidden_size=spec.text_dim, layers=spec.text_layers, heads=spec.text_heads,
        mrope_section=spec.text_mrope, pad_id=QWEN2_PAD_ID, eos_id=QWEN2_EOS_ID, bos_id=QWEN2_PAD_ID,
    )


def qwen_image_pipeline(
    size: QwenImageSize, *, tokenizer: Any, seed: int = 0, dtype: torch.dtype = torch.float32
) -> QwenImagePipeline:
    """A random-weight ``QwenImagePipeline`` of `size` in `dtype`, in memory, on the current default
    device; bit-reproducible for a given `seed` (:func:`seeded_components`)."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    if len(tokenizer) > _TEXT_VOCAB_SIZE:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} ids, more than the {_TEXT_VOCAB_SIZE} rows of the text encoder's embedding"
        )
    components = seeded_components(
        [(name, lambda make=make: make(spec), seed) for name, make in
         (("transformer", _transformer), ("vae", _vae), ("text_encoder", _text_encoder))], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    return QwenImagePipeline(scheduler=scheduler, tokenizer=tokenizer, **components)


def build_tiny_qwen_image(
    out_dir: Path,
    *,
    size: QwenImageSize = "tiny",
    seed: int = 0,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Builds a random-weight ``QwenImagePipeline`` on the CPU and saves it (float32 safetensors) to ``out_dir``.

    Bit-reproducible for a given ``seed`` (:func:`qwen_image_pipeline`). ``tokenizer_dir`` is a
    directory written by :func:`build_qwen2_tokenizer`; without it one is built (~3 s).
    """
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizer = load_tokenizer(tokenizer_dir)
        with torch.device("cpu"):
            pipe = qwen_image_pipeline(size, tokenizer=tokenizer, seed=seed)
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=["tokenizer"])
