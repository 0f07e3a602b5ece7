"""The shapes-world model: a small QwenImagePipeline in pixel space, built untrained, then pretrained.

Components, all loaded by the stock ``QwenImagePipeline.from_pretrained`` and our QwenImagePolicy:

* ``vae``: :class:`~serve_app.models.pixel_vae.PixelPatchVAE` - 32x32 RGB folded into 12 channels
  at 16x16, no weights; the pipeline's own 2x2 packing makes 8x8 = 64 image tokens of 48 values.
* ``tokenizer``: word level over Qwen2's own pieces. The Qwen2 pre-tokenizer and byte-level
  alphabet, but a vocabulary of only the pieces the prompt template and the shapes grammar use
  (each is one Qwen2 token, checked at build time, so the template prefix stays the 34 tokens the
  pipeline drops). Other words map to ``<unk>``. This keeps the text encoder's embedding at a few
  dozen rows instead of Qwen2.5-VL's 152,064.
* ``text_encoder``: a 1-layer Qwen2.5-VL (its vision tower is never run but the class needs one).
* ``transformer``: QwenImageTransformer2DModel, a few MMDiT blocks.
* ``scheduler``: Qwen-Image's FlowMatchEulerDiscreteScheduler config.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from pydantic import BaseModel, ConfigDict, Field
from transformers import AutoTokenizer

from serve_app.models.pixel_vae import PixelPatchVAE, save_pixel_space_pipeline
from serve_app.models.registry import EmbeddedModel
from serve_app.models.tiny_qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG, qwen25vl_text_encoder, qwen_image_transformer
from serve_app.models.tokenizer import build_word_level_tokenizer

__all__ = ["SHAPES_QWEN_IMAGE", "ShapesModelSpec", "build_parts", "build_shapes_qwen_image", "build_shapes_tokenizer",
           "static_shift_scheduler"]

# The pretrained checkpoint shipped in the repo (its README has the command, config and figures);
# configs/model/shapes_qwen_image.yaml names it as `embedded: serve_app.worlds.shapes.model:SHAPES_QWEN_IMAGE`.
SHAPES_QWEN_IMAGE = EmbeddedModel("qwen_image", shipped=Path(__file__).parent / "checkpoints" / "shapes-qwen-image")

class ShapesModelSpec(BaseModel):
    """Architecture of the shapes-world pipeline (configs/shapes/pretrain.yaml `model:`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vae_patch_size: int = Field(2, ge=1, description="Pixels per side folded into one latent position.")
    layers: int = Field(4, ge=1, description="MMDiT blocks.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    head_dim: int = Field(32, ge=2, description="Width of one head.")
    rope_axes: tuple[int, int, int] = Field((8, 12, 12), description="(frame, height, width) RoPE dims; sum to head_dim.")
    text_dim: int = Field(64, ge=2, description="Qwen2.5-VL hidden size == the transformer's joint_attention_dim.")
    text_layers: int = Field(1, ge=1, description="Text encoder layers.")
    text_heads: int = Field(4, ge=1, description="Text encoder heads.")
    text_mrope: tuple[int, int, int] = Field((2, 3, 3), description="M-RoPE sections; sum to text head_dim / 2.")
    # A static time shift instead of Qwen-Image's resolution-dependent one: flat-coloured shapes
    # stay legible under a lot of noise, so the steps that decide the layout are the noisiest ones
    # and sampling spends more of its steps there (sigma' = s * sigma / (1 + (s - 1) * sigma)).
    schedule_shift: float = Field(3.0, gt=0, description="Static time shift of the sampling schedule.")
    extra_words: tuple[str, ...] = Field((), description="Words the tokenizer knows beyond the grammar.")


def _vocabulary_texts() -> list[str]:
    from serve_app.policies.qwen_text import PROMPT_TEMPLATE
    from serve_app.worlds.shapes.scene import all_prompts

    prompts = all_prompts() + [p.replace("a ", "one ", 1) for p in all_prompts() if p.startswith("a ")]
    return [PROMPT_TEMPLATE.format(p) for p in [*prompts, " ", ""]]


def build_shapes_tokenizer(qwen2_dir: Path, out_dir: Path) -> Path:
    """A word-level tokenizer over the Qwen2 pieces the template and the shapes grammar use."""
    return build_word_level_tokenizer(qwen2_dir, out_dir, _vocabulary_texts())


def build_parts(spec: ShapesModelSpec, tokenizer, *, seed: int, **text_encoder_args) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The untrained (transformer, text encoder) of ``spec`` over ``tokenizer``'s vocabulary, seeded;
    ``text_encoder_args`` go to ``qwen25vl_text_encoder`` (an edit model's vision tower)."""
    if sum(spec.rope_axes) != spec.head_dim:
        raise ValueError(f"rope_axes {spec.rope_axes} must sum to head_dim {spec.head_dim}")
    with torch.device("cpu"):
        torch.manual_seed(seed)
        transformer = qwen_image_transformer(z_dim=3 * spec.vae_patch_size**2, layers=spec.layers, heads=spec.heads,
                                             head_dim=spec.head_dim, text_dim=spec.text_dim, rope_axes=spec.rope_axes)
        torch.manual_seed(seed + 1)
        text_encoder = qwen25vl_text_encoder(
            vocab_size=len(tokenizer), hidden_size=spec.text_dim, layers=spec.text_layers, heads=spec.text_heads,
            mrope_section=spec.text_mrope, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
            bos_id=tokenizer.pad_token_id, max_positions=256, rope_theta=10_000.0, **text_encoder_args,
        )
    return transformer, text_encoder


def static_shift_scheduler(spec: ShapesModelSpec) -> FlowMatchEulerDiscreteScheduler:
    """Qwen-Image's scheduler with ``spec.schedule_shift`` in place of its resolution-dependent shift."""
    return FlowMatchEulerDiscreteScheduler(**{**QWEN_IMAGE_SCHEDULER_CONFIG, "use_dynamic_shifting": False,
                                              "shift": spec.schedule_shift, "shift_terminal": None})


def build_shapes_qwen_image(out_dir: Path, spec: ShapesModelSpec, *, qwen2_dir: Path, seed: int = 0) -> QwenImagePipeline:
    """Builds the untrained pipeline (fixed seed), saves it to ``out_dir`` and returns it."""
    out_dir = Path(out_dir)
    tokenizer_dir = build_shapes_tokenizer(qwen2_dir, out_dir / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    transformer, text_encoder = build_parts(spec, tokenizer, seed=seed)
    pipe = QwenImagePipeline(scheduler=static_shift_scheduler(spec), vae=PixelPatchVAE(patch_size=spec.vae_patch_size),
                             text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)
    save_pixel_space_pipeline(pipe, out_dir)
    return pipe
