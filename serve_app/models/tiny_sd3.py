"""A randomly initialised miniature of Stable Diffusion 3 (MMDiT + 2x CLIP + T5).

No CLIP or T5 vocabulary can be fetched offline, so all three tokenizer slots hold the
Qwen2 BPE tokenizer (``model_max_length`` 77 for the CLIP slots, 32 for the T5 slot) and
every text encoder's embedding table covers its 151665 ids.

Differences from real CLIP/T5 worth knowing:

* The Qwen tokenizer adds no BOS/EOS. The CLIP encoders pool at the first
  ``<|endoftext|>`` (their ``eos_token_id``), which is the first padding position, i.e.
  just after the prompt. A prompt that fills all 77 positions pools at position 0.
* The pipeline pads T5 input to its ``max_sequence_length`` argument (default 256), not
  to ``tokenizer_3.model_max_length``; pass ``max_sequence_length=32`` to match the slot.

Image sizes: the pipeline requires height/width divisible by
``vae_scale_factor * patch_size`` = 4 * 2 = 8 and raises otherwise, so the smallest valid
size is 8x8; ``pos_embed_max_size`` caps it at 256x256.

Size ``full`` has Stable Diffusion 3.5 Medium's transformer and VAE dimensions (~2.5B parameters) and
two-layer CLIP-L / CLIP-G and one-layer T5 stand-ins of the real widths (768, 1280, 4096): for GPU
benchmarks (benchmarks/gpu_rollout.py), built in memory with :func:`sd3_pipeline`, never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection, T5EncoderModel

from .tiny_parts import clip_text_config, kl_vae, qwen2_tokenizer, save_pipeline, seeded_components, t5_encoder, tokenizer_slots

__all__ = ["SD3_MIN_IMAGE_SIZE", "SD3Size", "build_tiny_sd3", "sd3_pipeline"]

SD3_MIN_IMAGE_SIZE = 8

SD3Size = Literal["tiny", "full"]

_CLIP_MAX_LENGTH = 77
# SD3's latent normalisation constants.
_SCALING_FACTOR = 1.5305
_SHIFT_FACTOR = 0.0609


@dataclass(frozen=True)
class _Spec:
    layers: int
    heads: int
    head_dim: int
    latent_channels: int
    sample_size: int  # the default latent side (images when height/width are omitted)
    pos_embed_max_size: int
    clip_dims: tuple[int, int]  # CLIP-L, CLIP-G: hidden == projection width; pooled = their sum
    clip_heads: tuple[int, int]
    t5_dim: int  # == the transformer's joint_attention_dim; [clip_l | clip_g] is zero-padded up to it
    t5_length: int  # tokenizer_3's model_max_length
    vae_channels: tuple[int, ...]
    vae_layers_per_block: int = 1
    vae_norm_groups: int = 4
    vae_sample_size: int = 32
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(layers=2, heads=2, head_dim=16, latent_channels=4, sample_size=8, pos_embed_max_size=32,
                  clip_dims=(8, 8), clip_heads=(2, 2), t5_dim=16, t5_length=32, vae_channels=(8, 16, 16)),
    # stabilityai/stable-diffusion-3.5-medium: the transformer's config (MMDiT-X: dual attention in the
    # first 13 blocks, RMS qk-norm) and the SD3 VAE's (block widths, 2 layers per block, 32 norm groups,
    # sample size 1024: the released vae/config.json as recalled; diffusers ships no copy of it).
    "full": _Spec(layers=24, heads=24, head_dim=64, latent_channels=16, sample_size=128, pos_embed_max_size=384,
                  clip_dims=(768, 1280), clip_heads=(12, 20), t5_dim=4096, t5_length=256,
                  vae_channels=(128, 256, 512, 512), vae_layers_per_block=2, vae_norm_groups=32, vae_sample_size=1024,
                  dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
}


def _clip(dim: int, heads: int) -> CLIPTextModelWithProjection:
    # Two layers: the pipeline reads hidden_states[-2].
    config = clip_text_config(dim, layers=2, max_length=_CLIP_MAX_LENGTH, heads=heads, projection_dim=dim)
    return CLIPTextModelWithProjection(config).eval()


def _transformer(spec: _Spec) -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        sample_size=spec.sample_size, patch_size=2, in_channels=spec.latent_channels, out_channels=spec.latent_channels,
        num_layers=spec.layers, attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_dim, caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=sum(spec.clip_dims), pos_embed_max_size=spec.pos_embed_max_size,
        dual_attention_layers=spec.dual_attention_layers, qk_norm=spec.qk_norm,
    )


def _vae(spec: _Spec) -> AutoencoderKL:
    return kl_vae(spec.vae_channels, spec.latent_channels, scaling_factor=_SCALING_FACTOR, shift_factor=_SHIFT_FACTOR,
                  layers_per_block=spec.vae_layers_per_block, norm_num_groups=spec.vae_norm_groups,
                  sample_size=spec.vae_sample_size)


def _clip_l(spec: _Spec) -> CLIPTextModelWithProjection:
    return _clip(spec.clip_dims[0], spec.clip_heads[0])


def _clip_g(spec: _Spec) -> CLIPTextModelWithProjection:
    return _clip(spec.clip_dims[1], spec.clip_heads[1])


def _t5(spec: _Spec) -> T5EncoderModel:
    return t5_encoder(spec.t5_dim)


def sd3_pipeline(
    size: SD3Size, *, tokenizer_dir: Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> StableDiffusion3Pipeline:
    """A random-weight ``StableDiffusion3Pipeline`` of `size` in `dtype`, in memory, on the current default
    device; bit-reproducible for a given `seed` (:func:`seeded_components`; the two CLIP towers get distinct
    seeds, so they are not clones). ``tokenizer_dir`` is a :func:`build_qwen2_tokenizer` output; every
    slot holds that tokenizer."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizers = tokenizer_slots(
        tokenizer_dir, {"tokenizer": _CLIP_MAX_LENGTH, "tokenizer_2": _CLIP_MAX_LENGTH, "tokenizer_3": spec.t5_length}
    )
    makers = (("transformer", _transformer, seed), ("vae", _vae, seed), ("text_encoder", _clip_l, seed),
              ("text_encoder_2", _clip_g, seed + 1), ("text_encoder_3", _t5, seed))
    components = seeded_components([(name, lambda make=make: make(spec), s) for name, make, s in makers], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return StableDiffusion3Pipeline(scheduler=scheduler, **components, **tokenizers)


def build_tiny_sd3(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds the tiny random-weight ``StableDiffusion3Pipeline`` on the CPU and saves it (float32
    safetensors); bit-reproducible (:func:`sd3_pipeline`). ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s).
    """
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        with torch.device("cpu"):
            pipe = sd3_pipeline("tiny", tokenizer_dir=tokenizer_dir, seed=seed)
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=("tokenizer", "tokenizer_2", "tokenizer_3"))
