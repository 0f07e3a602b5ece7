"""A second shapes-world renderer, written apart from serve_app/worlds/shapes/scene.py, to test the checker on.

It shares only the vocabulary (colour names and their nominal RGB, shape names) with the world's
renderer and draws differently on purpose:

- drawing: PIL.ImageDraw (ellipse, rectangle, polygon with float vertices), not scene.shape_mask;
- layout: any position and any side from 8 to 20 px; objects are kept apart by a rule of their own
  (bounding boxes at least 1 px apart, so no two objects touch, even diagonally);
- triangles: isosceles filling their box or equilateral (height = side x sqrt(3)/2), pointing up,
  down, left or right;
- palette: each object's RGB is its colour's nominal RGB moved by up to +-30 per channel;
- background: one uniform colour per scene - white, black, a grey or any colour - at least
  BACKGROUND_MIN_DISTANCE (RGB) from every nominal object colour, so that a jittered object
  (at most sqrt(3) x 30 = 52 from nominal) stays at least 68 from it.

Edges are hard (no anti-aliasing): a blurred edge is what the checker calls "not a clean shape".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from serve_app.worlds.shapes.scene import COLOURS, SceneSpec

MIN_SIDE, MAX_SIDE = 8, 20
JITTER = 30
BACKGROUND_MIN_DISTANCE = 120.0
ORIENTATIONS = ("up", "down", "left", "right")


@dataclass(frozen=True)
class DrawnObject:
    colour: str
    shape: str
    side: int
    rgb: tuple[int, int, int]
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (exclusive ends)
    style: str  # how a triangle was drawn ("isosceles up", "equilateral left", ...); "" otherwise


@dataclass(frozen=True)
class DrawnScene:
    image: np.ndarray  # uint8 [3, H, W]
    background: tuple[int, int, int]
    objects: tuple[DrawnObject, ...]


def draw_scene(spec: SceneSpec, rng: np.random.Generator, size: int = 32) -> DrawnScene:
    background = draw_background(rng)
    canvas = Image.new("RGB", (size, size), background)
    pen = ImageDraw.Draw(canvas)
    drawn = []
    for obj, box in zip(spec.objects, free_layout(rng, len(spec.objects), size)):
        rgb = jittered(COLOURS[obj.colour], rng)
        style = draw_shape(pen, obj.shape, box, rgb, rng)
        drawn.append(DrawnObject(obj.colour, obj.shape, box[2] - box[0], rgb, box, style))
    image = np.ascontiguousarray(np.asarray(canvas).transpose(2, 0, 1))
    return DrawnScene(image, background, tuple(drawn))


def draw_background(rng: np.random.Generator) -> tuple[int, int, int]:
    """White, black, a grey or any colour (a quarter each), redrawn while too close to an object colour."""
    while True:
        kind = rng.integers(4)
        if kind == 0:
            rgb = (255, 255, 255)
        elif kind == 1:
            rgb = (0, 0, 0)
        elif kind == 2:
            rgb = (int(rng.integers(256)),) * 3
        else:
            rgb = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if min(math.dist(rgb, nominal) for nominal in COLOURS.values()) >= BACKGROUND_MIN_DISTANCE:
            return rgb


def jittered(nominal: tuple[int, int, int], rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(np.clip(v + rng.integers(-JITTER, JITTER + 1), 0, 255)) for v in nominal)


def free_layout(rng: np.random.Generator, n: int, size: int) -> list[tuple[int, int, int, int]]:
    """Square boxes (x0, y0, x1, y1) of random sides anywhere in the image, at least 1 px apart."""
    for _ in range(10_000):
        boxes: list[tuple[int, int, int, int]] = []
        for _ in range(n):
            side = int(rng.integers(MIN_SIDE, MAX_SIDE + 1))
            x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
            box = (x0, y0, x0 + side, y0 + side)
            if any(not _apart(box, other) for other in boxes):
                break
            boxes.append(box)
        if len(boxes) == n:
            return boxes
    raise RuntimeError(f"no free layout of {n} objects in {size} px")


def _apart(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[2] < b[0] or b[2] < a[0] or a[3] < b[1] or b[3] < a[1]


def draw_shape(pen: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], rgb: tuple[int, int, int],
               rng: np.random.Generator) -> str:
    # PIL's ellipse and rectangle include their right and bottom coordinates: a side of s spans s - 1.
    x0, y0, x1, y1 = box
    if shape == "circle":
        pen.ellipse((x0, y0, x1 - 1, y1 - 1), fill=rgb)
        return ""
    if shape == "square":
        pen.rectangle((x0, y0, x1 - 1, y1 - 1), fill=rgb)
        return ""
    kind = ("isosceles", "equilateral")[int(rng.integers(2))]
    orientation = ORIENTATIONS[int(rng.integers(len(ORIENTATIONS)))]
    pen.polygon(triangle_vertices(box, kind, orientation), fill=rgb)
    return f"{kind} {orientation}"


def triangle_vertices(box: tuple[int, int, int, int], kind: str, orientation: str) -> list[tuple[float, float]]:
    """A triangle with its base along one side of the box, centred in it. PIL fills the pixels whose
    integer coordinates lie inside the polygon, edges included: a box of s pixels spans s - 1."""
    x0, y0, x1, _ = box
    span = x1 - x0 - 1
    height = span if kind == "isosceles" else span * math.sqrt(3) / 2
    inset = (span - height) / 2
    # Pointing up in box-local coordinates, then turned.
    local = [(span / 2, inset), (0.0, span - inset), (float(span), span - inset)]
    turned = {
        "up": lambda u, v: (u, v),
        "down": lambda u, v: (u, span - v),
        "left": lambda u, v: (v, u),
        "right": lambda u, v: (span - v, u),
    }[orientation]
    return [(x0 + u, y0 + v) for u, v in (turned(*p) for p in local)]
