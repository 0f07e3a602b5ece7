"""Rule-based checker of moving-shapes videos: the right object, moving the right way?

Each frame is checked as a one-object scene by the shapes world's checker (serve_app.worlds.shapes.checker:
background found per frame, palette colours, components, shape classification). The subject of a
frame is its largest detected object; its track is the centre of its bounding box frame by frame.
The direction comes from the track's displacement between the first and the last frame:

- ``static`` when it moved less than ``min_travel_frac`` of the frame along either axis;
- ``unknown`` when the subject is missing from a frame, the path is diagonal (off-axis displacement
  above ``max_off_axis`` of the main one) or erratic (net displacement below ``min_straightness``
  of the length of the path, frame to frame: there and back, jumping around);
- otherwise the direction of the main axis and its sign ("left to right": x grows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serve_app.worlds.shapes.checker import DEFAULT_PARAMS as SHAPE_PARAMS
from serve_app.worlds.shapes.checker import UNKNOWN, CheckParams, Verdict, check

from .scene import DIRECTIONS, MotionSpec

STATIC = "static"


@dataclass(frozen=True)
class MotionParams:
    # Net travel below this fraction of the frame side is standing still: 4 px at 32 px, half of the
    # least a rendered object travels (scene.MIN_TRAVEL_FRAC), and more than a bounding box's centre
    # wobbles when a shape is rasterised at another position (1 px).
    min_travel_frac: float = 0.125
    # Off-axis over on-axis displacement above this is a diagonal, which no prompt asks for.
    max_off_axis: float = 0.5
    # Net displacement over path length (the sum of frame-to-frame steps) below this is no straight
    # motion; a straight path at any speed has 1.0, a path that comes back half way 0.5 at most.
    min_straightness: float = 0.75
    # How each frame is read.
    frame: CheckParams = SHAPE_PARAMS


DEFAULT_PARAMS = MotionParams()


@dataclass(frozen=True, eq=False)  # holds an array: compare fields, not verdicts
class MotionVerdict:
    """How a video matches a spec.

    - ``count_ok``: every frame shows exactly one object.
    - ``colour_ok`` / ``shape_ok``: every frame shows the asked colour / shape and no other (the
      shapes checker's sub-scores, frame by frame); a shape it cannot name is "unknown" and fails.
    - ``direction``: where the subject went (one of DIRECTIONS, "static" or "unknown");
      ``direction_ok`` when it is the asked one; ``one_object_direction_ok`` when, besides, every
      frame shows exactly one object.
    - ``strict``: every frame is strictly right and the direction is.
    - ``partial``: mean of the colour, shape and direction sub-scores.
    """

    count_ok: bool
    colour_ok: bool
    shape_ok: bool
    direction_ok: bool
    strict: bool
    direction: str
    frames: tuple[Verdict, ...]
    track: np.ndarray | None  # [F, 2] (y, x) centres of the subject's box; None if lost in a frame

    @property
    def one_object_direction_ok(self) -> bool:
        """The asked direction with exactly one object in every frame: the direction follows the largest
        object, so a second blob or a smear beside it would otherwise go unnoticed."""
        return self.direction_ok and self.count_ok

    @property
    def partial(self) -> float:
        return (self.colour_ok + self.shape_ok + self.direction_ok) / 3.0


def check_video(video: np.ndarray, spec: MotionSpec, params: MotionParams = DEFAULT_PARAMS) -> MotionVerdict:
    """Check a uint8 [F, 3, H, W] video (F >= 2) against ``spec``."""
    if video.ndim != 4 or video.shape[1] != 3 or video.dtype != np.uint8 or video.shape[0] < 2:
        raise ValueError(f"video must be uint8 [F, 3, H, W] with F >= 2, got {video.dtype} {video.shape}")
    frames = tuple(check(frame, spec.scene, params.frame) for frame in video)
    track = subject_track(frames)
    direction = UNKNOWN if track is None else direction_of(track, min(video.shape[2:]), params)
    direction_ok = direction == spec.direction
    return MotionVerdict(
        count_ok=all(v.count_ok for v in frames),
        colour_ok=all(v.colour_ok for v in frames),
        shape_ok=all(v.shape_ok for v in frames),
        direction_ok=direction_ok,
        strict=direction_ok and all(v.strict for v in frames),
        direction=direction,
        frames=frames,
        track=track,
    )


def subject_track(frames: tuple[Verdict, ...]) -> np.ndarray | None:
    """[F, 2] (y, x) centre of each frame's largest object's bounding box; None if a frame has none."""
    centres = []
    for verdict in frames:
        if not verdict.detected:
            return None
        y0, x0, y1, x1 = max(verdict.detected, key=lambda d: d.area).bbox
        centres.append(((y0 + y1) / 2, (x0 + x1) / 2))
    return np.array(centres, dtype=np.float64)


def direction_of(track: np.ndarray, size: int, params: MotionParams = DEFAULT_PARAMS) -> str:
    """The direction of a [F, 2] (y, x) track in a frame of ``size`` px (see the module's docstring)."""
    net = track[-1] - track[0]
    axis = int(np.abs(net).argmax())  # 0: vertical, 1: horizontal
    travel = abs(float(net[axis]))
    if travel < params.min_travel_frac * size:
        return STATIC
    if abs(float(net[1 - axis])) > params.max_off_axis * travel:
        return UNKNOWN
    path = float(np.linalg.norm(np.diff(track, axis=0), axis=1).sum())
    if float(np.linalg.norm(net)) < params.min_straightness * path:
        return UNKNOWN
    step = [0, 0]
    step[axis] = 1 if net[axis] > 0 else -1
    return next(name for name, unit in DIRECTIONS.items() if list(unit) == step)


__all__ = ["DEFAULT_PARAMS", "STATIC", "UNKNOWN", "MotionParams", "MotionVerdict", "check_video", "direction_of",
           "subject_track"]
