"""A randomly initialised miniature of Qwen-Image-Edit: the stock ``diffusers.QwenImageEditPipeline`` (or
``QwenImageEditPlusPipeline``, the same parts saved under the Plus class) over
the tiny Qwen-Image parts, with a vision tower and a Qwen2-VL processor small enough for CPU tests.

The transformer, VAE and scheduler are tiny Qwen-Image's (:mod:`serve_app.models.tiny_qwen_image`); the
text encoder is the same Qwen2.5-VL miniature with 2 px vision patches, and the processor's image
processor resizes each input image to at most 16 x 16 px (64 patches, 16 vision tokens after the 2 x 2
merge). The tokenizer is the real Qwen2 BPE, in both the ``tokenizer`` and the ``processor`` folder, as
in the released checkout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageEditPipeline, QwenImageEditPlusPipeline
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from .tiny_parts import qwen2_tokenizer, save_pipeline, seeded_components
from .tiny_qwen_image import _SPECS, _TEXT_VOCAB_SIZE, QWEN_IMAGE_SCHEDULER_CONFIG, _transformer, _vae, qwen25vl_text_encoder
from .tokenizer import QWEN2_EOS_ID, QWEN2_PAD_ID
from .vl_processor import RELEASED_PROCESSOR_CLASS, Qwen2VLImageOnlyProcessor
from .tokenizer_cache import load_tokenizer

__all__ = ["TINY_INPUT_IMAGE_AREA", "build_tiny_qwen_image_edit", "qwen_image_edit_pipeline", "tiny_vl_processor"]

# The area the tiny checkpoint's configs resize input images to (model.input_image_area): 32 x 32 px,
# 16 latent tokens, where the released model takes 1024 x 1024.
TINY_INPUT_IMAGE_AREA = 32 * 32
_VISION_PATCH = 2
_VISION_MERGE = 2


def tiny_vl_processor(tokenizer: Any) -> Qwen2VLImageOnlyProcessor:
    """The processor: 2 px patches, 2 frames a temporal patch, 2 x 2 merge, 4 x 4 to 16 x 16 px images."""
    factor = _VISION_PATCH * _VISION_MERGE
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=_VISION_PATCH, temporal_patch_size=2, merge_size=_VISION_MERGE,
        min_pixels=factor * factor, max_pixels=(4 * factor) ** 2,
    )
    return Qwen2VLImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer)


def _text_encoder() -> torch.nn.Module:
    spec = _SPECS["tiny"]
    return qwen25vl_text_encoder(
        vocab_size=_TEXT_VOCAB_SIZE, hidden_size=spec.text_dim, layers=spec.text_layers, heads=spec.text_heads,
        mrope_section=spec.text_mrope, pad_id=QWEN2_PAD_ID, eos_id=QWEN2_EOS_ID, bos_id=QWEN2_PAD_ID,
        vision_patch_size=_VISION_PATCH,
    )


def qwen_image_edit_pipeline(*, tokenizer: Any, seed: int = 0, plus: bool = False) -> QwenImageEditPipeline:
    """A random-weight tiny ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``, the same parts)
    in float32, in memory; bit-reproducible for a `seed`."""
    spec = _SPECS["tiny"]
    components = seeded_components(
        [("transformer", lambda: _transformer(spec), seed), ("vae", lambda: _vae(spec), seed),
         ("text_encoder", _text_encoder, seed)], torch.float32)
    with torch.device("cpu"):
        scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG)
    pipeline_class = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return pipeline_class(scheduler=scheduler, tokenizer=tokenizer, processor=tiny_vl_processor(tokenizer), **components)


def build_tiny_qwen_image_edit(out_dir: Path, *, seed: int = 0, tokenizer_dir: Path | None = None,
                               plus: bool = False) -> Path:
    """Builds the tiny ``QwenImageEditPipeline`` (``plus``: ``QwenImageEditPlusPipeline``) on the CPU and saves
    it (float32 safetensors) to ``out_dir``.

    model_index.json names the processor ``transformers.Qwen2VLProcessor``, as a released checkout does
    (the policy loads it as :class:`Qwen2VLImageOnlyProcessor`, which needs no torchvision).
    """
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizer = load_tokenizer(tokenizer_dir)
        with torch.device("cpu"):
            pipe = qwen_image_edit_pipeline(tokenizer=tokenizer, seed=seed, plus=plus)
        out = save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=["tokenizer", "processor"])
    index_file = out / "model_index.json"
    index = json.loads(index_file.read_text())
    index["processor"] = RELEASED_PROCESSOR_CLASS
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out
