"""Embedded tiny checkpoints (random weights, real architectures) built offline on demand.

The builders are imported lazily because importing diffusers/transformers takes seconds.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .registry import (
    BUILD_VERSION,
    EMBEDDED_MODELS,
    EmbeddedModel,
    ensure_embedded_model,
    ensure_qwen2_tokenizer,
    flowgrpo_home,
)

if TYPE_CHECKING:
    from .tiny_clip import build_tiny_clip, ensure_tiny_clip
    from .tiny_flux import build_tiny_flux
    from .tiny_flux2 import build_tiny_flux2
    from .tiny_ltx2 import build_tiny_ltx2
    from .tiny_qwen_image import build_tiny_qwen_image
    from .tiny_qwen_image_edit import build_tiny_qwen_image_edit
    from .tiny_sd3 import build_tiny_sd3
    from .tiny_wan import build_tiny_wan
    from .tiny_z_image import build_tiny_z_image
    from .tokenizer import build_qwen2_tokenizer

_LAZY = {
    "build_qwen2_tokenizer": ".tokenizer",
    "build_tiny_clip": ".tiny_clip",
    "build_tiny_flux": ".tiny_flux",
    "build_tiny_flux2": ".tiny_flux2",
    "build_tiny_ltx2": ".tiny_ltx2",
    "build_tiny_qwen_image": ".tiny_qwen_image",
    "build_tiny_qwen_image_edit": ".tiny_qwen_image_edit",
    "build_tiny_sd3": ".tiny_sd3",
    "build_tiny_wan": ".tiny_wan",
    "build_tiny_z_image": ".tiny_z_image",
    "ensure_tiny_clip": ".tiny_clip",
}

__all__ = [
    "BUILD_VERSION",
    "EMBEDDED_MODELS",
    "EmbeddedModel",
    "build_qwen2_tokenizer",
    "build_tiny_clip",
    "build_tiny_flux",
    "build_tiny_flux2",
    "build_tiny_ltx2",
    "build_tiny_qwen_image",
    "build_tiny_qwen_image_edit",
    "build_tiny_sd3",
    "build_tiny_wan",
    "build_tiny_z_image",
    "ensure_embedded_model",
    "ensure_qwen2_tokenizer",
    "ensure_tiny_clip",
    "flowgrpo_home",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
