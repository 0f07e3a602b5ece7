"""Editing world: a shapes-world scene, an instruction ("make the square red", "add a yellow circle",
"remove the triangle") and a checker of the edit against its source.

Like the other worlds, the core knows nothing of it: configs name its model
(``serve_app.worlds.edit.model:EDIT_QWEN_IMAGE``), rewards (``serve_app.worlds.edit.rewards``), the
trainer's prompts and evaluator (``serve_app.worlds.edit.evaluation``). Importing this package itself
needs only numpy.
"""

from .checker import EditVerdict, check_edit
from .instructions import (
    HELD_OUT,
    EditExample,
    Instruction,
    PlacedObject,
    Scene,
    all_instructions,
    applicable,
    edit_examples,
    is_held_out,
    parse_instruction,
    sample_example,
    split_instructions,
)

__all__ = [
    "HELD_OUT",
    "EditExample",
    "EditVerdict",
    "Instruction",
    "PlacedObject",
    "Scene",
    "all_instructions",
    "applicable",
    "check_edit",
    "edit_examples",
    "is_held_out",
    "parse_instruction",
    "sample_example",
    "split_instructions",
]
