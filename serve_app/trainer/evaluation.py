"""The run's ODE evaluations: fixed prompts x seeds sampled through the app at a given version.

Every evaluation appends one row per prompt split to `eval.csv` (step = updates completed, so step 0
is the model before training) and saves a grid; `finish()` adds `eval_before.png` /
`eval_after.png` and the evaluator's plot. What is measured is an :class:`Evaluator`, named by
import path in `trainer.evaluation.evaluator` and built with `trainer.evaluation.args`:
:class:`RewardEvaluator` (the configured reward's mean) by default, or a world's own, such as
``serve_app.shapes.evaluation:ShapesEvaluator``.
"""

from __future__ import annotations

import abc
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from serve_app.imports import import_object
from serve_app.rewards import TOTAL_KEY
from serve_app.trainer.outputs import MetricsLog, save_image_grid

if TYPE_CHECKING:
    from serve_app.trainer.config import TrainerRunConfig

BASE_COLUMNS = ["step", "split", "policy_version", "weights", "train_minutes", "images_sampled", "eval_reward_mean"]


class Evaluator(abc.ABC):
    """What an evaluation measures: named prompt splits, metrics of a split's images, pictures.

    `columns` are the metrics `score` adds to eval.csv; `headline` is the column summaries and grid
    titles report (`eval_reward_mean`, which every row has, unless the evaluator says otherwise).
    """

    columns: ClassVar[tuple[str, ...]] = ()
    headline: ClassVar[str] = "eval_reward_mean"

    @abc.abstractmethod
    def splits(self) -> dict[str, list[str]]:
        """Prompt sets by name, in a fixed order; the first is the one summaries compare."""

    def score(self, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
        """Metrics of uint8 images [N, 3, H, W], one prompt each (beyond the reward mean)."""
        return {}

    def save_grid(self, images: torch.Tensor, prompts: list[str], path: Path, *, columns: int, title: str) -> None:
        save_image_grid(images, path, columns=columns)

    def plot(self, rows: list[dict[str, Any]], out: Path) -> None:
        """Pictures of eval.csv's rows into the run's folder at the end of the run; none by default."""

    def format(self, value: float) -> str:
        return f"{value:.5f}"

    def describe_change(self, first: float, last: float) -> str:
        return f"{self.format(first)} -> {self.format(last)} ({last - first:+.5f})"


class RewardEvaluator(Evaluator):
    """The configured reward on `prompts` (default: the first step's trainer prompts)."""

    def __init__(self, config: TrainerRunConfig, *, prompts: list[str] | None = None) -> None:
        self._prompts = list(prompts or config.trainer.prompts[: config.trainer.prompts_per_step])

    def splits(self) -> dict[str, list[str]]:
        return {"fixed": self._prompts}


def build_evaluator(config: TrainerRunConfig) -> Evaluator:
    settings = config.trainer.evaluation
    factory = import_object(settings.evaluator, what="evaluator")
    try:
        evaluator = factory(config, **settings.args)
    except TypeError as exc:
        raise ValueError(f"trainer.evaluation.args {settings.args} do not fit {settings.evaluator}: {exc}") from exc
    if not isinstance(evaluator, Evaluator):
        raise TypeError(f"{settings.evaluator} built a {type(evaluator).__name__}, not an Evaluator")
    return evaluator


class RunEvaluator:
    """Samples every split through the app and keeps eval.csv, the grids and the evaluator's plot."""

    def __init__(self, config: TrainerRunConfig, client: Any, out: Path, *, append: bool = False) -> None:
        self.config, self.client, self.out = config, client, out
        self.settings = config.trainer.evaluation
        self.evaluator = build_evaluator(config)
        self.splits = self.evaluator.splits()
        self.first_split = next(iter(self.splits))
        self.log = MetricsLog(out / "eval.csv", append=append, columns=BASE_COLUMNS + list(self.evaluator.columns))

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The first split's rows (what summaries and benchmarks compare)."""
        return [r for r in self.log.rows if r.get("split", self.first_split) == self.first_split]

    def _grid_path(self, step: int, split: str) -> Path:
        suffix = "" if split == self.first_split else f"_{split}"
        return self.out / f"eval{suffix}_step{step:05d}.png"

    def evaluate(self, step: int, version: int, *, weights: str, train_minutes: float,
                 images_sampled: int) -> dict[str, Any]:
        """One row per split, sampled at `version` (`weights` says what it holds: policy or ema);
        returns the first split's row."""
        rows = [self._evaluate_split(split, prompts, step, version, weights=weights, train_minutes=train_minutes,
                                     images_sampled=images_sampled) for split, prompts in self.splits.items()]
        return rows[0]

    def _evaluate_split(self, split: str, split_prompts: list[str], step: int, version: int, *, weights: str,
                        train_minutes: float, images_sampled: int) -> dict[str, Any]:
        validation = self.config.validation
        sampling = self.config.sampling.for_validation(num_steps=validation.num_steps, seed=validation.seed)
        per_prompt = self.settings.samples_per_prompt
        batch = self.client.rollout(split_prompts, per_prompt, sampling=sampling, policy_version=version,
                                    seed=validation.seed, timeout_s=self.config.trainer.rollout_timeout_s)
        images = batch.trajectory.images
        prompts = [split_prompts[i] for i in batch.trajectory.prompt_index.tolist()]
        row: dict[str, Any] = {
            "step": step, "split": split, "policy_version": version, "weights": weights,
            "train_minutes": train_minutes, "images_sampled": images_sampled,
            "eval_reward_mean": float(batch.rewards[TOTAL_KEY].mean()),
        }
        row.update(self.evaluator.score(images, prompts))
        shown = min(self.settings.grid_samples, per_prompt)
        keep = [i for i in range(len(prompts)) if i % per_prompt < shown]
        headline = self.evaluator.headline
        self.evaluator.save_grid(
            images[keep], [prompts[i] for i in keep], self._grid_path(step, split), columns=shown,
            title=f"{split} prompts, step {step} (v{version}, {weights}): {headline} {self.evaluator.format(row[headline])}",
        )
        self.log.append(row)
        return row

    def finish(self) -> None:
        if not self.rows:
            return
        first, last = int(self.rows[0]["step"]), int(self.rows[-1]["step"])
        for split in self.splits:
            suffix = "" if split == self.first_split else f"_{split}"
            shutil.copyfile(self._grid_path(first, split), self.out / f"eval_before{suffix}.png")
            shutil.copyfile(self._grid_path(last, split), self.out / f"eval_after{suffix}.png")
        self.evaluator.plot(self.log.rows, self.out)

    def summary(self) -> str:
        lines = []
        key = self.evaluator.headline
        for split, prompts in self.splits.items():
            rows = [r for r in self.log.rows if r.get("split", split) == split]
            if len(rows) < 2:
                continue
            first, last = rows[0], rows[-1]
            lines.append(
                f"eval {key} on {len(prompts)} {split} prompts x {self.settings.samples_per_prompt} seeds: "
                f"{self.evaluator.describe_change(first[key], last[key])} from step {int(first['step'])} to "
                f"{int(last['step'])} ({last['train_minutes']:.1f} min of training)"
            )
        return "\n".join(lines)
