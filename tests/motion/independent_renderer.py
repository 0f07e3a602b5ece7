"""A second moving-shapes renderer, written apart from serve_app/worlds/motion/scene.py, to test the checker on.

It shares only the vocabulary (colour names and nominal RGB, shape names, direction names) with the
world's renderer, and draws its shapes with the shapes tests' independent renderer
(tests/shapes/independent_renderer.py: PIL, 8-20 px, triangles isosceles or equilateral pointing
any way, palettes off by up to +-30 per channel, white, black, grey or coloured backgrounds).
What differs for motion:

- the object is drawn once by PIL as a sprite and pasted at each frame's position;
- speed: a real number of px per frame and positions rounded down, so the steps are uneven
  (1, 2, 1, 2 px ...); travel from MIN_TRAVEL px to all the room the object has;
- the path drifts across the direction of motion by up to MAX_DRIFT px in all;
- directions are unit vectors of its own (x right, y down), not the world's table.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
from PIL import Image, ImageDraw

from serve_app.worlds.motion.scene import MotionSpec
from serve_app.worlds.shapes.scene import COLOURS

MIN_TRAVEL = 6
MAX_DRIFT = 2
# (x, y) unit vectors: x to the right, y downwards.
HEADINGS = {"left to right": (1, 0), "right to left": (-1, 0), "top to bottom": (0, 1), "bottom to top": (0, -1)}


def _shapes_renderer() -> ModuleType:
    """tests/shapes/independent_renderer.py, loaded by path (test folders are not packages)."""
    name = "shapes_independent_renderer"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "shapes" / "independent_renderer.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass(frozen=True)
class DrawnVideo:
    video: np.ndarray  # uint8 [F, 3, H, W]
    background: tuple[int, int, int]
    side: int
    style: str  # how a triangle was drawn ("equilateral left", ...); "" otherwise
    travel: float  # px from the first to the last frame along the heading
    drift: int  # px across it


def draw_video(spec: MotionSpec, rng: np.random.Generator, frames: int, size: int = 32) -> DrawnVideo:
    shapes = _shapes_renderer()
    background = shapes.draw_background(rng)
    rgb = shapes.jittered(COLOURS[spec.obj.colour], rng)
    side = int(rng.integers(shapes.MIN_SIDE, shapes.MAX_SIDE + 1))
    sprite = Image.new("L", (side, side), 0)
    style = shapes.draw_shape(ImageDraw.Draw(sprite), spec.obj.shape, (0, 0, side, side), 255, rng)
    mask = np.asarray(sprite) > 0

    room = size - side
    travel = float(rng.uniform(MIN_TRAVEL, room))
    drift = int(rng.integers(-MAX_DRIFT, MAX_DRIFT + 1))
    ux, uy = HEADINGS[spec.direction]
    # Along the heading: from a start that leaves room for the travel; across it: anywhere the drift fits.
    lead = float(rng.uniform(0, room - travel))
    across = int(rng.integers(max(0, -drift), room - max(0, drift) + 1))
    canvas = np.empty((frames, size, size, 3), dtype=np.uint8)
    canvas[:] = background
    for i, frame in enumerate(canvas):
        t = i / (frames - 1)
        along = int(lead + travel * t)
        if ux + uy < 0:  # heading left or up: run the same path from the far side
            along = room - along
        side_step = across + int(round(drift * t))
        x, y = (along, side_step) if ux else (side_step, along)
        frame[y : y + side, x : x + side][mask] = rgb
    video = np.ascontiguousarray(canvas.transpose(0, 3, 1, 2))
    return DrawnVideo(video, background, side, style, travel, drift)
