"""A randomly initialised miniature of Wan2.1 text-to-video (``WanPipeline``: UMT5 text encoder,
WanTransformer3DModel, AutoencoderKLWan), saved so that it loads through the same
``WanPipeline.from_pretrained(local_dir)`` a real Wan2.1-T2V checkout does.

Stand-ins, as for tiny SD3 / Flux (no vocabulary can be fetched offline):

* The tokenizer is the Qwen2 BPE tokenizer (``model_max_length`` 32) in place of UMT5's
  SentencePiece one; the ``UMT5EncoderModel``'s embedding table covers its 151665 ids. The pipeline
  pads every prompt to ``max_sequence_length`` with the pad id and masks the padding in the
  encoder, exactly as it does with the real tokenizer.
* The scheduler is a ``FlowMatchEulerDiscreteScheduler`` with ``shift=3.0`` (Wan2.1's 480p
  ``flow_shift``). Real checkouts ship ``UniPCMultistepScheduler``; the policy samples them with the
  Euler / SDE steps at their ``flow_shift`` (see serve_app/policies/wan.py), and with this scheduler
  the stock ``__call__`` at noise 0 is exactly that ODE.

Geometry: the VAE keeps Wan's temporal factor 4 (two temporal downsamplings: 4k + 1 frames ->
k + 1 latent frames) but has two spatial levels instead of three (factor 4, not 8), so 32x32 frames
give 8x8 latents and, with the transformer's 1x2x2 patches, 16 tokens per latent frame.
"""

from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from .tiny_parts import qwen2_tokenizer, save_pipeline, seeded
from .tokenizer import QWEN2_PAD_ID, QWEN2_VOCAB_SIZE

__all__ = ["build_tiny_wan"]

_MAX_LENGTH = 32  # the tokenizer's model_max_length: the policy's max_sequence_length
_TEXT_DIM = 16  # UMT5 d_model = the transformer's text_dim
_Z_DIM = 4  # latent channels
_TEMPORAL_FACTOR = 4  # Wan2.1's
_SPATIAL_FACTOR = 4  # Wan2.1 has 8; one level fewer keeps 32 px frames at 8x8 latents
_FLOW_SHIFT = 3.0  # Wan2.1-T2V at 480p


def _text_encoder() -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=QWEN2_VOCAB_SIZE,
        d_model=_TEXT_DIM,
        d_kv=8,
        d_ff=2 * _TEXT_DIM,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=QWEN2_PAD_ID,
        eos_token_id=QWEN2_PAD_ID,
    )
    return UMT5EncoderModel(config).eval()


def _transformer() -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,  # rotary split: 4 (time) + 4 (height) + 4 (width)
        in_channels=_Z_DIM,
        out_channels=_Z_DIM,
        text_dim=_TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _vae() -> AutoencoderKLWan:
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=_Z_DIM,
        dim_mult=[1, 2, 2],  # two downsampling levels ...
        num_res_blocks=1,
        temperal_downsample=[True, True],  # ... both also in time
        # Non-trivial normalisation constants, so decode's (latents * std + mean) is exercised.
        latents_mean=[0.1, -0.2, 0.05, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
        scale_factor_temporal=_TEMPORAL_FACTOR,
        scale_factor_spatial=_SPATIAL_FACTOR,
    )


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=_FLOW_SHIFT)


def build_tiny_wan(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds a random-weight ``WanPipeline`` and saves it (float32 safetensors), bit-reproducibly:
    each component is created right after ``torch.manual_seed``. ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        tokenizer.model_max_length = _MAX_LENGTH
        pipe = WanPipeline(
            tokenizer=tokenizer, text_encoder=seeded(seed, _text_encoder), vae=seeded(seed, _vae),
            scheduler=_scheduler(), transformer=seeded(seed, _transformer),
        )
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=["tokenizer"])
