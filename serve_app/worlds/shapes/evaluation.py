"""Shapes-world evaluation: a fixed prompt x seed set, accuracies from the checker, labelled grids.

The same numbers come from three places - pretraining, the FlowGRPO trainer (through the deployed
app, as `ShapesEvaluator`) and benchmarks/bench_learning.py - so they are computed here, once.

    accuracies = score_images(images, prompts)   # {"strict_accuracy": ..., "partial_score": ..., ...}

Intervals (`ShapesEvaluator`, `intervals`): the four accuracies are proportions of images, with a
Wilson interval; partial_score (a mean of 0, 1/3, 2/3, 1) gets a percentile bootstrap over images.
What they measure is the noise of the seeds on these prompts: the images are treated as independent
draws. The paired change of strict accuracy against step 0 gets that interval over images and, beside
it, one over prompts (serve_app.trainer.evaluation: whole prompts resampled with all their seeds),
which is what a claim about unseen prompts needs: the 14 held-out prompts are a sample of the prompts
the grammar could hold out, and the seeds of one prompt share its difficulty. On the held-out change
at 14 x 32 images the image-level interval was +-4.6 points, the prompt-level one +-5.6 (+-5.0 at 40
seeds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from serve_app.trainer.evaluation import CONFIDENCE, Evaluator, SplitScores
from serve_app.trainer.outputs import save_captioned_grid
from serve_app.trainer.statistics import bootstrap_interval, wilson_interval

from .checker import Verdict, check
from .scene import parse_prompt, split_prompts

EVAL_COLUMNS = ("strict_accuracy", "partial_score", "count_accuracy", "colour_accuracy", "shape_accuracy")
INTERVAL_COLUMNS = tuple(f"{column}_{end}" for column in EVAL_COLUMNS for end in ("lo", "hi"))


def eval_prompts(split: str = "held_out") -> list[str]:
    """The prompts of a split of the grammar ("train", "held_out" or "all"), in a fixed order."""
    train, held_out = split_prompts()
    if split == "train":
        return train
    if split == "held_out":
        return held_out
    if split == "all":
        return train + held_out
    raise ValueError(f"unknown split {split!r}; known: train, held_out, all")


def verdicts(images: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> list[Verdict]:
    """One checker verdict per uint8 [3, H, W] image of ``images`` [N, 3, H, W]."""
    arrays = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    if len(arrays) != len(prompts):
        raise ValueError(f"{len(arrays)} images for {len(prompts)} prompts")
    return [check(a, parse_prompt(p)) for a, p in zip(arrays, prompts)]


def per_image(found: Sequence[Verdict]) -> dict[str, list[float]]:
    """Each EVAL_COLUMNS figure per verdict: 0/1 for the accuracies, the partial score's thirds."""
    if not found:
        raise ValueError("no verdicts to summarise")
    return {
        "strict_accuracy": [float(v.strict) for v in found],
        "partial_score": [v.partial for v in found],
        "count_accuracy": [float(v.count_ok) for v in found],
        "colour_accuracy": [float(v.colour_ok) for v in found],
        "shape_accuracy": [float(v.shape_ok) for v in found],
    }


def summarize(found: Sequence[Verdict]) -> dict[str, float]:
    """Mean strict accuracy, partial score and sub-score accuracies over verdicts."""
    return column_means(per_image(found))


def column_means(per_sample: dict[str, list[float]]) -> dict[str, float]:
    """Each column's mean over the samples."""
    return {column: sum(values) / len(values) for column, values in per_sample.items()}


def intervals(found: Sequence[Verdict], *, confidence: float = CONFIDENCE) -> dict[str, float]:
    """`<column>_lo` / `_hi` of every EVAL_COLUMNS figure (see the module's docstring for which interval)."""
    return accuracy_intervals(per_image(found), confidence=confidence)


def accuracy_intervals(per_sample: dict[str, list[float]], *, confidence: float = CONFIDENCE) -> dict[str, float]:
    """`<column>_lo` / `_hi` of each column's per-sample values: Wilson for the 0/1 accuracies, a
    percentile bootstrap for partial_score (a mean of thirds)."""
    bounds = {}
    for column, values in per_sample.items():
        if column == "partial_score":
            lo, hi = bootstrap_interval(values, confidence=confidence)
        else:
            lo, hi = wilson_interval(round(sum(values)), len(values), confidence=confidence)
        bounds[f"{column}_lo"], bounds[f"{column}_hi"] = lo, hi
    return bounds


def score_images(images: torch.Tensor | np.ndarray, prompts: Sequence[str]) -> dict[str, float]:
    return summarize(verdicts(images, prompts))


def verdict_label(verdict: Verdict) -> str:
    """A short caption: 'OK', or which sub-scores failed and what was detected."""
    if verdict.strict:
        return "OK"
    wrong = [name for name, ok in (("count", verdict.count_ok), ("colour", verdict.colour_ok),
                                   ("shape", verdict.shape_ok)) if not ok] or ["binding"]
    seen = ", ".join(f"{d.colour} {d.shape}" for d in verdict.detected) or "nothing"
    return f"x {'/'.join(wrong)}: {seen}"


def save_labelled_grid(images: torch.Tensor | np.ndarray, prompts: Sequence[str], path: str | Path, *,
                       columns: int, title: str = "") -> Path:
    """A grid of images, each captioned with its prompt and the checker's verdict (green OK, red not)."""
    arrays = images.detach().cpu().numpy() if isinstance(images, torch.Tensor) else np.asarray(images)
    found = verdicts(arrays, prompts)
    return save_captioned_grid([a.transpose(1, 2, 0) for a in arrays],
                               [f"{p}\n{verdict_label(v)}" for p, v in zip(prompts, found)], [v.strict for v in found],
                               Path(path), columns=columns, cell_inches=(1.9, 2.15), title=title)


def train_prompts() -> list[str]:
    """The train split: the trainer's `prompt_source` in configs/trainer/shapes.yaml."""
    return eval_prompts("train")


class ShapesEvaluator(Evaluator):
    """The checker's accuracies with their intervals per grammar split, the paired change of strict
    accuracy against the first evaluation, labelled grids and the accuracy plot
    (`trainer.evaluation.evaluator: serve_app.worlds.shapes.evaluation:ShapesEvaluator`).

    ``max_images_per_split`` caps a split's images (at least one seed per prompt), so that a split of
    many prompts does not cost samples_per_prompt times as many images as a small one.
    """

    columns = EVAL_COLUMNS + INTERVAL_COLUMNS
    headline = "strict_accuracy"
    paired = True

    def __init__(self, config: Any, *, splits: Sequence[str] = ("held_out",),
                 max_images_per_split: int | None = None) -> None:
        self._splits = {split: self.split_prompts(split) for split in splits}  # unknown names fail here
        if not self._splits:
            raise ValueError(f"{type(self).__name__} needs at least one split (train, held_out or all)")
        if max_images_per_split is not None and max_images_per_split < 1:
            raise ValueError(f"max_images_per_split must be >= 1; got {max_images_per_split}")
        self._max_images = max_images_per_split

    @staticmethod
    def split_prompts(split: str) -> list[str]:
        """The prompts of a split of the world's grammar."""
        return eval_prompts(split)

    def splits(self) -> dict[str, list[str]]:
        return dict(self._splits)

    def samples_per_prompt(self, split: str, configured: int) -> int:
        if self._max_images is None:
            return configured
        return max(1, min(configured, self._max_images // len(self._splits[split])))

    def score(self, images: torch.Tensor, prompts: list[str]) -> SplitScores:
        found = verdicts(images, prompts)
        return SplitScores(summarize(found) | intervals(found), per_image(found)["strict_accuracy"])

    def save_grid(self, images: torch.Tensor, prompts: list[str], path: Path, *, columns: int, title: str) -> None:
        save_labelled_grid(images, prompts, path, columns=columns, title=title)

    def plot(self, rows: list[dict[str, Any]], out: Path) -> None:
        plot_accuracy(rows, out / "eval_accuracy.png")

    def format(self, value: float) -> str:
        return f"{value:.1%}"

    def format_change(self, delta: float) -> str:
        return f"{100 * delta:+.1f} points"


def plot_accuracy(rows: list[dict[str, Any]], path: Path, *, columns: Sequence[str] = EVAL_COLUMNS,
                  headline: str = "strict_accuracy") -> None:
    """Every accuracy column of eval.csv against the training step, one line style per split; the
    headline with its interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    splits = list(dict.fromkeys(r.get("split", "") for r in rows))
    # One line style and one band hatch per split: the bands of two splits may overlap.
    for split, line, hatch in zip(splits, ("-", ":", "--"), (None, "////", "\\\\")):
        mine = [r for r in rows if r.get("split", "") == split]
        steps = [r["step"] for r in mine]
        for column, colour in zip(columns, ("k", "tab:purple", "tab:blue", "tab:red", "tab:green", "tab:orange")):
            main = column == headline
            ax.plot(steps, [r.get(column, math.nan) for r in mine], line, color=colour, marker="o" if main else None,
                    linewidth=2.5 if main else 1, label=f"{column} ({split})")
        ax.fill_between(steps, [r.get(f"{headline}_lo", math.nan) for r in mine],
                        [r.get(f"{headline}_hi", math.nan) for r in mine], facecolor="none" if hatch else "0.85",
                        edgecolor="0.6", hatch=hatch, linewidth=0,
                        label=f"{headline} {CONFIDENCE:.0%} interval ({split})")
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy (ODE, fixed seeds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
