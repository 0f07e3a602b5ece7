import itertools

import numpy as np
import pytest

from serve_app.worlds.motion import (
    DIRECTIONS,
    FRAMES,
    MotionSpec,
    all_prompts,
    all_specs,
    is_held_out,
    parse_prompt,
    render,
    split_prompts,
)
from serve_app.worlds.motion.scene import MIN_TRAVEL_FRAC, trajectory
from serve_app.worlds.shapes import BACKGROUND, COLOURS, SHAPES


def test_prompts_cover_the_grammar_once_and_round_trip():
    prompts = all_prompts()
    assert len(prompts) == len(set(prompts)) == len(COLOURS) * len(SHAPES) * len(DIRECTIONS) == 48
    for spec in all_specs():
        assert parse_prompt(spec.prompt()) == spec
    assert parse_prompt("  A Red   CIRCLE moving Left To Right. ") == MotionSpec.of("red", "circle", "left to right")


@pytest.mark.parametrize("bad, word", [
    ("a purple circle moving left to right", "purple"),
    ("a red hexagon moving left to right", "hexagon"),
    ("a red circle moving diagonally", "diagonally"),
    ("two red circles moving left to right", "is not"),
    ("a red circle", "is not"),
    ("", "is not"),
])
def test_parse_errors_name_the_offending_word(bad, word):
    with pytest.raises(ValueError, match=word):
        parse_prompt(bad)


def test_held_out_compositions_combine_pairs_seen_in_training():
    train, held_out = split_prompts()
    assert (len(train), len(held_out)) == (36, 12) and set(train).isdisjoint(held_out)
    assert sorted(train + held_out) == sorted(all_prompts())
    seen = {"cs": set(), "cd": set(), "sd": set()}
    for s in map(parse_prompt, train):
        seen["cs"].add((s.obj.colour, s.obj.shape))
        seen["cd"].add((s.obj.colour, s.direction))
        seen["sd"].add((s.obj.shape, s.direction))
    for s in map(parse_prompt, held_out):
        assert (s.obj.colour, s.obj.shape) in seen["cs"] and (s.obj.colour, s.direction) in seen["cd"]
        assert (s.obj.shape, s.direction) in seen["sd"]
    # Every (colour, shape) keeps exactly one direction back; every direction is held out as often.
    held = [parse_prompt(p) for p in held_out]
    assert sorted((s.obj.colour, s.obj.shape) for s in held) == sorted(itertools.product(COLOURS, SHAPES))
    assert {d: sum(s.direction == d for s in held) for d in DIRECTIONS} == dict.fromkeys(DIRECTIONS, 3)
    assert all(is_held_out(p) for p in held_out) and not any(is_held_out(p) for p in train)


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_rendered_object_moves_whole_and_steadily_along_its_direction(direction):
    rng = np.random.default_rng(7)
    unit = np.array(DIRECTIONS[direction])
    for shape in SHAPES:
        spec = MotionSpec.of("green", shape, direction)
        for _ in range(20):
            video = render(spec, rng)
            assert video.dtype == np.uint8 and video.shape == (FRAMES, 3, 32, 32)
            painted = (video == np.array(COLOURS["green"], dtype=np.uint8)[:, None, None]).all(1)  # [F, H, W]
            blank = (video == np.array(BACKGROUND, dtype=np.uint8)[:, None, None]).all(1)
            assert (painted | blank).all()
            areas = painted.sum((1, 2))
            assert (areas == areas[0]).all() and areas[0] >= 60  # never cut by the border
            centres = np.array([np.argwhere(p).mean(0) for p in painted])  # (y, x)
            steps = np.round(np.diff(centres, axis=0), 6)  # whole px, but for float noise
            along = steps @ unit
            assert (along >= 0).all() and np.ptp(along) <= 1  # constant speed up to rounding
            assert (steps @ unit[::-1] == 0).all()  # nothing across the direction
            assert along.sum() >= MIN_TRAVEL_FRAC * 32


def test_renders_are_seeded():
    spec = MotionSpec.of("red", "triangle", "bottom to top")
    a, b = render(spec, np.random.default_rng(3)), render(spec, np.random.default_rng(3))
    assert (a == b).all()
    assert not (a == render(spec, np.random.default_rng(4))).all()
    assert render(spec, np.random.default_rng(3), frames=3).shape == (3, 3, 32, 32)
    with pytest.raises(ValueError, match="at least 2 frames"):
        trajectory("left to right", np.random.default_rng(0), frames=1)


@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_pretraining_narrows_paths_to_given_sides_travel_and_grid(direction):
    rng = np.random.default_rng(3)
    for _ in range(50):
        path = trajectory(direction, rng, frames=4, sides=(12,), min_travel_frac=0.5, grid=4)
        assert path.side == 12
        axis = 0 if DIRECTIONS[direction][0] else 1
        along, across = path.corners[:, axis], path.corners[:, 1 - axis]
        assert abs(int(along[-1] - along[0])) in (16, 20)  # at least half of 32 px, on the 4-px grid
        assert along[0] % 4 == 0 and across[0] % 4 == 0 and (across == across[0]).all()
        assert path.corners.min() >= 0 and path.corners.max() <= 32 - 12
    with pytest.raises(ValueError, match="no room"):
        trajectory(direction, rng, sides=(20,), min_travel_frac=0.5)
