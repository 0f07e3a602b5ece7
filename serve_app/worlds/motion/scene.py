"""Moving-shapes world: prompts of one coloured shape moving one way, and a renderer of their videos.

Grammar (lower case; the parser also accepts any case, extra spaces and a trailing period)::

    prompt    := "a" COLOUR SHAPE "moving" DIRECTION
    DIRECTION := "left to right" | "right to left" | "top to bottom" | "bottom to top"

Colours, shapes, the background and the drawing of a shape are the shapes world's
(serve_app.worlds.shapes.scene): a frame of this world is a one-object scene of that world, so its checker
reads the frames.

Held-out compositions: (colour, shape, direction) triples with (colour + shape + direction) % 4 == 0
over their vocabulary indices - one direction of every (colour, shape), 12 of 48 prompts. Every pair
of attributes (colour-shape, colour-direction, shape-direction) still occurs in training, so a
held-out prompt asks for a new combination of things seen together, never for an unseen pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from serve_app.worlds.shapes.scene import BACKGROUND, COLOURS, SHAPES, SIZE_RANGE, SceneObject, SceneSpec, shape_mask

# Unit steps (dy, dx) in image coordinates (y grows downwards).
DIRECTIONS: dict[str, tuple[int, int]] = {
    "left to right": (0, 1),
    "right to left": (0, -1),
    "top to bottom": (1, 0),
    "bottom to top": (-1, 0),
}
FRAMES = 8
# Distance travelled from the first to the last frame, as a fraction of the image side: at least
# twice the checker's threshold for "static" (see checker.MotionParams.min_travel_frac), so a
# rendered video is never near it; at most what the object's free room allows.
MIN_TRAVEL_FRAC = 0.25

_PROMPT = re.compile(r"a (\w+) (\w+) moving (.+)")


@dataclass(frozen=True)
class MotionSpec:
    """What a video shows: one object of the shapes world moving in one direction."""

    obj: SceneObject
    direction: str

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"unknown direction {self.direction!r}; known: {', '.join(DIRECTIONS)}")

    @classmethod
    def of(cls, colour: str, shape: str, direction: str) -> MotionSpec:
        return cls(SceneObject(colour, shape), direction)

    @property
    def scene(self) -> SceneSpec:
        """What every frame shows, as a shapes-world scene."""
        return SceneSpec((self.obj,))

    def prompt(self) -> str:
        return f"a {self.obj.colour} {self.obj.shape} moving {self.direction}"


def parse_prompt(text: str) -> MotionSpec:
    """Parse a prompt of the grammar above; ValueError names the offending word."""
    norm = re.sub(r"\s+", " ", text.strip().lower()).removesuffix(".").strip()
    match = _PROMPT.fullmatch(norm)
    if not match:
        raise ValueError(f"prompt {text!r} is not 'a <colour> <shape> moving <direction>'")
    colour, shape, direction = match.groups()
    if colour not in COLOURS:
        raise ValueError(f"unknown colour {colour!r} in {text!r}; known: {', '.join(COLOURS)}")
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r} in {text!r}; known: {', '.join(SHAPES)}")
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r} in {text!r}; known: {', '.join(DIRECTIONS)}")
    return MotionSpec.of(colour, shape, direction)


def all_specs() -> list[MotionSpec]:
    """Every video of the grammar once, in vocabulary order (colour, then shape, then direction)."""
    return [MotionSpec.of(c, s, d) for c in COLOURS for s in SHAPES for d in DIRECTIONS]


def all_prompts() -> list[str]:
    """The 48 prompts: 4 colours x 3 shapes x 4 directions."""
    return [s.prompt() for s in all_specs()]


def is_held_out(prompt: str | MotionSpec) -> bool:
    """Whether a composition is held out of training (see the module's docstring)."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    index = list(COLOURS).index(spec.obj.colour) + SHAPES.index(spec.obj.shape) + list(DIRECTIONS).index(spec.direction)
    return index % 4 == 0


def split_prompts() -> tuple[list[str], list[str]]:
    """(train, held_out) partition of all_prompts(): 36 and 12 prompts."""
    prompts = all_prompts()
    return [p for p in prompts if not is_held_out(p)], [p for p in prompts if is_held_out(p)]


def sample_specs(rng: np.random.Generator, n: int, prompts: Sequence[str] | None = None) -> list[MotionSpec]:
    """``n`` specs drawn uniformly (with replacement) from ``prompts`` (default all_prompts())."""
    pool = list(all_prompts() if prompts is None else prompts)
    if not pool:
        raise ValueError("no prompts to sample from")
    return [parse_prompt(pool[i]) for i in rng.integers(0, len(pool), size=n)]


@dataclass(frozen=True)
class Trajectory:
    """Where the object's box is in each frame: top-left corners [F, 2] (y, x) of a square of ``side`` px."""

    corners: np.ndarray
    side: int


def trajectory(direction: str, rng: np.random.Generator, *, frames: int = FRAMES, size: int = 32,
               sides: Sequence[int] | None = None, min_travel_frac: float = MIN_TRAVEL_FRAC,
               grid: int = 1) -> Trajectory:
    """A seeded straight path at constant speed: side from the shapes world's SIZE_RANGE (or one of
    ``sides``), travel from ``min_travel_frac`` of the image to all the room the object has, start and
    cross position anywhere that keeps the whole object inside every frame (a shape cut by the border
    is no shape). ``grid`` > 1 puts travel, start and cross position on multiples of ``grid`` px: a
    narrower distribution of videos, for pretraining (as the shapes world's grid)."""
    if frames < 2:
        raise ValueError(f"a video needs at least 2 frames to move, got {frames}")
    dy, dx = DIRECTIONS[direction]
    if sides:
        side = int(sides[int(rng.integers(0, len(sides)))])
    else:
        lo, hi = (max(3, round(f * size)) for f in SIZE_RANGE)
        side = int(rng.integers(lo, hi + 1))
    room = size - side
    min_travel = round(min_travel_frac * size)
    if room < min_travel:
        raise ValueError(f"a {size} px frame leaves no room for a {side} px object to travel {min_travel} px")
    g = grid
    travel = g * int(rng.integers(-(-min_travel // g), room // g + 1))
    start = g * int(rng.integers(0, (room - travel) // g + 1))
    cross = g * int(rng.integers(0, room // g + 1))
    # Positions along the path from the near edge's side; a negative step runs it from the far end.
    along = np.rint(start + travel * np.linspace(0.0, 1.0, frames)).astype(int)
    if dy + dx < 0:
        along = room - along
    across = np.full(frames, cross)
    corners = np.stack([along, across] if dy else [across, along], axis=1)
    return Trajectory(corners, side)


def render(spec: MotionSpec, rng: np.random.Generator, *, frames: int = FRAMES, size: int = 32,
           sides: Sequence[int] | None = None, min_travel_frac: float = MIN_TRAVEL_FRAC, grid: int = 1) -> np.ndarray:
    """uint8 [frames, 3, size, size]: the object drawn along a seeded :func:`trajectory` (its keyword
    arguments) on the background."""
    path = trajectory(spec.direction, rng, frames=frames, size=size, sides=sides, min_travel_frac=min_travel_frac,
                      grid=grid)
    mask = shape_mask(spec.obj.shape, path.side, path.side)
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    video[:] = BACKGROUND
    for frame, (y, x) in zip(video, path.corners):
        frame[y : y + path.side, x : x + path.side][mask] = COLOURS[spec.obj.colour]
    return np.ascontiguousarray(video.transpose(0, 3, 1, 2))
