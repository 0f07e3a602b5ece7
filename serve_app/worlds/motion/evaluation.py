"""Moving-shapes evaluation: fixed prompt x seed sets, accuracies from the motion checker, filmstrips.

Computed here once for pretraining and the FlowGRPO trainer (``MotionEvaluator``). The
headline is direction accuracy (the subject found in every frame and moving the asked way);
one-object direction accuracy also needs exactly one object in every frame, and strict accuracy every
frame to show just the asked shape in the asked colour. Intervals are the
shapes world's (serve_app.worlds.shapes.evaluation): Wilson per accuracy, a bootstrap for partial_score.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve_app.trainer.evaluation import SplitScores
from serve_app.trainer.outputs import save_captioned_grid
from serve_app.worlds.shapes.evaluation import ShapesEvaluator, accuracy_intervals, column_means, plot_accuracy

from .checker import MotionVerdict, check_video
from .scene import parse_prompt, split_prompts

EVAL_COLUMNS = ("direction_accuracy", "one_object_direction_accuracy", "strict_accuracy", "partial_score",
                "count_accuracy", "colour_accuracy", "shape_accuracy")
INTERVAL_COLUMNS = tuple(f"{column}_{end}" for column in EVAL_COLUMNS for end in ("lo", "hi"))


def eval_prompts(split: str = "held_out") -> list[str]:
    """The prompts of a split of the motion grammar ("train", "held_out" or "all"), in a fixed order."""
    train, held_out = split_prompts()
    splits = {"train": train, "held_out": held_out, "all": train + held_out}
    if split not in splits:
        raise ValueError(f"unknown split {split!r}; known: {', '.join(splits)}")
    return splits[split]


def train_prompts() -> list[str]:
    """The train split: the trainer's `prompt_source` in configs/trainer/motion.yaml."""
    return eval_prompts("train")


def verdicts(videos: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> list[MotionVerdict]:
    """One checker verdict per uint8 [F, 3, H, W] video of ``videos`` [N, F, 3, H, W]."""
    arrays = videos.detach().cpu().numpy() if isinstance(videos, torch.Tensor) else np.asarray(videos)
    if len(arrays) != len(prompts):
        raise ValueError(f"{len(arrays)} videos for {len(prompts)} prompts")
    return [check_video(a, parse_prompt(p)) for a, p in zip(arrays, prompts)]


def per_video(found: Sequence[MotionVerdict]) -> dict[str, list[float]]:
    """Each EVAL_COLUMNS figure per verdict: 0/1 for the accuracies, the partial score's thirds."""
    if not found:
        raise ValueError("no verdicts to summarise")
    return {
        "direction_accuracy": [float(v.direction_ok) for v in found],
        "one_object_direction_accuracy": [float(v.one_object_direction_ok) for v in found],
        "strict_accuracy": [float(v.strict) for v in found],
        "partial_score": [v.partial for v in found],
        "count_accuracy": [float(v.count_ok) for v in found],
        "colour_accuracy": [float(v.colour_ok) for v in found],
        "shape_accuracy": [float(v.shape_ok) for v in found],
    }


def score_videos(videos: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> dict[str, float]:
    """Mean of every EVAL_COLUMNS figure over the videos."""
    return column_means(per_video(verdicts(videos, prompts)))


def word_order_gap(policy, subject: str = "red circle") -> float:
    """How far apart ``policy``'s text encoder puts "a <subject> moving left to right" and "... right to
    left" (each word's vector against the nearest word of the other prompt, averaged) over how far apart
    it puts "... left to right" and "... top to bottom". Wan's cross-attention sees a prompt as a set of
    vectors, so near 0 the transformer cannot tell the two ends of an axis apart."""
    prompts = [f"a {subject} moving {d}" for d in ("left to right", "right to left", "top to bottom")]
    embeds = policy.encode_prompts(policy.text_processor().tokenize(prompts)).embeds

    def nearest(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.cdist(a, b).min(dim=1).values.mean())

    return nearest(embeds[0], embeds[1]) / nearest(embeds[0], embeds[2])


def verdict_label(verdict: MotionVerdict) -> str:
    """A short caption: 'OK', or the direction seen and which sub-scores failed."""
    if verdict.strict:
        return "OK"
    wrong = [name for name, ok in (("count", verdict.count_ok), ("colour", verdict.colour_ok),
                                   ("shape", verdict.shape_ok), ("direction", verdict.direction_ok)) if not ok]
    return f"x {'/'.join(wrong)}: went {verdict.direction}"


def save_filmstrips(videos: torch.Tensor | np.ndarray, prompts: Sequence[str], path: str | Path, *, columns: int,
                    title: str = "") -> Path:
    """Each video as a filmstrip (its frames left to right), captioned with its prompt and the verdict
    (green when the direction is right); ``columns`` videos a row."""
    arrays = videos.detach().cpu().numpy() if isinstance(videos, torch.Tensor) else np.asarray(videos)
    found = verdicts(arrays, prompts)
    strips = [np.concatenate(list(video.transpose(0, 2, 3, 1)), axis=1) for video in arrays]  # [H, F W, 3] each
    return save_captioned_grid(strips, [f"{p} | {verdict_label(v)}" for p, v in zip(prompts, found)],
                               [v.direction_ok for v in found], Path(path), columns=columns,
                               cell_inches=(0.55 * arrays.shape[1], 0.95), fontsize=5, title=title, title_size=8)


class MotionEvaluator(ShapesEvaluator):
    """The shapes world's evaluator for videos: direction accuracy as the headline (paired change
    against step 0), every accuracy with its interval, filmstrips and the accuracy plot
    (`trainer.evaluation.evaluator: serve_app.worlds.motion.evaluation:MotionEvaluator`)."""

    columns = EVAL_COLUMNS + INTERVAL_COLUMNS
    headline = "direction_accuracy"

    @staticmethod
    def split_prompts(split: str) -> list[str]:
        return eval_prompts(split)

    def score(self, images: torch.Tensor, prompts: list[str]) -> SplitScores:
        values = per_video(verdicts(images, prompts))
        return SplitScores(column_means(values) | accuracy_intervals(values), values[self.headline])

    def save_grid(self, images: torch.Tensor, prompts: list[str], path: Path, *, columns: int, title: str) -> None:
        save_filmstrips(images, prompts, path, columns=columns, title=title)

    def plot(self, rows: list[dict[str, Any]], out: Path) -> None:
        plot_accuracy(rows, out / "eval_accuracy.png", columns=EVAL_COLUMNS, headline=self.headline)
