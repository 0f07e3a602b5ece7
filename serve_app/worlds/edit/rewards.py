"""Editing-world rewards: each edit checked against its prompt's input image and instruction.

Reward factories named by import path in a reward config (configs/reward/edit.yaml), both declared with
``@sees_input_images`` (so they run in the aggregator's process): ``serve_app.worlds.edit.rewards:edit_strict``
(1.0 when the edit did what was asked and kept the rest, else 0.0) and
``serve_app.worlds.edit.rewards:edit_partial`` (``EditVerdict.partial``: the mean of the edit, kept and clean
sub-scores). An instruction outside the grammar raises ValueError: a configuration error, not a low score.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from serve_app.rewards.registry import RewardFn, check_image_batch, sees_input_images

from .checker import EditVerdict, check_edit
from .instructions import parse_instruction


def _verdict_reward(score: Callable[[EditVerdict], float]) -> RewardFn:
    def reward(images: torch.Tensor, prompts: Sequence[str], *, input_images: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
        check_image_batch(images, prompts)
        instructions = [parse_instruction(p) for p in prompts]  # all parsed first: fail before any work
        if len(input_images) != len(prompts) or any(len(sources) != 1 for sources in input_images):
            raise ValueError("an edit reward needs exactly one input image per sample")
        edits = images.detach().cpu().numpy()
        return torch.tensor([score(check_edit(sources[0].cpu().numpy(), edit, instruction))
                             for edit, sources, instruction in zip(edits, input_images, instructions)],
                            dtype=torch.float32)

    return reward  # type: ignore[return-value]


@sees_input_images
def edit_strict() -> RewardFn:
    """1.0 if the asked change happened, every other object is kept in place and nothing else is drawn."""
    return _verdict_reward(lambda v: float(v.strict))


@sees_input_images
def edit_partial() -> RewardFn:
    """Mean of the edit, kept and clean sub-scores (see ``checker.EditVerdict``): 0, 1/3, 2/3 or 1."""
    return _verdict_reward(lambda v: v.partial)
