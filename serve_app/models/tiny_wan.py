"""Randomly initialised miniatures of Wan text-to-video (``WanPipeline``: UMT5 text encoder,
WanTransformer3DModel, AutoencoderKLWan), saved so that they load through the same
``WanPipeline.from_pretrained(local_dir)`` a real checkout does (image-to-video: ``WanImageToVideoPipeline``).
Text-to-video layouts:

* ``tiny`` (embedded as ``tiny-wan``): Wan2.1-T2V, one transformer.
* ``tiny-a14b`` (``tiny-wan22``): Wan2.2-T2V-A14B's two experts - ``transformer`` (high noise) and
  ``transformer_2`` (low noise, its own random weights) switching at ``boundary_ratio`` 0.875, the
  released value: with the shift-3 schedule a 3-step run takes step 0 with the high-noise expert and
  steps 1-2 with the low-noise one, a 4-step run steps 0-1 and 2-3.
* ``tiny-ti2v`` (``tiny-wan22-ti2v``): Wan2.2-TI2V-5B's layout - ``expand_timesteps`` (one timestep
  per latent token) and its residual VAE of 48 latent channels that patchifies frames 2x2 before three
  spatial downsamplings (spatial factor 16), so 32x32 frames give 2x2 latents: one token per latent frame.

Image-to-video layouts (``WanImageToVideoPipeline``; the transformer takes the noisy latents joined along the
channels with the first frame's conditioning: 4 mask channels, the VAE's temporal factor, and z_dim latents):

* ``tiny-i2v`` (``tiny-wan-i2v``): Wan2.1-I2V - a CLIP vision encoder (``image_encoder``, ``image_processor``)
  whose penultimate hidden states the transformer takes beside the text (``image_dim``, ``added_kv_proj_dim``).
  The CLIP encoder is a two-layer ViT over 28 x 28 px (two 14 px patches a side, as ViT-H/14 has 16).
* ``tiny-i2v-a14b`` (``tiny-wan22-i2v``): Wan2.2-I2V-A14B - two experts switching at ``boundary_ratio`` 0.9,
  the released value, and no image encoder.

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

Size ``full`` has Wan2.1-T2V-1.3B's transformer and VAE dimensions and its released
``UniPCMultistepScheduler`` (flow_shift 3.0), with a one-layer stand-in of the 4096-wide UMT5-XXL
encoder: for GPU benchmarks (benchmarks/gpu_rollout.py), built in memory with :func:`wan_pipeline`. Size
``full-i2v`` is Wan2.1-I2V-14B-480P's ``WanImageToVideoPipeline`` the same way, its CLIP ViT-H/14 at full size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from .tiny_parts import build_with_qwen2_tokenizer, seeded_components
from .tokenizer import QWEN2_PAD_ID, QWEN2_VOCAB_SIZE

__all__ = ["WanSize", "build_tiny_wan", "wan_pipeline"]

WanSize = Literal["tiny", "tiny-a14b", "tiny-ti2v", "tiny-i2v", "tiny-i2v-a14b", "full", "full-i2v"]

_TEMPORAL_FACTOR = 4  # Wan2.1's
_FLOW_SHIFT = 3.0  # Wan2.1-T2V at 480p


@dataclass(frozen=True)
class _Spec:
    layers: int
    heads: int
    head_dim: int  # rotary split over (time, height, width)
    ffn_dim: int
    freq_dim: int
    rope_max_seq_len: int
    text_dim: int  # UMT5 d_model = the transformer's text_dim
    max_length: int  # the tokenizer's model_max_length: the policy's max_sequence_length
    z_dim: int  # latent channels
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    vae_temporal_downsample: tuple[bool, ...]
    spatial_factor: int
    vae_res_blocks: int = 1
    # None: the constructor's defaults, which are Wan2.1's released latent statistics.
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    released_scheduler: bool = False  # UniPC with flow sigmas, as released; else FlowMatchEuler at the same shift
    # Wan2.2: a low-noise expert (`transformer_2`) taking the timesteps below boundary_ratio x 1000.
    boundary_ratio: float | None = None
    expand_timesteps: bool = False  # Wan2.2 TI2V: per-token timesteps
    # Wan2.2's VAE: residual down/up blocks, frames patchified `vae_patch_size` x `vae_patch_size` first.
    vae_is_residual: bool = False
    vae_patch_size: int | None = None
    vae_decoder_base_dim: int | None = None
    image_to_video: bool = False  # WanImageToVideoPipeline: the first frame's conditioning joined along the channels
    clip_dim: int | None = None  # Wan2.1-I2V: the CLIP vision encoder's width (the transformer's image_dim)
    clip_layers: int = 2
    clip_heads: int = 2
    clip_ffn_mult: int = 2  # the CLIP MLP's width over clip_dim
    clip_side: int = 28  # the CLIP encoder's input size in px; its patches are half of it, or clip_patch px
    clip_patch: int | None = None


_SPECS: dict[str, _Spec] = {
    # Wan2.1 has spatial factor 8; one level fewer keeps 32 px frames at 8x8 latents. Non-trivial
    # normalisation constants, so decode's (latents * std + mean) is exercised.
    "tiny": _Spec(layers=2, heads=2, head_dim=12, ffn_dim=32, freq_dim=32, rope_max_seq_len=32, text_dim=16,
                  max_length=32, z_dim=4, vae_base_dim=8, vae_dim_mult=(1, 2, 2), vae_temporal_downsample=(True, True),
                  spatial_factor=4, latents_mean=(0.1, -0.2, 0.05, 0.0), latents_std=(1.5, 0.8, 1.2, 2.0)),
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers: the transformer (30 blocks of 12 heads x 128, ffn 8960) and the VAE
    # as the constructors' defaults give them.
    "full": _Spec(layers=30, heads=12, head_dim=128, ffn_dim=8960, freq_dim=256, rope_max_seq_len=1024,
                  text_dim=4096, max_length=512, z_dim=16, vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4),
                  vae_temporal_downsample=(False, True, True), spatial_factor=8, vae_res_blocks=2,
                  released_scheduler=True),
}
# Wan2.2-T2V-A14B: Wan2.1's VAE and transformer layout, twice (boundary_ratio as released).
_SPECS["tiny-a14b"] = replace(_SPECS["tiny"], boundary_ratio=0.875)
# Wan2.2-TI2V-5B: 48 latent channels, 2x2 patchify + three spatial levels = factor 16, residual blocks,
# a wider decoder (160 / 256 in the release), latent statistics of 48 entries.
_SPECS["tiny-ti2v"] = replace(
    _SPECS["tiny"], z_dim=48, vae_base_dim=8, vae_decoder_base_dim=12, vae_dim_mult=(1, 2, 2, 2),
    vae_temporal_downsample=(False, True, True), spatial_factor=16, vae_is_residual=True, vae_patch_size=2,
    expand_timesteps=True, latents_mean=tuple(0.02 * (i % 7) - 0.06 for i in range(48)),
    latents_std=tuple(0.8 + 0.05 * (i % 9) for i in range(48)),
)
# Wan2.1-I2V: Wan2.1's VAE and transformer, with the CLIP image branch.
_SPECS["tiny-i2v"] = replace(_SPECS["tiny"], image_to_video=True, clip_dim=16)
# Wan2.2-I2V-A14B: two experts at the released boundary, image latents only.
_SPECS["tiny-i2v-a14b"] = replace(_SPECS["tiny"], image_to_video=True, boundary_ratio=0.9)
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers: 40 blocks of 40 heads x 128 (dim 5120), ffn 13824, Wan2.1's VAE, and
# the CLIP ViT-H/14 vision tower (1280 wide, 32 layers of 16 heads, MLP 5120, 224 px in 14 px patches).
_SPECS["full-i2v"] = replace(_SPECS["full"], layers=40, heads=40, ffn_dim=13824, image_to_video=True, clip_dim=1280,
                             clip_layers=32, clip_heads=16, clip_ffn_mult=4, clip_side=224, clip_patch=14)


def _text_encoder(spec: _Spec) -> UMT5EncoderModel:
    config = UMT5Config(
        vocab_size=QWEN2_VOCAB_SIZE,
        d_model=spec.text_dim,
        d_kv=8,
        d_ff=2 * spec.text_dim,
        num_layers=1,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        pad_token_id=QWEN2_PAD_ID,
        eos_token_id=QWEN2_PAD_ID,
    )
    return UMT5EncoderModel(config).eval()


def _transformer(spec: _Spec) -> WanTransformer3DModel:
    # Image-to-video: noisy latents + the temporal factor's mask channels + the first frame's latents.
    in_channels = 2 * spec.z_dim + _TEMPORAL_FACTOR if spec.image_to_video else spec.z_dim
    image = ({} if spec.clip_dim is None
             else {"image_dim": spec.clip_dim, "added_kv_proj_dim": spec.heads * spec.head_dim})
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.heads, attention_head_dim=spec.head_dim, in_channels=in_channels,
        out_channels=spec.z_dim, text_dim=spec.text_dim, freq_dim=spec.freq_dim, ffn_dim=spec.ffn_dim,
        num_layers=spec.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=spec.rope_max_seq_len, **image,
    )


def _image_encoder(spec: _Spec) -> CLIPVisionModel:
    assert spec.clip_dim is not None
    config = CLIPVisionConfig(hidden_size=spec.clip_dim, intermediate_size=spec.clip_ffn_mult * spec.clip_dim,
                              num_hidden_layers=spec.clip_layers, num_attention_heads=spec.clip_heads,
                              image_size=spec.clip_side, patch_size=spec.clip_patch or spec.clip_side // 2)
    return CLIPVisionModel(config).eval()


def _image_processor(spec: _Spec) -> CLIPImageProcessor:
    """CLIP's preprocessing (shortest side to the input size, bicubic; centre crop; CLIP's mean and std) at the
    encoder's input size."""
    side = spec.clip_side
    return CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})


def _vae(spec: _Spec) -> AutoencoderKLWan:
    statistics: dict[str, Any] = {}
    if spec.latents_mean is not None and spec.latents_std is not None:
        statistics = {"latents_mean": list(spec.latents_mean), "latents_std": list(spec.latents_std)}
    pixel_channels = 3 * (spec.vae_patch_size or 1) ** 2  # the patchified frame's channels
    return AutoencoderKLWan(
        base_dim=spec.vae_base_dim,
        decoder_base_dim=spec.vae_decoder_base_dim,
        z_dim=spec.z_dim,
        dim_mult=list(spec.vae_dim_mult),
        num_res_blocks=spec.vae_res_blocks,
        temperal_downsample=list(spec.vae_temporal_downsample),
        scale_factor_temporal=_TEMPORAL_FACTOR,
        scale_factor_spatial=spec.spatial_factor,
        is_residual=spec.vae_is_residual,
        patch_size=spec.vae_patch_size,
        in_channels=pixel_channels,
        out_channels=pixel_channels,
        **statistics,
    )


def _scheduler(spec: _Spec) -> FlowMatchEulerDiscreteScheduler | UniPCMultistepScheduler:
    if spec.released_scheduler:
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=_FLOW_SHIFT)
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=_FLOW_SHIFT)


def wan_pipeline(size: WanSize, *, tokenizer: Any, seed: int = 0, dtype: torch.dtype = torch.float32
                 ) -> WanPipeline | WanImageToVideoPipeline:
    """A random-weight ``WanPipeline`` (image-to-video sizes: ``WanImageToVideoPipeline``) of `size` in `dtype`, in memory, on the current default device;
    bit-reproducible for a given `seed` (:func:`seeded_components`). `tokenizer`'s model_max_length is
    set to the size's text length."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizer.model_max_length = spec.max_length
    makers = [("transformer", _transformer, seed), ("vae", _vae, seed), ("text_encoder", _text_encoder, seed)]
    if spec.boundary_ratio is not None:  # the low-noise expert: same architecture, weights of its own
        makers.append(("transformer_2", _transformer, seed + 1))
    if spec.clip_dim is not None:
        makers.append(("image_encoder", _image_encoder, seed + 2))
    components = seeded_components([(name, lambda make=make: make(spec), s) for name, make, s in makers], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = _scheduler(spec)
    if spec.image_to_video:
        processor = _image_processor(spec) if spec.clip_dim is not None else None
        return WanImageToVideoPipeline(tokenizer=tokenizer, scheduler=scheduler, image_processor=processor,
                                       boundary_ratio=spec.boundary_ratio, expand_timesteps=spec.expand_timesteps,
                                       **components)
    return WanPipeline(tokenizer=tokenizer, scheduler=scheduler, boundary_ratio=spec.boundary_ratio,
                       expand_timesteps=spec.expand_timesteps, **components)


def build_tiny_wan(out_dir: Path, *, size: WanSize = "tiny", seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds a tiny random-weight ``WanPipeline`` / ``WanImageToVideoPipeline`` (`size`: one of the module docstring's layouts) on the
    CPU and saves it (float32 safetensors), bit-reproducibly (:func:`wan_pipeline`). ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    return build_with_qwen2_tokenizer(lambda tokenizer: wan_pipeline(size, tokenizer=tokenizer, seed=seed), out_dir,
                                      tokenizer_dir)
