"""A randomly initialised miniature of LTX-2 text-to-audio+video (``LTX2Pipeline``: Gemma3 text encoder,
LTX2TextConnectors, LTX2VideoTransformer3DModel, the video and audio VAEs and the vocoder), saved so that it
loads through the same ``LTX2Pipeline.from_pretrained(local_dir)`` a real checkout does. Layout ``tiny-i2v``
(embedded as ``tiny-ltx2-i2v``) is the same components under ``LTX2ImageToVideoPipeline``, as LTX-2's
image-to-video shares the text-to-video weights.

Layout ``tiny`` (embedded as ``tiny-ltx2``): LTX-2.0 (``Lightricks/LTX-2``), every component its real
class at a few channels wide:

* ``text_encoder``: a ``Gemma3ForConditionalGeneration`` (two text layers, one sliding-window and one
  global as Gemma3 alternates them, and a one-layer SigLIP vision tower that text prompts never run).
  The pipeline stacks the embeddings and every layer's hidden states: ``text_proj_in_factor`` = layers + 1.
* ``connectors``: LTX-2.0's layout (``per_modality_projections`` False): one ``text_proj_in`` to the
  Gemma width, then a video and an audio 1-D transformer of that same width (``caption_channels``): the
  transformer's ``caption_projection`` / ``audio_caption_projection`` map it to its video and audio cross-
  attention widths. 8 learnable registers, which replace the padding, so text lengths are multiples of 8.
* ``transformer``: two audio-video blocks; video 2 heads x 16, audio 2 heads x 8 (the release's 2:1
  ratio, and as many audio as video heads: the a2v rotary table is cut by the video head count). RoPE
  ``split`` as released; its head dims need only be even.
* ``vae`` / ``audio_vae``: non-trivial ``latents_mean`` / ``latents_std`` buffers, so the pipeline's
  (de)normalisation is exercised. The video VAE has no timestep conditioning, as released.

Geometry. The video VAE patchifies frames 2x2 (released: 4x4), then downsamples ``spatial``,
``temporal``, ``spatiotemporal`` (released: one more ``spatiotemporal``): spatial factor 8, temporal
factor 4, 8 latent channels. 32x32 px frames give 4x4 latents, 16 tokens per latent frame (transformer
patches 1x1x1); num_frames = 4k + 1 gives k + 1 latent frames: 5 -> 2 (32 tokens), 9 -> 3 (48 tokens).
The pipeline checks height and width are multiples of 32, so 32x32 is the smallest frame.

Audio keeps the released rates (16 kHz mel, hop 160, the audio VAE's fixed factor 4 in time and mel):
25 latent frames a second, round(num_frames / frame_rate * 25) of them - at 24 fps, 9 frames -> 9 and 5
-> 5. Each is 4 channels x 4 latent mel bins = 16 features (16 mel bins; released 8 x 16 = 128 of 64 bins).
The audio VAE's statistics are over those packed features, so its ``base_channels`` is 16 too. The audio
VAE decodes L latent frames to 4L - 3 stereo mel frames, and the vocoder upsamples them x240 (the released
factors, narrower) to 24 kHz: 9 latent frames -> 33 mel frames -> 7920 samples a channel.

Stand-ins, as for the other tiny families (no vocabulary can be fetched offline):

* The tokenizer is the Qwen2 BPE tokenizer (``model_max_length`` 32) in place of Gemma3's; Gemma3's
  embedding table covers its 151665 ids, its pad id is Qwen's. The pipeline left-pads every prompt to
  ``max_sequence_length`` (pass 32: its default is 1024) exactly as with the real tokenizer.
* The scheduler is the released ``FlowMatchEulerDiscreteScheduler`` config (Lightricks/LTX-2's
  ``scheduler_config.json``, as mirrored on the Hub and in ostris/ai-toolkit's LTX-2 trainer): dynamic
  shifting between base_shift 0.95 at 1024 tokens and max_shift 2.05 at 4096, shift_terminal 0.1. At 48
  tokens mu is about 0.60 (the pipeline extrapolates the line below 1024).

Size ``full`` (``full-i2v``: the same under ``LTX2ImageToVideoPipeline``): LTX-2.0 at its released dimensions,
for the GPU check (benchmarks/gpu_rollout.py), built in memory with :func:`ltx2_pipeline`, never saved:

* Confirmed against diffusers' scripts/convert_ltx2_to_diffusers.py (its ``version == "2.0"`` configs, with which
  it converts Lightricks/LTX-2's ltx-2-19b-dev.safetensors by default): the transformer (48 audio-video blocks;
  video 32 heads x 128, cross-attention 4096; audio 32 heads x 64, cross-attention 2048; 128 video and 128 audio
  latent features; caption_channels 3840; RoPE ``split``, vae_scale_factors (8, 32, 32)); the connectors (caption
  width 3840, both 30 heads x 128, 2 layers, 128 registers, RoPE ``split``); the video VAE (128 latent channels,
  4x4 patches, encoder (256, 512, 1024, 2048) with (4, 6, 6, 2, 2) blocks and spatial / temporal / two
  spatiotemporal downsamplings, decoder (256, 512, 1024) with 5 blocks a level, no noise injection, non-causal
  decoder, factors 32 and 8; Lightricks' own ltx-core VAE test lists the same block layout); the audio VAE (base
  128, ch_mult (1, 2, 4), 2 res blocks, 8 latent channels, 64 mel bins); the vocoder (1024 hidden, upsampling
  factors (6, 5, 2, 2, 2)); the scheduler (the same config as every size here). Most of these are diffusers 0.42.1's
  constructor defaults; the release differs from them in the transformer's and connectors' ``rope_type``
  (``split``) and the VAE's ``decoder_causal`` (False), which are set here.
* Not confirmed: the video VAE's ``timestep_conditioning`` is False as the conversion script converts by default
  (it has a ``--timestep_conditioning`` flag, and a VAE config in Lightricks' ltx-core tests has it True); the
  VAEs' latent statistics (the released values are weights: the video VAE keeps the constructor's zeros / ones,
  the audio VAE the tiny's ramps).
* Stand-ins: the 12B Gemma 3 text encoder at its real width (hidden 3840, 16 heads / 8 KV heads, MLP 15360,
  sliding window 1024: Gemma-3-12B's text_config as quoted in public configs; heads of 256, transformers'
  Gemma3TextConfig default, which that text_config leaves unset) with ONE of its 48 layers, over the Qwen2
  vocabulary, and the tiny's small SigLIP tower (text prompts never run it). So the connectors'
  ``text_proj_in_factor`` is 2 (one layer + the embeddings), where the release has 49: their ``text_proj_in`` is
  7,680 x 3,840 instead of 188,160 x 3,840 (0.03B parameters where the release has 0.72B). The tokenizer is the
  Qwen2 one with ``model_max_length`` 1024, the stock ``max_sequence_length``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from .tiny_parts import build_with_qwen2_tokenizer, seeded_components
from .tokenizer import QWEN2_EOS_ID, QWEN2_PAD_ID, QWEN2_VOCAB_SIZE

__all__ = ["LTX2Size", "build_tiny_ltx2", "ltx2_pipeline"]

LTX2Size = Literal["tiny", "tiny-i2v", "full", "full-i2v"]

# Fixed by the classes, not the config: the audio VAE's time and mel factor (LATENT_DOWNSAMPLE_FACTOR)
# and the mel rate the transformer's audio RoPE and the pipeline's audio length both read.
_AUDIO_FACTOR = 4
_SAMPLE_RATE = 16000
_HOP_LENGTH = 160


@dataclass(frozen=True)
class _Spec:
    max_length: int  # the tokenizer's model_max_length: the policy's max_sequence_length
    text_dim: int  # Gemma3 hidden_size = the connectors' and transformer's caption_channels
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_ffn: int
    text_window: int  # Gemma3's sliding window
    connector_heads: int  # of text_dim // connector_heads each
    registers: int  # the connectors' learnable registers; must divide the text length
    layers: int
    heads: int
    head_dim: int
    audio_heads: int
    audio_head_dim: int
    latent_channels: int
    vae_patch: int
    vae_channels: tuple[int, ...]  # encoder levels, one per downsample type
    vae_downsample: tuple[str, ...]
    vae_layers: tuple[int, ...]  # resnets per encoder level, and the mid block's
    vae_decoder_channels: tuple[int, ...]  # each level half the next: the residual upsamplers need it
    vae_decoder_layers: tuple[int, ...]  # resnets of the mid block, then per decoder level
    spatial_factor: int
    temporal_factor: int
    latents_mean: tuple[float, ...] | None  # None: the constructor's zeros / ones
    latents_std: tuple[float, ...] | None
    audio_latent_channels: int
    audio_res_blocks: int
    mel_bins: int
    vocoder_channels: int
    image_to_video: bool = False  # LTX2ImageToVideoPipeline: the same components, a given first frame


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(
        max_length=32, text_dim=16, text_layers=2, text_heads=2, text_kv_heads=1, text_head_dim=8, text_ffn=32,
        text_window=16, connector_heads=2, registers=8, layers=2, heads=2, head_dim=16, audio_heads=2,
        audio_head_dim=8, latent_channels=8, vae_patch=2, vae_channels=(16, 32, 64),
        vae_downsample=("spatial", "temporal", "spatiotemporal"), vae_layers=(1, 1, 1, 1),
        vae_decoder_channels=(16, 32), vae_decoder_layers=(1, 1, 1), spatial_factor=8, temporal_factor=4,
        latents_mean=(0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.15, -0.05),
        latents_std=(1.5, 0.8, 1.2, 2.0, 0.9, 1.1, 0.7, 1.3),
        audio_latent_channels=4, audio_res_blocks=1, mel_bins=16, vocoder_channels=64,
    ),
    # Lightricks/LTX-2 (LTX-2.0) as released (the module docstring: sources, stand-ins), but a one-layer Gemma 3.
    "full": _Spec(
        max_length=1024, text_dim=3840, text_layers=1, text_heads=16, text_kv_heads=8, text_head_dim=256,
        text_ffn=15360, text_window=1024, connector_heads=30, registers=128, layers=48, heads=32, head_dim=128,
        audio_heads=32, audio_head_dim=64, latent_channels=128, vae_patch=4, vae_channels=(256, 512, 1024, 2048),
        vae_downsample=("spatial", "temporal", "spatiotemporal", "spatiotemporal"), vae_layers=(4, 6, 6, 2, 2),
        vae_decoder_channels=(256, 512, 1024), vae_decoder_layers=(5, 5, 5, 5), spatial_factor=32,
        temporal_factor=8, latents_mean=None, latents_std=None, audio_latent_channels=8, audio_res_blocks=2,
        mel_bins=64, vocoder_channels=1024,
    ),
}
# LTX-2 image-to-video: the text-to-video checkpoint's components under LTX2ImageToVideoPipeline.
_SPECS["tiny-i2v"] = replace(_SPECS["tiny"], image_to_video=True)
_SPECS["full-i2v"] = replace(_SPECS["full"], image_to_video=True)


def _audio_features(spec: _Spec) -> int:
    """Features of one packed audio token: latent channels x latent mel bins."""
    return spec.audio_latent_channels * (spec.mel_bins // _AUDIO_FACTOR)


def _text_encoder(spec: _Spec) -> Gemma3ForConditionalGeneration:
    text = Gemma3TextConfig(
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=spec.text_dim, intermediate_size=spec.text_ffn,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, head_dim=spec.text_head_dim, query_pre_attn_scalar=spec.text_head_dim,
        max_position_embeddings=spec.max_length * 4,
        # Gemma3's local/global alternation (its first layer is a local one); the tiny's window is shorter than
        # the text so it masks something.
        layer_types=["sliding_attention", "full_attention"][: spec.text_layers], sliding_window=spec.text_window,
        pad_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_EOS_ID, bos_token_id=QWEN2_PAD_ID,
    )
    # Four 7 px patches a side pooled 2x2 into mm_tokens_per_image, as Gemma3 pools 64 into 16 a side.
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=7, vision_use_head=False)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          pad_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_EOS_ID, bos_token_id=QWEN2_PAD_ID)
    return Gemma3ForConditionalGeneration(config).eval()


def _connectors(spec: _Spec) -> LTX2TextConnectors:
    # LTX-2.0: both connectors run at the Gemma width (released 30 heads x 128 = 3840). text_proj_in takes
    # every encoder layer's states and the embeddings': the release's 49 is Gemma-3-12B's 48 layers + 1.
    heads = spec.connector_heads
    return LTX2TextConnectors(
        caption_channels=spec.text_dim, text_proj_in_factor=spec.text_layers + 1,
        video_connector_num_attention_heads=heads, video_connector_attention_head_dim=spec.text_dim // heads,
        video_connector_num_layers=2, video_connector_num_learnable_registers=spec.registers,
        audio_connector_num_attention_heads=heads, audio_connector_attention_head_dim=spec.text_dim // heads,
        audio_connector_num_layers=2, audio_connector_num_learnable_registers=spec.registers,
        rope_type="split", per_modality_projections=False,
    )


def _transformer(spec: _Spec) -> LTX2VideoTransformer3DModel:
    # LTX-2.0's caption projections take the connectors' output to these widths: the cross-attention
    # dims are the video and audio inner dims, as released (4096 = 32 x 128, 2048 = 32 x 64).
    video_dim, audio_dim = spec.heads * spec.head_dim, spec.audio_heads * spec.audio_head_dim
    return LTX2VideoTransformer3DModel(
        in_channels=spec.latent_channels, out_channels=spec.latent_channels, patch_size=1, patch_size_t=1,
        num_attention_heads=spec.heads, attention_head_dim=spec.head_dim, cross_attention_dim=video_dim,
        vae_scale_factors=(spec.temporal_factor, spec.spatial_factor, spec.spatial_factor),
        audio_in_channels=_audio_features(spec), audio_out_channels=_audio_features(spec),
        audio_num_attention_heads=spec.audio_heads, audio_attention_head_dim=spec.audio_head_dim,
        audio_cross_attention_dim=audio_dim, audio_scale_factor=_AUDIO_FACTOR,
        audio_sampling_rate=_SAMPLE_RATE, audio_hop_length=_HOP_LENGTH,
        num_layers=spec.layers, caption_channels=spec.text_dim, rope_type="split",
    )


def _vae(spec: _Spec) -> AutoencoderKLLTX2Video:
    levels, up_levels = len(spec.vae_channels), len(spec.vae_decoder_channels)
    vae = AutoencoderKLLTX2Video(
        latent_channels=spec.latent_channels, block_out_channels=spec.vae_channels,
        down_block_types=("LTX2VideoDownBlock3D",) * levels, downsample_type=spec.vae_downsample,
        spatio_temporal_scaling=(True,) * levels, layers_per_block=spec.vae_layers,
        decoder_block_out_channels=spec.vae_decoder_channels, decoder_layers_per_block=spec.vae_decoder_layers,
        decoder_spatio_temporal_scaling=(True,) * up_levels, decoder_inject_noise=(False,) * (up_levels + 1),
        upsample_type=("spatiotemporal",) * up_levels, upsample_residual=(True,) * up_levels,
        upsample_factor=(2,) * up_levels, patch_size=spec.vae_patch, timestep_conditioning=False,
        decoder_causal=False,  # as released (the constructor's default is True)
        # The constructor would count every level as temporal and spatial (patch x 2^levels): state both,
        # as the release does (32 and 8).
        spatial_compression_ratio=spec.spatial_factor, temporal_compression_ratio=spec.temporal_factor,
    )
    if spec.latents_mean is not None and spec.latents_std is not None:
        vae.latents_mean.copy_(torch.tensor(spec.latents_mean))
        vae.latents_std.copy_(torch.tensor(spec.latents_std))
    return vae.eval()


def _audio_vae(spec: _Spec) -> AutoencoderKLLTX2Audio:
    features = _audio_features(spec)
    # ch_mult of three levels: two downsamplings, the factor 4 the class assumes.
    vae = AutoencoderKLLTX2Audio(
        base_channels=features, ch_mult=(1, 2, 4), num_res_blocks=spec.audio_res_blocks,
        latent_channels=spec.audio_latent_channels, mel_bins=spec.mel_bins, sample_rate=_SAMPLE_RATE,
        mel_hop_length=_HOP_LENGTH,
    )
    vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, features))
    vae.latents_std.copy_(torch.linspace(0.7, 1.4, features))
    return vae.eval()


def _vocoder(spec: _Spec) -> LTX2Vocoder:
    # The released upsampling (x240: 100 mel frames a second to 24 kHz) and resblocks, narrower; input
    # is the stereo mel spectrogram, 2 x mel_bins channels.
    return LTX2Vocoder(in_channels=2 * spec.mel_bins, hidden_channels=spec.vocoder_channels, out_channels=2,
                       output_sampling_rate=24000).eval()


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
        base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1,
    )


def ltx2_pipeline(size: LTX2Size, *, tokenizer: Any, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> LTX2Pipeline | LTX2ImageToVideoPipeline:
    """A random-weight ``LTX2Pipeline`` (``*-i2v``: ``LTX2ImageToVideoPipeline``) of `size` in `dtype`, in
    memory, on the current default device; bit-reproducible for a given `seed` (:func:`seeded_components`).
    `tokenizer`'s model_max_length is set to the size's text length."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizer.model_max_length = spec.max_length
    makers = [("transformer", _transformer), ("connectors", _connectors), ("vae", _vae), ("audio_vae", _audio_vae),
              ("vocoder", _vocoder), ("text_encoder", _text_encoder)]
    components = seeded_components([(name, lambda make=make: make(spec), seed) for name, make in makers], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = _scheduler()
    pipeline_class = LTX2ImageToVideoPipeline if spec.image_to_video else LTX2Pipeline
    return pipeline_class(tokenizer=tokenizer, scheduler=scheduler, **components)


def build_tiny_ltx2(out_dir: Path, *, size: LTX2Size = "tiny", seed: int = 0, tokenizer_dir: Path | None = None) -> Path:
    """Builds a tiny random-weight ``LTX2Pipeline`` (`size`: the module docstring's layout) on the CPU and
    saves it (float32 safetensors), bit-reproducibly (:func:`ltx2_pipeline`). ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    return build_with_qwen2_tokenizer(lambda tokenizer: ltx2_pipeline(size, tokenizer=tokenizer, seed=seed), out_dir,
                                      tokenizer_dir)
