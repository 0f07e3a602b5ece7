"""The moving-shapes model: a small WanPipeline in pixel space, built untrained, then pretrained.

Components, all loaded by the stock ``WanPipeline.from_pretrained`` and our WanPolicy:

* ``vae``: :class:`~serve_app.models.pixel_vae.PixelPatchVideoVAE` - each 32x32 RGB frame folded
  into ``3 p^2`` channels at ``32/p`` per side, no weights, temporal factor 1 (any frame count);
  the transformer's ``temporal_patch`` x 2 x 2 patches make ``(32 / 2p)^2`` tokens per
  ``temporal_patch`` frames (the shipped model: 2, as stock Wan).
* ``tokenizer``: word level over Qwen2's own pieces of the motion grammar
  (:func:`~serve_app.models.tokenizer.build_word_level_tokenizer`), ``model_max_length`` 16, so the
  transformer cross-attends to 16 text positions instead of the stock 512.
* ``text_encoder``: a small UMT5 encoder (relative position buckets: "left to right" and "right to
  left" are the same words in another order; ``text_neighbour_bias`` keeps that order visible).
* ``transformer``: WanTransformer3DModel, a few blocks.
* ``scheduler``: FlowMatchEulerDiscreteScheduler with a static shift (Wan2.1's ``flow_shift`` is 3).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from serve_app.models.pixel_vae import PixelPatchVideoVAE, save_pixel_space_pipeline
from serve_app.models.registry import EmbeddedModel
from serve_app.models.tokenizer import build_word_level_tokenizer

from .scene import all_prompts

__all__ = ["MOTION_WAN", "MotionModelSpec", "attend_to_neighbours", "build_motion_wan"]

# The pretrained checkpoint shipped in the repo (its README has the command, config and figures);
# configs/model/motion_wan.yaml names it as `embedded: serve_app.worlds.motion.model:MOTION_WAN`.
MOTION_WAN = EmbeddedModel("wan", shipped=Path(__file__).parent / "checkpoints" / "motion-wan")


class MotionModelSpec(BaseModel):
    """Architecture of the moving-shapes pipeline (configs/motion/pretrain.yaml `model:`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vae_patch_size: int = Field(2, ge=1, description="Pixels per side folded into one latent position.")
    temporal_patch: int = Field(1, ge=1, description="Frames per transformer token (the stock patch_size's first "
                                                     "entry): 2 lets a token's own values show which way an edge moved.")
    layers: int = Field(4, ge=1, description="Transformer blocks.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    head_dim: int = Field(32, ge=6, description="Width of one head (rotary split over frame, height, width).")
    ffn_dim: int = Field(256, ge=1, description="Feed-forward width of a block.")
    text_dim: int = Field(64, ge=2, description="UMT5 d_model == the transformer's text_dim.")
    text_layers: int = Field(2, ge=1, description="Text encoder layers.")
    text_heads: int = Field(4, ge=1, description="Text encoder heads.")
    max_text_tokens: int = Field(16, ge=8, description="The tokenizer's model_max_length: text positions per prompt.")
    schedule_shift: float = Field(3.0, gt=0, description="Static time shift of the sampling schedule.")
    text_neighbour_bias: float = Field(
        0.0, ge=0, description="Initial relative-position bias of two text heads towards the previous / next word "
                               "(0: UMT5's random init).")


def _vocabulary_texts() -> list[str]:
    return [*all_prompts(), " ", ""]


def attend_to_neighbours(text_encoder: UMT5EncoderModel, bias: float) -> None:
    """In every layer, head 0 starts out attending to the previous word and head 1 to the next: ``bias`` is
    written into their relative-position bias at the neighbour's bucket (0 keeps UMT5's random init).

    Wan's cross-attention sees the prompt as a set of vectors (no positions), so word order ("left to
    right" vs "right to left") reaches the transformer only through the text encoder. With the bias each
    word's vector depends on the word before / after it from the first step
    (``evaluation.word_order_gap`` measures how far apart the two orders land).
    """
    if bias == 0:
        return
    for block in text_encoder.encoder.block:
        attention = block.layer[0].SelfAttention
        buckets = attention._relative_position_bucket(torch.tensor([-1, 1])).tolist()  # key - query
        with torch.no_grad():
            for head, bucket in enumerate(buckets):
                attention.relative_attention_bias.weight[bucket, head] = bias


def build_motion_wan(out_dir: Path, spec: MotionModelSpec, *, qwen2_dir: Path, seed: int = 0) -> WanPipeline:
    """Builds the untrained pipeline (fixed seed), saves it to ``out_dir`` and returns it."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_dir = build_word_level_tokenizer(qwen2_dir, Path(scratch) / "tokenizer", _vocabulary_texts(),
                                                   model_max_length=spec.max_text_tokens)
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    vae = PixelPatchVideoVAE(patch_size=spec.vae_patch_size)
    with torch.device("cpu"):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(
            patch_size=(spec.temporal_patch, 2, 2),
            num_attention_heads=spec.heads,
            attention_head_dim=spec.head_dim,
            in_channels=vae.config.z_dim,
            out_channels=vae.config.z_dim,
            text_dim=spec.text_dim,
            freq_dim=64,
            ffn_dim=spec.ffn_dim,
            num_layers=spec.layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        torch.manual_seed(seed + 1)
        text_encoder = UMT5EncoderModel(UMT5Config(
            vocab_size=len(tokenizer),
            d_model=spec.text_dim,
            d_kv=spec.text_dim // spec.text_heads,
            d_ff=2 * spec.text_dim,
            num_layers=spec.text_layers,
            num_heads=spec.text_heads,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=spec.max_text_tokens,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            dropout_rate=0.0,
        ))
        attend_to_neighbours(text_encoder, spec.text_neighbour_bias)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.schedule_shift),
        transformer=transformer,
    )
    save_pixel_space_pipeline(pipe, out_dir)
    return pipe
