"""A randomly initialised miniature of Flux.1-dev (``FluxPipeline``: CLIP + T5, FluxTransformer2DModel
with guidance embedding, a 2-D VAE, Flux's dynamically shifted flow-matching schedule).

As for tiny SD3, no CLIP or T5 vocabulary can be fetched offline: both tokenizer slots hold the
Qwen2 BPE tokenizer (``model_max_length`` 77 for CLIP, 32 for T5) and both encoders' embedding
tables cover its 151665 ids. CLIP pools at its ``eos_token_id`` (set to the pad id), i.e. the first
padding position after the prompt.

Geometry: VAE factor 4 (three levels) x 2x2 packing -> height and width multiples of 8; latents are
packed to [(H/8)(W/8), 4 x 4] tokens, as the stock pipeline packs 16-channel latents to 64.
The transformer has ``guidance_embeds=True`` (a guidance-distilled "dev" model): the pipeline's
``guidance_scale`` is an input of the model, true CFG is its ``true_cfg_scale``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline, FluxTransformer2DModel
from transformers import CLIPTextModel

from .tiny_parts import clip_text_config, kl_vae, qwen2_tokenizer, save_pipeline, seeded_components, t5_encoder, tokenizer_slots

__all__ = ["FLUX_MIN_IMAGE_SIZE", "build_tiny_flux"]

FLUX_MIN_IMAGE_SIZE = 8

_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 32
_CLIP_DIM = 8  # the pooled projection width
_T5_DIM = 16  # joint_attention_dim
_LATENT_CHANNELS = 4  # packed 2x2 -> transformer in_channels 16
_VAE_CHANNELS = (8, 16, 16)  # three levels -> vae_scale_factor 4


def _clip() -> CLIPTextModel:
    # One layer: Flux uses only the pooled output.
    return CLIPTextModel(clip_text_config(_CLIP_DIM, layers=1, max_length=_CLIP_MAX_LENGTH)).eval()


def _transformer() -> FluxTransformer2DModel:
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * _LATENT_CHANNELS,
        num_layers=1,  # one double-stream (MMDiT) block ...
        num_single_layers=1,  # ... and one single-stream block, as the real model has both kinds
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=_T5_DIM,
        pooled_projection_dim=_CLIP_DIM,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    )


def _vae() -> AutoencoderKL:
    # Flux.1's latent normalisation constants.
    return kl_vae(_VAE_CHANNELS, _LATENT_CHANNELS, scaling_factor=0.3611, shift_factor=0.1159)


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    # Flux.1-dev's scheduler config: the shift grows with the image's token count (mu, set per call).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build_tiny_flux(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None, kontext: bool = False) -> Path:
    """Builds a random-weight ``FluxPipeline`` (with `kontext`, the same parts as a ``FluxKontextPipeline``:
    FLUX.1 Kontext has Flux.1-dev's architecture) and saves it (float32 safetensors), bit-reproducibly:
    each component is created right after ``torch.manual_seed``. ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizers = tokenizer_slots(tokenizer_dir, {"tokenizer": _CLIP_MAX_LENGTH, "tokenizer_2": _T5_MAX_LENGTH})
        makers = (("transformer", _transformer, seed), ("vae", _vae, seed), ("text_encoder", _clip, seed),
                  ("text_encoder_2", lambda: t5_encoder(_T5_DIM), seed))
        with torch.device("cpu"):
            components = seeded_components(makers, torch.float32)
        pipe = (FluxKontextPipeline if kontext else FluxPipeline)(scheduler=_scheduler(), **components, **tokenizers)
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=tokenizers)
