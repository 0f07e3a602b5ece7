"""Editing-world evaluation: fixed (instruction, source scene) prompts x seeds, accuracies from the edit
checker, grids of source and edit side by side.

Computed here once for pretraining and the FlowGRPO trainer (``EditEvaluator``). A prompt is an
instruction with one source scene; a split holds each of its instructions with several scenes
(drawn from one fixed seed), and the trainer's prompt-level interval resamples these prompts. The
accuracies are proportions of images with a Wilson interval, partial_score gets a bootstrap (the
shapes world's ``accuracy_intervals``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve_app.schemas import ImagePrompt
from serve_app.trainer.evaluation import SplitScores
from serve_app.trainer.outputs import save_captioned_grid
from serve_app.worlds.shapes.evaluation import ShapesEvaluator, accuracy_intervals, column_means, plot_accuracy

from .checker import EditVerdict, check_edit
from .instructions import EditExample, edit_examples, split_instructions

EVAL_COLUMNS = ("strict_accuracy", "partial_score", "edit_accuracy", "kept_accuracy", "clean_accuracy")
INTERVAL_COLUMNS = tuple(f"{column}_{end}" for column in EVAL_COLUMNS for end in ("lo", "hi"))
# Source scenes per instruction of a split, and the seed they are drawn from (the training prompts use another).
SCENES_PER_INSTRUCTION = {"train": 2, "held_out": 8, "all": 2}
EVAL_SCENE_SEEDS = {"train": 101, "held_out": 102, "all": 103}
TRAIN_SCENE_SEED = 7


def instructions(split: str) -> list[str]:
    """The instructions of a split ("train", "held_out" or "all"), in a fixed order."""
    train, held_out = split_instructions()
    splits = {"train": train, "held_out": held_out, "all": train + held_out}
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(splits)}")
    return splits[split]


def eval_examples(split: str, scenes_per_instruction: int | None = None) -> list[EditExample]:
    """The fixed evaluation prompts of a split: each instruction with its source scenes."""
    texts = instructions(split)  # unknown names fail here
    return edit_examples(texts, scenes_per_instruction or SCENES_PER_INSTRUCTION[split], EVAL_SCENE_SEEDS[split])


def as_prompts(examples: Sequence[EditExample]) -> list[ImagePrompt]:
    return [ImagePrompt(e.instruction.text(), (torch.from_numpy(e.source.render()),)) for e in examples]


def train_prompts(scenes_per_instruction: int = 24) -> list[ImagePrompt]:
    """The trainer's prompts (configs/trainer/edit.yaml `prompt_source`): every train instruction with
    scenes of its own (a seed no evaluation uses)."""
    return as_prompts(edit_examples(instructions("train"), scenes_per_instruction, TRAIN_SCENE_SEED))


def verdicts(images: torch.Tensor | np.ndarray, prompts: Sequence[str],
             sources: Sequence[torch.Tensor | np.ndarray]) -> list[EditVerdict]:
    """One verdict per uint8 [3, H, W] edit of ``images`` [N, 3, H, W], its instruction and source."""
    arrays = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if not len(arrays) == len(prompts) == len(sources):
        raise ValueError(f"{len(arrays)} edits for {len(prompts)} instructions and {len(sources)} sources")
    return [check_edit(np.asarray(s), a, p) for a, p, s in zip(arrays, prompts, sources)]


def per_image(found: Sequence[EditVerdict]) -> dict[str, list[float]]:
    if not found:
        raise ValueError("no verdicts to summarise")
    return {
        "strict_accuracy": [float(v.strict) for v in found],
        "partial_score": [v.partial for v in found],
        "edit_accuracy": [float(v.edit_ok) for v in found],
        "kept_accuracy": [float(v.kept_ok) for v in found],
        "clean_accuracy": [float(v.clean) for v in found],
    }


def summarize(found: Sequence[EditVerdict]) -> dict[str, float]:
    return column_means(per_image(found))


def verdict_label(verdict: EditVerdict) -> str:
    if verdict.strict:
        return "OK"
    wrong = [name for name, ok in (("edit", verdict.edit_ok), ("kept", verdict.kept_ok), ("clean", verdict.clean))
             if not ok]
    seen = ", ".join(f"{d.colour} {d.shape}" for d in verdict.detected) or "nothing"
    return f"x {'/'.join(wrong)}: {seen}"


def save_edit_grid(images: torch.Tensor | np.ndarray, prompts: Sequence[str], sources: Sequence[torch.Tensor],
                   path: str | Path, *, columns: int, title: str = "") -> Path:
    """Each edit beside its source (a black bar between), captioned with the instruction and the verdict."""
    arrays = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    originals = [np.asarray(s) for s in sources]
    found = verdicts(arrays, prompts, originals)
    pairs = [np.concatenate([s, np.zeros((3, s.shape[1], 2), dtype=np.uint8), e], axis=2).transpose(1, 2, 0)
             for s, e in zip(originals, arrays)]
    return save_captioned_grid(pairs, [f"{p}\n{verdict_label(v)}" for p, v in zip(prompts, found)],
                               [v.strict for v in found], Path(path), columns=columns, cell_inches=(2.6, 1.75),
                               title=title)


def score_edits(images: torch.Tensor | np.ndarray, prompts: Sequence[str], sources: Sequence[Any]) -> dict[str, float]:
    return summarize(verdicts(images, prompts, sources))


def _sources(input_images: list[list[torch.Tensor]] | None) -> list[torch.Tensor]:
    if input_images is None or any(len(sources) != 1 for sources in input_images):
        raise ValueError("an edit is scored against its one source image (input_images, one list per image)")
    return [sources[0] for sources in input_images]


class EditEvaluator(ShapesEvaluator):
    """The edit checker's accuracies with their intervals per split (each instruction of the split with
    its fixed source scenes), the paired change of strict accuracy against the first evaluation, grids
    of source and edit, the accuracy plot
    (`trainer.evaluation.evaluator: serve_app.worlds.edit.evaluation:EditEvaluator`)."""

    columns = EVAL_COLUMNS + INTERVAL_COLUMNS

    def __init__(self, config: Any, *, splits: Sequence[str] = ("held_out",), max_images_per_split: int | None = None,
                 scenes_per_instruction: dict[str, int] | None = None) -> None:
        scenes = scenes_per_instruction or {}
        self._examples = {split: as_prompts(eval_examples(split, scenes.get(split))) for split in splits}
        super().__init__(config, splits=splits, max_images_per_split=max_images_per_split)
        self._splits = {split: [p.text for p in prompts] for split, prompts in self._examples.items()}

    @staticmethod
    def split_prompts(split: str) -> list[str]:
        return instructions(split)

    def input_images(self, split: str) -> list[list[torch.Tensor]]:
        return [list(p.images) for p in self._examples[split]]

    def score(self, images: torch.Tensor, prompts: list[str], *,
              input_images: list[list[torch.Tensor]] | None = None) -> SplitScores:
        found = verdicts(images, prompts, _sources(input_images))
        values = per_image(found)
        return SplitScores(summarize(found) | accuracy_intervals(values), values["strict_accuracy"])

    def save_grid(self, images: torch.Tensor, prompts: list[str], path: Path, *, columns: int, title: str,
                  input_images: list[list[torch.Tensor]] | None = None) -> None:
        save_edit_grid(images, prompts, _sources(input_images), path, columns=columns, title=title)

    def plot(self, rows: list[dict[str, Any]], out: Path) -> None:
        plot_accuracy(rows, out / "eval_accuracy.png", columns=EVAL_COLUMNS)
