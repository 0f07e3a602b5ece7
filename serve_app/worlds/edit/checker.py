"""Does an edited image do what its instruction asked of its source image, and keep the rest?

Both images go through the shapes world's detector (serve_app.worlds.shapes.checker.detect). The
source's objects and the instruction give the expected objects: the recoloured one with its new
colour, the removed one gone, the added one anywhere. An object of the edit *stays in place* when its
box overlaps the source object's box by at least ``min_overlap`` (intersection over union).

- ``edit_ok``: what was asked happened. Recolour: an object of the shape, in the new colour, in the
  old object's place. Add: an object of the asked colour and shape that is none of the source's.
  Remove: no object of the shape left.
- ``kept_ok``: every object the instruction does not touch is there, same colour and shape, in place.
- ``clean``: nothing else: as many objects as expected, none of unknown shape.
- ``strict``: all three. ``partial``: their mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve_app.worlds.shapes.checker import DEFAULT_PARAMS, UNKNOWN, CheckParams, DetectedObject, detect

from .instructions import Instruction, parse_instruction

__all__ = ["EditVerdict", "check_edit"]


@dataclass(frozen=True)
class EditVerdict:
    edit_ok: bool
    kept_ok: bool
    clean: bool
    source: tuple[DetectedObject, ...]
    detected: tuple[DetectedObject, ...]

    @property
    def strict(self) -> bool:
        return self.edit_ok and self.kept_ok and self.clean

    @property
    def partial(self) -> float:
        return (self.edit_ok + self.kept_ok + self.clean) / 3.0


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    (ay0, ax0, ay1, ax1), (by0, bx0, by1, bx1) = a, b
    inter = max(0, min(ay1, by1) - max(ay0, by0)) * max(0, min(ax1, bx1) - max(ax0, bx0))
    union = (ay1 - ay0) * (ax1 - ax0) + (by1 - by0) * (bx1 - bx0) - inter
    return inter / union if union else 0.0


def check_edit(source: np.ndarray, edited: np.ndarray, instruction: str | Instruction, *,
               min_overlap: float = 0.5, params: CheckParams = DEFAULT_PARAMS) -> EditVerdict:
    """Check a uint8 [3, H, W] edit of a uint8 [3, H, W] source against the instruction."""
    parsed = parse_instruction(instruction) if isinstance(instruction, str) else instruction
    before, after = detect(source, params), detect(edited, params)

    def found(colour: str, shape: str, box: tuple[int, int, int, int] | None) -> bool:
        return any(d.colour == colour and d.shape == shape and (box is None or _overlap(d.bbox, box) >= min_overlap)
                   for d in after)

    touched = [o for o in before if o.shape == parsed.shape]
    kept = [o for o in before if o.shape != parsed.shape]
    if parsed.kind == "recolour":
        edit_ok = bool(touched) and all(found(parsed.colour or "", o.shape, o.bbox) for o in touched)
        expected = len(before)
    elif parsed.kind == "add":
        # The added object is one of the asked kind that does not sit where a source object of that kind did.
        edit_ok = any(d.colour == parsed.colour and d.shape == parsed.shape
                      and not any(o.colour == d.colour and o.shape == d.shape and _overlap(d.bbox, o.bbox) >= min_overlap
                                  for o in before) for d in after)
        kept = list(before)
        expected = len(before) + 1
    else:
        edit_ok = not any(d.shape == parsed.shape for d in after)
        expected = len(before) - 1
    kept_ok = all(found(o.colour, o.shape, o.bbox) for o in kept)
    clean = len(after) == expected and all(d.shape != UNKNOWN for d in after)
    return EditVerdict(edit_ok=edit_ok, kept_ok=kept_ok, clean=clean, source=before, detected=after)
