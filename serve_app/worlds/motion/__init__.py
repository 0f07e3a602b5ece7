"""Moving-shapes world: 32x32 videos of one coloured shape moving left, right, up or down, their
prompts and a rule-based checker - the shapes world (serve_app.worlds.shapes) set in motion, reusing its
palette, shapes and per-frame checker.

Like the shapes world, the core knows nothing of it: configs name its rewards by import path
(configs/reward/motion.yaml). Importing this package itself needs only numpy.
"""

from .checker import DEFAULT_PARAMS, STATIC, UNKNOWN, MotionParams, MotionVerdict, check_video, direction_of
from .scene import (
    DIRECTIONS,
    FRAMES,
    MotionSpec,
    Trajectory,
    all_prompts,
    all_specs,
    is_held_out,
    parse_prompt,
    render,
    sample_specs,
    split_prompts,
    trajectory,
)

__all__ = [
    "DEFAULT_PARAMS",
    "DIRECTIONS",
    "FRAMES",
    "STATIC",
    "UNKNOWN",
    "MotionParams",
    "MotionSpec",
    "MotionVerdict",
    "Trajectory",
    "all_prompts",
    "all_specs",
    "check_video",
    "direction_of",
    "is_held_out",
    "parse_prompt",
    "render",
    "sample_specs",
    "split_prompts",
    "trajectory",
]
