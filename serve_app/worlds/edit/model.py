"""The editing-world model: a small QwenImageEditPipeline in pixel space, started from the shapes world's.

Components, all loaded by the stock ``QwenImageEditPipeline.from_pretrained`` and our QwenImageEditPolicy:

* ``vae``: :class:`~serve_app.models.pixel_vae.PixelPatchVAE`, as in the shapes world: a 32x32 image is
  64 tokens of 4x4 pixels, for the noisy latents and the source image's latents alike.
* ``tokenizer``: word level over the Qwen2 pieces of the edit template and the instruction grammar,
  with the template's vision markers as special tokens (the template header stays the 64 tokens the
  pipeline drops).
* ``processor``: the Qwen2-VL image processor with 2 px patches (a 32x32 source is seen at 16x16: 16
  vision tokens).
* ``text_encoder``: a 1-layer Qwen2.5-VL whose vision tower the pipeline runs.
* ``transformer``: QwenImageTransformer2DModel, the shapes world's architecture.

The untrained pipeline starts from the shipped shapes model: its transformer whole, and its text
encoder's text weights (every embedding row of a piece both vocabularies hold), so pretraining starts
from a model that already draws the palette's shapes; the vision tower is new.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import QwenImageEditPipeline, QwenImagePipeline
from transformers import AutoTokenizer

from serve_app.models.pixel_vae import PixelPatchVAE, save_pixel_space_pipeline
from serve_app.models.registry import EmbeddedModel
from serve_app.models.tiny_qwen_image_edit import tiny_vl_processor
from serve_app.models.tokenizer import build_word_level_tokenizer
from serve_app.worlds.shapes.model import SHAPES_QWEN_IMAGE, ShapesModelSpec, build_parts, static_shift_scheduler

__all__ = ["EDIT_QWEN_IMAGE", "VISION_TOKENS", "build_edit_qwen_image", "build_edit_tokenizer"]

# The pretrained checkpoint shipped in the repo (its README has the command, config and figures);
# configs/model/edit_qwen_image.yaml names it as `embedded: serve_app.worlds.edit.model:EDIT_QWEN_IMAGE`.
EDIT_QWEN_IMAGE = EmbeddedModel("qwen_image_edit", shipped=Path(__file__).parent / "checkpoints" / "edit-qwen-image")
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def _vocabulary_texts() -> list[str]:
    from serve_app.policies.qwen_text import EDIT_PROMPT_TEMPLATE

    from .instructions import all_instructions

    return [EDIT_PROMPT_TEMPLATE.format(text) for text in [*all_instructions(), " ", ""]]


def build_edit_tokenizer(qwen2_dir: Path, out_dir: Path) -> Path:
    """A word-level tokenizer over the Qwen2 pieces the edit template and the instruction grammar use."""
    return build_word_level_tokenizer(qwen2_dir, out_dir, _vocabulary_texts(), specials=VISION_TOKENS)


def _shapes_pipeline() -> QwenImagePipeline:
    path = SHAPES_QWEN_IMAGE.shipped
    assert path is not None
    return QwenImagePipeline.from_pretrained(str(path), vae=PixelPatchVAE.from_pretrained(str(path / "vae")),
                                             dtype=torch.float32, local_files_only=True)


def _warm_start(text_encoder: torch.nn.Module, tokenizer, transformer: torch.nn.Module) -> None:
    """The shipped shapes model's transformer, and its text encoder's weights where both have them."""
    shapes = _shapes_pipeline()
    transformer.load_state_dict(shapes.transformer.state_dict())
    theirs = shapes.text_encoder.state_dict()
    mine = text_encoder.state_dict()
    embed = "model.language_model.embed_tokens.weight"
    for name, value in theirs.items():
        if name in mine and mine[name].shape == value.shape and name != embed and "visual" not in name and "lm_head" not in name:
            mine[name] = value.clone()
    their_ids = shapes.tokenizer.get_vocab()
    for piece, row in tokenizer.get_vocab().items():
        if piece in their_ids:
            mine[embed][row] = theirs[embed][their_ids[piece]]
    text_encoder.load_state_dict(mine)


def build_edit_qwen_image(out_dir: Path, spec: ShapesModelSpec, *, qwen2_dir: Path, seed: int = 0,
                          warm_start: bool = True) -> QwenImageEditPipeline:
    """Builds the untrained pipeline (fixed seed; from the shapes model unless ``warm_start`` is false),
    saves it to ``out_dir`` and returns it."""
    out_dir = Path(out_dir)
    tokenizer_dir = build_edit_tokenizer(qwen2_dir, out_dir / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    ids = dict(zip(("vision_start_token_id", "image_token_id", "vision_end_token_id"),
                   tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    transformer, text_encoder = build_parts(spec, tokenizer, seed=seed, vision_patch_size=2, vision_token_ids=ids)
    if warm_start:
        _warm_start(text_encoder, tokenizer, transformer)
    pipe = QwenImageEditPipeline(scheduler=static_shift_scheduler(spec), vae=PixelPatchVAE(patch_size=spec.vae_patch_size),
                                 text_encoder=text_encoder, tokenizer=tokenizer, processor=tiny_vl_processor(tokenizer),
                                 transformer=transformer)
    save_pixel_space_pipeline(pipe, out_dir)
    return pipe
