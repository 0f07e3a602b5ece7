"""Editing world: a shapes-world scene, an instruction, and the scene the instruction asks for.

Grammar (lower case; the parser also accepts any case, extra spaces and a trailing period)::

    instruction := "make the" SHAPE COLOUR      # recolour the object of that shape
                 | "add a" COLOUR SHAPE         # one more object, anywhere it fits
                 | "remove the" SHAPE           # take the object of that shape away

A source scene holds one or two objects of different shapes (so "the square" names one object),
on the shapes world's palette, background and 8-px grid. An instruction applies to a scene when its
shape is there (recolour, remove) or not (add), the recolour changes the colour, an addition leaves
two objects and a removal one: a result always holds one or two objects of different shapes.

Held out: six instructions whose verb, colour and shape each occur in other training instructions
(recolour a circle yellow, a square blue, a triangle green; add a blue circle, a yellow triangle, a
red square). Neither pretraining nor RL sees them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from serve_app.worlds.shapes.scene import COLOURS, SHAPES, SceneObject, draw, place_boxes

__all__ = ["EDIT_KINDS", "HELD_OUT", "Box", "EditExample", "Instruction", "PlacedObject", "Scene", "all_instructions",
           "applicable", "edit_examples", "is_held_out", "parse_instruction", "sample_example", "split_instructions"]

EditKind = Literal["recolour", "add", "remove"]
EDIT_KINDS: tuple[EditKind, ...] = ("recolour", "add", "remove")
Box = tuple[int, int, int]  # y, x, side in px
# The shapes world's pretraining geometry: corners on an 8-px grid, sides of 12 or 16 px (3 x 3 places).
GRID = 8
SIDES: tuple[int, ...] = (12, 16)
IMAGE_SIZE = 32

HELD_OUT: frozenset[str] = frozenset({
    "make the circle yellow", "make the square blue", "make the triangle green",
    "add a blue circle", "add a yellow triangle", "add a red square",
})


@dataclass(frozen=True)
class Instruction:
    kind: EditKind
    shape: str
    colour: str | None = None  # the new colour (recolour) or the added object's (add); None for remove

    def __post_init__(self) -> None:
        if self.kind not in EDIT_KINDS:
            raise ValueError(f"unknown edit {self.kind!r}; known: {', '.join(EDIT_KINDS)}")
        SceneObject(self.colour or next(iter(COLOURS)), self.shape)  # names an unknown colour or shape
        if (self.colour is None) != (self.kind == "remove"):
            raise ValueError(f"a {self.kind} instruction {'takes no' if self.kind == 'remove' else 'needs a'} colour")

    def text(self) -> str:
        if self.kind == "recolour":
            return f"make the {self.shape} {self.colour}"
        if self.kind == "add":
            return f"add a {self.colour} {self.shape}"
        return f"remove the {self.shape}"


_PATTERNS = (
    ("recolour", re.compile(r"make the (?P<shape>\w+) (?P<colour>\w+)")),
    ("add", re.compile(r"add an? (?P<colour>\w+) (?P<shape>\w+)")),
    ("remove", re.compile(r"remove the (?P<shape>\w+)")),
)


def parse_instruction(text: str) -> Instruction:
    """Parse an instruction of the grammar above; ValueError names what does not fit."""
    norm = re.sub(r"\s+", " ", text.strip().lower()).removesuffix(".").strip()
    for kind, pattern in _PATTERNS:
        match = pattern.fullmatch(norm)
        if match:
            try:
                return Instruction(kind, match["shape"], match.groupdict().get("colour"))  # type: ignore[arg-type]
            except ValueError as exc:
                raise ValueError(f"{text!r}: {exc}") from None
    raise ValueError(f"{text!r} is not 'make the <shape> <colour>', 'add a <colour> <shape>' or 'remove the <shape>'")


def all_instructions() -> list[str]:
    """Every instruction of the grammar, in a fixed order: 12 recolours, 12 additions, 3 removals."""
    return ([Instruction("recolour", s, c).text() for s in SHAPES for c in COLOURS]
            + [Instruction("add", s, c).text() for c in COLOURS for s in SHAPES]
            + [Instruction("remove", s).text() for s in SHAPES])


def is_held_out(instruction: str | Instruction) -> bool:
    parsed = parse_instruction(instruction) if isinstance(instruction, str) else instruction
    return parsed.text() in HELD_OUT


def split_instructions() -> tuple[list[str], list[str]]:
    """(train, held_out) partition of all_instructions()."""
    texts = all_instructions()
    return [t for t in texts if not is_held_out(t)], [t for t in texts if is_held_out(t)]


@dataclass(frozen=True)
class PlacedObject:
    colour: str
    shape: str
    box: Box

    def kind(self) -> SceneObject:
        return SceneObject(self.colour, self.shape)


@dataclass(frozen=True)
class Scene:
    """Objects with their boxes, on IMAGE_SIZE px."""

    objects: tuple[PlacedObject, ...]

    def shapes(self) -> set[str]:
        return {o.shape for o in self.objects}

    def render(self) -> np.ndarray:
        """uint8 [3, IMAGE_SIZE, IMAGE_SIZE]."""
        return draw([o.kind() for o in self.objects], [o.box for o in self.objects], IMAGE_SIZE)


def applicable(instruction: Instruction, scene: Scene) -> bool:
    """Whether the instruction asks for a change this scene allows (see the module's docstring)."""
    present = {o.shape: o for o in scene.objects}
    if instruction.kind == "recolour":
        return instruction.shape in present and present[instruction.shape].colour != instruction.colour
    if instruction.kind == "add":
        return instruction.shape not in present and len(scene.objects) == 1
    return instruction.shape in present and len(scene.objects) == 2


@dataclass(frozen=True)
class EditExample:
    instruction: Instruction
    source: Scene
    target: Scene  # one scene the instruction allows (an addition may go anywhere it fits)


def _apply(instruction: Instruction, source: Scene, rng: np.random.Generator, room: Box | None) -> Scene:
    if instruction.kind == "recolour":
        return Scene(tuple(replace(o, colour=instruction.colour) if o.shape == instruction.shape else o
                           for o in source.objects))
    if instruction.kind == "remove":
        return Scene(tuple(o for o in source.objects if o.shape != instruction.shape))
    assert instruction.colour is not None
    existing = [o.box for o in source.objects]
    box = room if room is not None else place_boxes(rng, 1, IMAGE_SIZE, GRID, SIDES, existing=existing)[0]
    return Scene(source.objects + (PlacedObject(instruction.colour, instruction.shape, box),))


def sample_example(instruction: str | Instruction, rng: np.random.Generator) -> EditExample:
    """A random source scene the instruction applies to, and a target it allows. A source for an
    addition is drawn as two objects with one taken away, so there is room for the new one, which
    the target puts at a random free place."""
    parsed = parse_instruction(instruction) if isinstance(instruction, str) else instruction
    colours, shapes = list(COLOURS), list(SHAPES)
    while True:
        count = 1 if parsed.kind == "add" else 2 if parsed.kind == "remove" else int(rng.integers(1, 3))
        picked = [shapes[i] for i in rng.permutation(len(shapes))[:count]]
        if parsed.kind == "recolour" and parsed.shape not in picked:
            picked[int(rng.integers(count))] = parsed.shape
        boxes = place_boxes(rng, 2 if parsed.kind == "add" else count, IMAGE_SIZE, GRID, SIDES)
        objects = tuple(PlacedObject(colours[int(rng.integers(len(colours)))], shape, box)
                        for shape, box in zip(picked, boxes))
        source = Scene(objects)
        if applicable(parsed, source):
            room = boxes[1] if parsed.kind == "add" and rng.random() < 0.5 else None
            return EditExample(parsed, source, _apply(parsed, source, rng, room))


def edit_examples(instructions: list[str], per_instruction: int, seed: int) -> list[EditExample]:
    """``per_instruction`` examples of each instruction, in order, from one seeded generator."""
    rng = np.random.default_rng(seed)
    return [sample_example(text, rng) for text in instructions for _ in range(per_instruction)]
