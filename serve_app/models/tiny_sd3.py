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
"""

from __future__ import annotations

from pathlib import Path

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from transformers import CLIPTextModelWithProjection

from .tiny_parts import clip_text_config, kl_vae, qwen2_tokenizer, save_pipeline, seeded, t5_encoder, tokenizer_slots

__all__ = ["SD3_MIN_IMAGE_SIZE", "build_tiny_sd3"]

SD3_MIN_IMAGE_SIZE = 8

_CLIP_MAX_LENGTH = 77
_T5_MAX_LENGTH = 32
_CLIP_DIM = 8  # hidden == projection width of each CLIP encoder
_T5_DIM = 2 * _CLIP_DIM  # the pipeline zero-pads [clip_l | clip_g] up to T5's width
_LATENT_CHANNELS = 4
_VAE_CHANNELS = (8, 16, 16)  # three levels -> vae_scale_factor 4


def _clip() -> CLIPTextModelWithProjection:
    # Two layers: the pipeline reads hidden_states[-2].
    config = clip_text_config(_CLIP_DIM, layers=2, max_length=_CLIP_MAX_LENGTH, projection_dim=_CLIP_DIM)
    return CLIPTextModelWithProjection(config).eval()


def _transformer() -> SD3Transformer2DModel:
    heads, head_dim = 2, 16
    return SD3Transformer2DModel(
        sample_size=8,  # default latent size -> 32 px images when height/width are omitted
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=head_dim,
        num_attention_heads=heads,
        joint_attention_dim=_T5_DIM,
        caption_projection_dim=heads * head_dim,
        pooled_projection_dim=2 * _CLIP_DIM,
        pos_embed_max_size=32,
    )


def _vae() -> AutoencoderKL:
    # SD3's latent normalisation constants.
    return kl_vae(_VAE_CHANNELS, _LATENT_CHANNELS, scaling_factor=1.5305, shift_factor=0.0609)


def build_tiny_sd3(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds a random-weight ``StableDiffusion3Pipeline`` and saves it (float32 safetensors).

    Each component is created on CPU right after ``torch.manual_seed(seed)``, so builds
    are bit-reproducible. ``tokenizer_dir`` is a :func:`build_qwen2_tokenizer` output;
    without it one is built (~3 s).
    """
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizers = tokenizer_slots(
            tokenizer_dir, {"tokenizer": _CLIP_MAX_LENGTH, "tokenizer_2": _CLIP_MAX_LENGTH, "tokenizer_3": _T5_MAX_LENGTH}
        )
        pipe = StableDiffusion3Pipeline(
            transformer=seeded(seed, _transformer),
            scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            vae=seeded(seed, _vae),
            text_encoder=seeded(seed, _clip),
            text_encoder_2=seeded(seed + 1, _clip),  # another seed: the two CLIP towers are not clones
            text_encoder_3=seeded(seed, lambda: t5_encoder(_T5_DIM)),
            **tokenizers,
        )
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=tokenizers)
