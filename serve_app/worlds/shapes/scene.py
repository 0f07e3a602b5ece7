"""Shapes world: a finite prompt grammar, its scene specs and a procedural renderer.

Grammar (lower case; the parser also accepts any case, extra spaces and a trailing period)::

    prompt := phrase (" and " phrase)*        # at most MAX_OBJECTS objects in all
    phrase := "a" COLOUR SHAPE | "one" COLOUR SHAPE | "two" COLOUR SHAPE "s"

``prompt()`` writes "a" for one ("one" is parsed as a synonym), so canonical prompts round-trip.
A kind (colour, shape) appears in one phrase only: "a red circle and a red circle" is rejected in
favour of "two red circles". With MAX_OBJECTS = 2 the prompts are one or two objects of a kind
("a red circle", "two red circles") or two objects of different kinds ("a red circle and a
green triangle").
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Saturated but not extreme values: far apart from each other and from the background, so a
# checker can tell them apart with a wide tolerance even on imperfect model outputs.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 190, 60),
    "blue": (50, 80, 230),
    "yellow": (230, 210, 40),
}
BACKGROUND: tuple[int, int, int] = (24, 24, 24)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two"}
MAX_OBJECTS = 2
# Object size range at 32 px, as fractions of the image side (10-16 px): big enough that the
# three shapes stay distinguishable after rasterisation.
SIZE_RANGE: tuple[float, float] = (10 / 32, 16 / 32)
# Blank pixels kept between objects' bounding boxes so that they never touch, even 8-connected.
OBJECT_GAP = 2
HELD_OUT_PERCENT = 20
_SPLIT_SALT = "shapes-world-v1"

_PARSE_COUNTS = {"a": 1, "one": 1, "two": 2}


@dataclass(frozen=True)
class SceneObject:
    colour: str
    shape: str

    def __post_init__(self) -> None:
        if self.colour not in COLOURS:
            raise ValueError(f"unknown colour {self.colour!r}; known: {', '.join(COLOURS)}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; known: {', '.join(SHAPES)}")

    def sort_key(self) -> tuple[int, int]:
        return (list(COLOURS).index(self.colour), SHAPES.index(self.shape))


@dataclass(frozen=True)
class SceneSpec:
    """What a scene contains: objects in prompt order (a tuple, so relations can index it later)."""

    objects: tuple[SceneObject, ...]

    def __post_init__(self) -> None:
        if not 1 <= len(self.objects) <= MAX_OBJECTS:
            raise ValueError(f"a scene has 1 to {MAX_OBJECTS} objects, got {len(self.objects)}")

    @classmethod
    def of(cls, *items: tuple[str, str, int]) -> SceneSpec:
        """``SceneSpec.of(("red", "circle", 2), ("blue", "square", 1))``."""
        return cls(tuple(SceneObject(c, s) for c, s, n in items for _ in range(n)))

    def kinds(self) -> dict[SceneObject, int]:
        """Count per kind, in order of first appearance."""
        return dict(Counter(self.objects))

    def canonical(self) -> SceneSpec:
        """Same scene with objects in vocabulary order: equal scenes give equal canonical specs."""
        return SceneSpec(tuple(sorted(self.objects, key=SceneObject.sort_key)))

    def prompt(self) -> str:
        phrases = []
        for obj, n in self.kinds().items():
            if n not in COUNT_WORDS:
                raise ValueError(f"no count word for {n} x {obj.colour} {obj.shape}")
            phrases.append(f"{COUNT_WORDS[n]} {obj.colour} {obj.shape}{'s' if n > 1 else ''}")
        return " and ".join(phrases)


def parse_prompt(text: str) -> SceneSpec:
    """Parse a prompt of the grammar above; ValueError names the offending phrase or word."""
    norm = re.sub(r"\s+", " ", text.strip().lower()).removesuffix(".").strip()
    if not norm:
        raise ValueError("empty prompt")
    objects: list[SceneObject] = []
    seen: set[SceneObject] = set()
    for phrase in norm.split(" and "):
        words = phrase.split(" ")
        if len(words) != 3:
            raise ValueError(f"phrase {phrase!r} in {text!r} is not '<count> <colour> <shape>'")
        count_word, colour, noun = words
        if count_word not in _PARSE_COUNTS:
            raise ValueError(f"unknown count {count_word!r} in {text!r}; known: {', '.join(_PARSE_COUNTS)}")
        n = _PARSE_COUNTS[count_word]
        if colour not in COLOURS:
            raise ValueError(f"unknown colour {colour!r} in {text!r}; known: {', '.join(COLOURS)}")
        shape = noun[:-1] if n > 1 and noun.endswith("s") else noun
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {noun!r} in {text!r}; known: {', '.join(SHAPES)}")
        if (n > 1) != (noun != shape):
            raise ValueError(f"count {count_word!r} does not agree with {noun!r} in {text!r}")
        obj = SceneObject(colour, shape)
        if obj in seen:
            raise ValueError(f"{colour} {shape} named twice in {text!r}; use one phrase with a count")
        seen.add(obj)
        objects.extend([obj] * n)
    if len(objects) > MAX_OBJECTS:
        raise ValueError(f"{text!r} asks for {len(objects)} objects; at most {MAX_OBJECTS}")
    return SceneSpec(tuple(objects))


def all_specs() -> list[SceneSpec]:
    """Every scene of the grammar, once, in canonical form and a fixed order."""
    kinds = [SceneObject(c, s) for c in COLOURS for s in SHAPES]
    specs: list[SceneSpec] = []
    for total in range(1, MAX_OBJECTS + 1):
        for combo in itertools.combinations_with_replacement(kinds, total):
            specs.append(SceneSpec(tuple(combo)))
    return specs


def all_prompts() -> list[str]:
    """The finite prompt set (canonical forms): 24 single-kind + 66 two-kind prompts."""
    return [s.prompt() for s in all_specs()]


def is_held_out(prompt: str | SceneSpec) -> bool:
    """Deterministic ~HELD_OUT_PERCENT% split; word order in mixed prompts does not matter."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    digest = hashlib.sha256(f"{_SPLIT_SALT}:{spec.canonical().prompt()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < HELD_OUT_PERCENT


def split_prompts() -> tuple[list[str], list[str]]:
    """(train, held_out) partition of all_prompts()."""
    prompts = all_prompts()
    return [p for p in prompts if not is_held_out(p)], [p for p in prompts if is_held_out(p)]


def sample_specs(rng: np.random.Generator, n: int, prompts: Sequence[str] | None = None) -> list[SceneSpec]:
    """``n`` specs drawn uniformly (with replacement) from ``prompts`` (default all_prompts())."""
    pool = list(all_prompts() if prompts is None else prompts)
    if not pool:
        raise ValueError("no prompts to sample from")
    return [parse_prompt(pool[i]) for i in rng.integers(0, len(pool), size=n)]


def shape_mask(shape: str, h: int, w: int) -> np.ndarray:
    """Boolean [h, w] rasterisation filling its box edge to edge; shared with the checker's templates."""
    y = np.arange(h)[:, None] + 0.5
    x = np.arange(w)[None, :] + 0.5
    if shape == "square":
        return np.ones((h, w), dtype=bool)
    if shape == "circle":
        return ((x - w / 2) / (w / 2)) ** 2 + ((y - h / 2) / (h / 2)) ** 2 <= 1.0
    if shape == "triangle":
        # Upright isosceles; testing each row at its lower pixel edge (y + 0.5) puts a pixel in the
        # top row too, so the triangle spans the whole box like the other shapes.
        return np.abs(x - w / 2) <= (w / 2) * (y + 0.5) / h
    raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")


def _separated(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
    (ya, xa, sa), (yb, xb, sb) = a, b
    g = OBJECT_GAP
    return ya + sa + g <= yb or yb + sb + g <= ya or xa + sa + g <= xb or xb + sb + g <= xa


def place_boxes(rng: np.random.Generator, n: int, size: int, grid: int = 1, sizes: Sequence[int] | None = None,
                existing: Sequence[tuple[int, int, int]] = ()) -> list[tuple[int, int, int]]:
    """``n`` new (y, x, side) boxes, kept OBJECT_GAP px apart from each other and from ``existing``."""
    lo, hi = (max(3, round(f * size)) for f in SIZE_RANGE)
    for _ in range(1000):
        boxes: list[tuple[int, int, int]] = list(existing)
        for _ in range(n):
            s = int(rng.choice(sizes)) if sizes else int(rng.integers(lo, hi + 1))
            y, x = (grid * int(v) for v in rng.integers(0, (size - s) // grid + 1, size=2))
            if not all(_separated((y, x, s), b) for b in boxes):
                break
            boxes.append((y, x, s))
        if len(boxes) == len(existing) + n:
            return boxes[len(existing):]
    raise RuntimeError(f"could not place {n} objects of {lo}-{hi} px in a {size} px image beside {len(existing)}")


def draw(objects: Sequence[SceneObject], boxes: Sequence[tuple[int, int, int]], size: int = 32) -> np.ndarray:
    """uint8 [3, size, size]: the background with each object filling its (y, x, side) box."""
    img = np.empty((size, size, 3), dtype=np.uint8)
    img[:] = BACKGROUND
    for obj, (y, x, s) in zip(objects, boxes, strict=True):
        region = img[y : y + s, x : x + s]
        region[shape_mask(obj.shape, s, s)] = COLOURS[obj.colour]
    return np.ascontiguousarray(img.transpose(2, 0, 1))


def render(spec: SceneSpec, rng: np.random.Generator, size: int = 32, *, grid: int = 1,
           sizes: Sequence[int] | None = None) -> np.ndarray:
    """uint8 [3, size, size]: background plus each object at a random size and position, boxes apart.

    By default sizes are drawn from SIZE_RANGE and positions from every pixel. ``grid`` puts the
    boxes' corners on multiples of ``grid`` px and ``sizes`` lists the allowed sides: pretraining
    aligns objects with the model's 4-px image tokens, so that a token is inside, outside or on a
    fixed piece of an edge - geometry a 2.5M-parameter model can learn in minutes on a CPU.
    """
    return draw(spec.objects, place_boxes(rng, len(spec.objects), size, grid, sizes), size)
