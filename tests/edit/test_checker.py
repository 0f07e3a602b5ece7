"""The edit checker: the target scenes pass, and each way an edit can go wrong fails the sub-score it names."""

from dataclasses import replace

import numpy as np
import pytest

from serve_app.worlds.edit import PlacedObject, Scene, all_instructions, check_edit, edit_examples

RED_SQUARE = PlacedObject("red", "square", (0, 0, 12))
BLUE_CIRCLE = PlacedObject("blue", "circle", (16, 16, 16))


def verdict(source: Scene, edited: Scene | np.ndarray, instruction: str):
    image = edited.render() if isinstance(edited, Scene) else edited
    return check_edit(source.render(), image, instruction)


def test_every_target_passes_and_every_unchanged_source_fails():
    examples = edit_examples(all_instructions(), 10, seed=5)
    assert all(verdict(e.source, e.target, e.instruction).strict for e in examples)
    unchanged = [verdict(e.source, e.source, e.instruction) for e in examples]
    assert not any(v.edit_ok for v in unchanged)
    assert all(v.kept_ok for v in unchanged)  # what should stay did stay


def test_recolour():
    source = Scene((RED_SQUARE, BLUE_CIRCLE))
    assert verdict(source, Scene((replace(RED_SQUARE, colour="green"), BLUE_CIRCLE)), "make the square green").strict
    wrong_colour = verdict(source, Scene((replace(RED_SQUARE, colour="yellow"), BLUE_CIRCLE)), "make the square green")
    assert (wrong_colour.edit_ok, wrong_colour.kept_ok, wrong_colour.clean) == (False, True, True)
    moved = verdict(source, Scene((replace(RED_SQUARE, colour="green", box=(16, 0, 12)), BLUE_CIRCLE)),
                    "make the square green")
    assert not moved.edit_ok and moved.clean
    other_changed = verdict(source, Scene((replace(RED_SQUARE, colour="green"), replace(BLUE_CIRCLE, colour="red"))),
                            "make the square green")
    assert (other_changed.edit_ok, other_changed.kept_ok) == (True, False)


def test_add():
    source = Scene((RED_SQUARE,))
    added = PlacedObject("yellow", "triangle", (16, 16, 12))
    assert verdict(source, Scene((RED_SQUARE, added)), "add a yellow triangle").strict
    wrong_kind = verdict(source, Scene((RED_SQUARE, replace(added, shape="circle"))), "add a yellow triangle")
    assert not wrong_kind.edit_ok and wrong_kind.kept_ok and wrong_kind.clean
    source_moved = verdict(source, Scene((replace(RED_SQUARE, box=(0, 16, 12)), added)), "add a yellow triangle")
    assert source_moved.edit_ok and not source_moved.kept_ok
    extra = verdict(source, Scene((RED_SQUARE, added, PlacedObject("green", "circle", (16, 0, 12)))),
                    "add a yellow triangle")
    assert extra.edit_ok and extra.kept_ok and not extra.clean


def test_remove():
    source = Scene((RED_SQUARE, BLUE_CIRCLE))
    assert verdict(source, Scene((BLUE_CIRCLE,)), "remove the square").strict
    removed_the_other = verdict(source, Scene((RED_SQUARE,)), "remove the square")
    assert not removed_the_other.edit_ok and not removed_the_other.kept_ok
    everything_gone = verdict(source, np.full((3, 32, 32), 24, dtype=np.uint8), "remove the square")
    assert everything_gone.edit_ok and not everything_gone.kept_ok and not everything_gone.clean


def test_a_blurred_edit_earns_no_shape_credit():
    source = Scene((RED_SQUARE, BLUE_CIRCLE))
    target = Scene((BLUE_CIRCLE,)).render().astype(np.float32)
    blurred = (target + np.roll(target, 1, axis=1) + np.roll(target, 1, axis=2)) / 3
    found = verdict(source, blurred.astype(np.uint8), "remove the square")
    assert not found.strict


def test_an_instruction_outside_the_grammar_is_an_error():
    with pytest.raises(ValueError, match="not"):
        check_edit(Scene((RED_SQUARE,)).render(), Scene((RED_SQUARE,)).render(), "make it pop")
