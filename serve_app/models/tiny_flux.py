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

import copy
import tempfile
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from .tokenizer import QWEN2_PAD_ID, QWEN2_VOCAB_SIZE, build_qwen2_tokenizer, place_tokenizer_json

__all__ = ["FLUX_MIN_IMAGE_SIZE", "build_tiny_flux"]

FLUX_MIN_IMAGE_SIZE = 8

_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 32
_CLIP_DIM = 8  # the pooled projection width
_T5_DIM = 16  # joint_attention_dim
_LATENT_CHANNELS = 4  # packed 2x2 -> transformer in_channels 16
_VAE_CHANNELS = (8, 16, 16)  # three levels -> vae_scale_factor 4


def _clip() -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=QWEN2_VOCAB_SIZE,
        hidden_size=_CLIP_DIM,
        intermediate_size=2 * _CLIP_DIM,
        num_hidden_layers=1,  # Flux uses only the pooled output
        num_attention_heads=2,
        max_position_embeddings=_CLIP_MAX_LENGTH,
        hidden_act="gelu",
        pad_token_id=QWEN2_PAD_ID,
        bos_token_id=QWEN2_PAD_ID,
        eos_token_id=QWEN2_PAD_ID,
    )
    return CLIPTextModel(config).eval()


def _t5() -> T5EncoderModel:
    config = T5Config(
        vocab_size=QWEN2_VOCAB_SIZE,
        d_model=_T5_DIM,
        d_kv=8,
        d_ff=2 * _T5_DIM,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=QWEN2_PAD_ID,
        eos_token_id=QWEN2_PAD_ID,
    )
    return T5EncoderModel(config).eval()


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
    levels = len(_VAE_CHANNELS)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=_VAE_CHANNELS,
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        sample_size=32,
        # Flux.1's latent normalisation constants.
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


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


def build_tiny_flux(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds a random-weight ``FluxPipeline`` and saves it (float32 safetensors), bit-reproducibly:
    each component is created right after ``torch.manual_seed``. ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        if tokenizer_dir is None:
            tokenizer_dir = build_qwen2_tokenizer(Path(scratch) / "tokenizer")
        base = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        tokenizers = {}
        for slot, length in (("tokenizer", _CLIP_MAX_LENGTH), ("tokenizer_2", _T5_MAX_LENGTH)):
            tokenizers[slot] = copy.copy(base)  # shallow: the slots share one Rust backend
            tokenizers[slot].model_max_length = length
        with torch.device("cpu"):
            torch.manual_seed(seed)
            transformer = _transformer()
            torch.manual_seed(seed)
            vae = _vae()
            torch.manual_seed(seed)
            clip = _clip()
            torch.manual_seed(seed)
            t5 = _t5()
        pipe = FluxPipeline(
            scheduler=_scheduler(), vae=vae, text_encoder=clip, text_encoder_2=t5, transformer=transformer, **tokenizers
        )
        pipe.save_pretrained(str(out_dir), safe_serialization=True)
        for slot in tokenizers:
            place_tokenizer_json(Path(tokenizer_dir), out_dir / slot)
    return out_dir
