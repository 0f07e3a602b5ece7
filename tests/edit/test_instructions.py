"""The editing world's grammar, held-out split and example sampler."""

import numpy as np
import pytest

from serve_app.worlds.edit import (HELD_OUT, Instruction, all_instructions, applicable, edit_examples, parse_instruction,
                                   split_instructions)
from serve_app.worlds.shapes import COLOURS, SHAPES


def test_every_instruction_parses_back_to_itself():
    texts = all_instructions()
    assert len(texts) == len(set(texts)) == 27
    assert [parse_instruction(t).text() for t in texts] == texts
    assert parse_instruction("  Make the SQUARE  red. ") == Instruction("recolour", "square", "red")
    assert parse_instruction("add an yellow circle") == Instruction("add", "circle", "yellow")


@pytest.mark.parametrize("text, fault", [
    ("make the hexagon red", "hexagon"), ("add a purple circle", "purple"), ("remove the red circle", "not"),
    ("paint it black", "not"), ("", "not"),
])
def test_a_bad_instruction_names_its_fault(text, fault):
    with pytest.raises(ValueError, match=fault):
        parse_instruction(text)


def test_held_out_instructions_are_new_compositions_of_trained_parts():
    train, held_out = split_instructions()
    assert set(held_out) == HELD_OUT and len(train) == 21
    for text in held_out:
        parsed = parse_instruction(text)
        others = [parse_instruction(t) for t in train]
        assert any(o.kind == parsed.kind and o.shape == parsed.shape for o in others), text
        assert any(o.kind == parsed.kind and o.colour == parsed.colour for o in others), text


@pytest.mark.parametrize("text", all_instructions())
def test_examples_apply_and_keep_what_the_instruction_does_not_touch(text):
    for example in edit_examples([text], 20, seed=3):
        parsed, source, target = example.instruction, example.source, example.target
        assert applicable(parsed, source)
        assert len({o.shape for o in source.objects}) == len(source.objects) <= 2
        untouched = [o for o in source.objects if o.shape != parsed.shape]
        assert all(o in target.objects for o in untouched)
        if parsed.kind == "recolour":
            changed = next(o for o in target.objects if o.shape == parsed.shape)
            before = next(o for o in source.objects if o.shape == parsed.shape)
            assert (changed.colour, changed.box) == (parsed.colour, before.box) != (before.colour, before.box)
        elif parsed.kind == "add":
            assert len(target.objects) == 2 and target.objects[1].kind().shape == parsed.shape
            assert target.objects[1].colour == parsed.colour
        else:
            assert len(source.objects) == 2 and len(target.objects) == 1 and parsed.shape not in target.shapes()
        rendered = target.render()
        assert rendered.shape == (3, 32, 32) and rendered.dtype == np.uint8


def test_examples_are_seeded_and_cover_the_palette():
    first = edit_examples(all_instructions(), 4, seed=11)
    assert first == edit_examples(all_instructions(), 4, seed=11) != edit_examples(all_instructions(), 4, seed=12)
    colours = {o.colour for e in first for o in e.source.objects}
    shapes = {o.shape for e in first for o in e.source.objects}
    assert colours == set(COLOURS) and shapes == set(SHAPES)
