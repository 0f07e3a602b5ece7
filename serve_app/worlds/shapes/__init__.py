"""Shapes world: procedural 32x32 scenes of coloured shapes, their prompts and a rule-based checker.

The core knows nothing of this world: configs name its parts by import path - the model
(``serve_app.worlds.shapes.model:SHAPES_QWEN_IMAGE``), the rewards (``serve_app.worlds.shapes.rewards``), the
trainer's prompts and evaluator (``serve_app.worlds.shapes.evaluation``). Importing this package itself
needs only numpy.
"""

from .checker import DEFAULT_PARAMS, UNKNOWN, CheckParams, DetectedObject, Verdict, check, detect
from .scene import (
    BACKGROUND,
    COLOURS,
    MAX_OBJECTS,
    SHAPES,
    SceneObject,
    SceneSpec,
    all_prompts,
    all_specs,
    is_held_out,
    parse_prompt,
    render,
    sample_specs,
    shape_mask,
    split_prompts,
)

__all__ = [
    "BACKGROUND",
    "COLOURS",
    "DEFAULT_PARAMS",
    "MAX_OBJECTS",
    "SHAPES",
    "UNKNOWN",
    "CheckParams",
    "DetectedObject",
    "SceneObject",
    "SceneSpec",
    "Verdict",
    "all_prompts",
    "all_specs",
    "check",
    "detect",
    "is_held_out",
    "parse_prompt",
    "render",
    "sample_specs",
    "shape_mask",
    "split_prompts",
]
