"""The run's ODE evaluations: fixed prompts x seeds sampled through the app at a given version.

Every evaluation appends one row per prompt split to `eval.csv` (step = updates completed, so step 0
is the model before training) and saves a grid; `finish()` adds `eval_before.png` /
`eval_after.png` and the evaluator's plot. What is measured is an :class:`Evaluator`, named by
import path in `trainer.evaluation.evaluator` and built with `trainer.evaluation.args`:
:class:`RewardEvaluator` (the configured reward's mean) by default, or a world's own, such as
``serve_app.worlds.shapes.evaluation:ShapesEvaluator``.

An evaluator that is `paired` gives its headline per image; every evaluation then also reports the
change of the headline against the split's first evaluation (step 0) on the same prompts and seeds
(`<headline>_change`), with two paired bootstrap intervals: over images (`_change_lo`, `_change_hi`: how
sure the change is on these prompts, their seeds resampled as independent draws) and over prompts
(`_change_prompt_lo`, `_change_prompt_hi`: whole prompts resampled, each with all its seeds' differences;
what a claim about unseen prompts needs, as the seeds of one prompt share its difficulty). The first evaluation's
per-image values are kept in `eval_reference_<split>.json` next to eval.csv, so a resumed run
(`append=True`) still compares against step 0; in a folder without that file (a run from before
it existed) the first evaluation after the resume becomes the reference.
"""

from __future__ import annotations

import abc
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from serve_app.imports import import_object
from serve_app.rewards import TOTAL_KEY
from serve_app.schemas import split_image_prompts
from serve_app.trainer.outputs import MetricsLog, save_image_grid
from serve_app.trainer.statistics import bootstrap_interval, cluster_bootstrap_interval

if TYPE_CHECKING:
    from serve_app.trainer.config import TrainerRunConfig

BASE_COLUMNS = ["step", "split", "policy_version", "weights", "train_minutes", "images_sampled", "eval_reward_mean"]
CONFIDENCE = 0.95  # of every interval in eval.csv


def change_columns(headline: str) -> list[str]:
    """eval.csv's columns of the paired change of `headline` against the first evaluation: the change, its
    interval over images and its interval over prompts."""
    change = f"{headline}_change"
    return [change, f"{change}_lo", f"{change}_hi", f"{change}_prompt_lo", f"{change}_prompt_hi"]


@dataclass(frozen=True)
class SplitScores:
    """What an evaluator measured on one split's images."""

    metrics: dict[str, float] = field(default_factory=dict)  # its `columns`
    per_image: list[float] | None = None  # the headline per image (its mean), for the paired change


class Evaluator(abc.ABC):
    """What an evaluation measures: named prompt splits, metrics of a split's images, pictures.

    `columns` are the metrics `score` adds to eval.csv; `headline` is the column summaries and grid
    titles report (`eval_reward_mean`, which every row has, unless the evaluator says otherwise);
    `paired` evaluators give the headline per image, for its change against the first evaluation (for
    `eval_reward_mean` the rollout's per-image rewards are taken when `score` gives none).
    """

    columns: ClassVar[tuple[str, ...]] = ()
    headline: ClassVar[str] = "eval_reward_mean"
    paired: ClassVar[bool] = False

    @abc.abstractmethod
    def splits(self) -> dict[str, list[str]]:
        """Prompt sets by name, in a fixed order; the first is the one summaries compare."""

    def samples_per_prompt(self, split: str, configured: int) -> int:
        """Fixed seeds per prompt of `split`; `configured` is trainer.evaluation.samples_per_prompt."""
        return configured

    def input_images(self, split: str) -> list[list[torch.Tensor]] | None:
        """The input images of each of a split's prompts, for an image-conditioned family (sent with the
        request, and passed to `score` and `save_grid` as ``input_images=``, one list per image); None
        for text prompts."""
        return None

    def score(self, images: torch.Tensor, prompts: list[str], *,
              input_images: list[list[torch.Tensor]] | None = None) -> SplitScores:
        """Metrics of uint8 images [N, 3, H, W], one prompt each (beyond the reward mean)."""
        return SplitScores()

    def save_grid(self, images: torch.Tensor, prompts: list[str], path: Path, *, columns: int, title: str,
                  input_images: list[list[torch.Tensor]] | None = None) -> None:
        save_image_grid(images, path, columns=columns)

    def plot(self, rows: list[dict[str, Any]], out: Path) -> None:
        """Pictures of eval.csv's rows into the run's folder at the end of the run; none by default."""

    def format(self, value: float) -> str:
        return f"{value:.5f}"

    def format_change(self, delta: float) -> str:
        return f"{delta:+.5f}"

    def describe_change(self, first: dict[str, Any], last: dict[str, Any]) -> str:
        """The headline from the `first` to the `last` eval.csv row; with the paired intervals (over images,
        and over prompts) when the rows have them, and whether each tells the change from none (excludes 0)."""
        key = self.headline
        text = f"{self.format(first[key])} -> {self.format(last[key])}"
        change, lo, hi, prompt_lo, prompt_hi = change_columns(key)
        if hi not in last:
            return f"{text} ({self.format_change(last[key] - first[key])})"
        intervals = f"{self._interval(last[lo], last[hi])} over images"
        if prompt_hi in last:  # rows from before the prompt-level interval have none
            intervals += f"; {self._interval(last[prompt_lo], last[prompt_hi])} over prompts"
        return f"{text} ({self.format_change(last[change])}, paired {CONFIDENCE:.0%} interval {intervals})"

    def _interval(self, lo: float, hi: float) -> str:
        distinguishable = lo > 0 or hi < 0
        verdict = f"{'' if distinguishable else 'not '}distinguishable from no change"
        return f"{self.format_change(lo)} to {self.format_change(hi)}: {verdict}"


class RewardEvaluator(Evaluator):
    """The configured reward on `prompts` (default: the first step's trainer prompts, with their input images
    when the prompt source gives them), with its paired change against the first evaluation."""

    paired = True

    def __init__(self, config: TrainerRunConfig, *, prompts: list[str] | None = None) -> None:
        self._prompts, self._images = split_image_prompts(
            prompts or config.trainer.training_prompts()[: config.trainer.prompts_per_step])

    def splits(self) -> dict[str, list[str]]:
        return {"fixed": self._prompts}

    def input_images(self, split: str) -> list[list[torch.Tensor]] | None:
        return self._images


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


@dataclass(frozen=True)
class PairedReference:
    """The per-image headline of a split's first evaluation, keyed by (prompt, seed): what later
    evaluations of the same images are paired with."""

    step: int
    values: dict[tuple[str, int], float]

    def save(self, path: Path) -> None:
        images = [{"prompt": p, "seed": s, "value": v} for (p, s), v in self.values.items()]
        path.write_text(json.dumps({"step": self.step, "images": images}))

    @classmethod
    def load(cls, path: Path) -> PairedReference:
        saved = json.loads(path.read_text())
        return cls(saved["step"], {(i["prompt"], i["seed"]): i["value"] for i in saved["images"]})

    def change(self, prompts: Sequence[str], seeds: Sequence[int], values: Sequence[float]) -> list[float]:
        """Per image, `values` minus this reference's value of the same prompt and seed."""
        keys = list(zip(prompts, seeds))
        if set(keys) != set(self.values) or len(keys) != len(self.values):
            raise ValueError(
                f"this evaluation sampled {len(keys)} (prompt, seed) pairs, its reference (step {self.step}) "
                f"{len(self.values)}, not the same ones: the evaluation's prompts, samples_per_prompt or "
                "validation seed changed since; pairing needs the same images"
            )
        return [value - self.values[key] for key, value in zip(keys, values)]


class RunEvaluator:
    """Samples every split through the app and keeps eval.csv, the grids and the evaluator's plot."""

    def __init__(self, config: TrainerRunConfig, client: Any, out: Path, *, append: bool = False) -> None:
        self.config, self.client, self.out = config, client, out
        self.settings = config.trainer.evaluation
        self.evaluator = build_evaluator(config)
        self.splits = self.evaluator.splits()
        self.first_split = next(iter(self.splits))
        paired = change_columns(self.evaluator.headline) if self.evaluator.paired else []
        self.log = MetricsLog(out / "eval.csv", append=append,
                              columns=BASE_COLUMNS + list(self.evaluator.columns) + paired)
        self.references = {split: PairedReference.load(self._reference_path(split)) for split in self.splits
                           if append and self._reference_path(split).is_file()}
        # Each split's latest per-image headline: what pairs this run with another run's on the same images.
        self.latest: dict[str, PairedReference] = {}

    @property
    def first_split_rows(self) -> list[dict[str, Any]]:
        """The first split's rows in order (every split's: `log.rows`, eval.csv as written)."""
        return [r for r in self.log.rows if r.get("split", self.first_split) == self.first_split]

    def _grid_path(self, step: int, split: str) -> Path:
        suffix = "" if split == self.first_split else f"_{split}"
        return self.out / f"eval{suffix}_step{step:05d}.png"

    def _reference_path(self, split: str) -> Path:
        return self.out / f"eval_reference_{split}.json"

    def samples_per_prompt(self, split: str) -> int:
        return self.evaluator.samples_per_prompt(split, self.settings.samples_per_prompt)

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
        sampling = self.config.sampling.for_validation(num_steps=validation.num_steps, seed=validation.seed,
                                                       guidance_scale=validation.guidance_scale)
        per_prompt = self.samples_per_prompt(split)
        split_images = self.evaluator.input_images(split)
        # Images and ids only: an evaluation never fetches the transitions.
        batch = self.client.rollout(split_prompts, per_prompt, sampling=sampling, policy_version=version,
                                    seed=validation.seed, timeout_s=self.config.trainer.rollout_timeout_s, fetch=False,
                                    return_images=True,
                                    **({} if split_images is None else {"images": split_images}))
        images, header = batch.images, batch.header
        prompt_index = header.prompt_index.tolist()
        prompts = [split_prompts[i] for i in prompt_index]
        # An image-conditioned evaluator sees each image's input images (a split may repeat a text with other images).
        seen = {} if split_images is None else {"input_images": [split_images[i] for i in prompt_index]}
        row: dict[str, Any] = {
            "step": step, "split": split, "policy_version": version, "weights": weights,
            "train_minutes": train_minutes, "images_sampled": images_sampled,
            "eval_reward_mean": float(batch.rewards[TOTAL_KEY].mean()),
        }
        scores = self.evaluator.score(images, prompts, **seen)
        row.update(scores.metrics)
        if self.evaluator.paired:
            per_image = scores.per_image
            if per_image is None and self.evaluator.headline == "eval_reward_mean":
                per_image = batch.rewards[TOTAL_KEY].tolist()  # the headline is the reward: each image's own
            row.update(self._paired_change(split, step, prompts, prompt_index, header.seeds.tolist(), per_image))
        shown = min(self.settings.grid_samples, per_prompt)
        keep = [i for i in range(len(prompts)) if i % per_prompt < shown]
        headline = self.evaluator.headline
        self.evaluator.save_grid(
            images[keep], [prompts[i] for i in keep], self._grid_path(step, split), columns=shown,
            **{name: [values[i] for i in keep] for name, values in seen.items()},
            title=f"{split} prompts, step {step} (v{version}, {weights}): {headline} {self.evaluator.format(row[headline])}",
        )
        self.log.append(row)
        return row

    def _paired_change(self, split: str, step: int, prompts: list[str], prompt_index: list[int], seeds: list[int],
                       per_image: list[float] | None) -> dict[str, float]:
        """The headline's change against the split's first evaluation, with its paired bootstrap intervals
        (each image's two values stay together) over images and over prompts (the split's entries, by
        index: an edit split repeats an instruction with other source images); the first evaluation
        becomes the reference (and is saved)."""
        if per_image is None:
            raise TypeError(f"{type(self.evaluator).__name__} is paired but its score gave no per-image values")
        self.latest[split] = PairedReference(step, dict(zip(zip(prompts, seeds), per_image)))
        if split not in self.references:
            self.references[split] = self.latest[split]
            self.references[split].save(self._reference_path(split))
        change = self.references[split].change(prompts, seeds, per_image)
        lo, hi = bootstrap_interval(change, confidence=CONFIDENCE)
        prompt_lo, prompt_hi = cluster_bootstrap_interval(change, prompt_index, confidence=CONFIDENCE)
        values = (sum(change) / len(change), lo, hi, prompt_lo, prompt_hi)
        return dict(zip(change_columns(self.evaluator.headline), values))

    def finish(self) -> None:
        rows = self.first_split_rows
        if not rows:
            return
        first, last = int(rows[0]["step"]), int(rows[-1]["step"])
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
                f"eval {key} on {len(prompts)} {split} prompts x {self.samples_per_prompt(split)} seeds: "
                f"{self.evaluator.describe_change(first, last)} from step {int(first['step'])} to "
                f"{int(last['step'])} ({last['train_minutes']:.1f} min of training)"
            )
        return "\n".join(lines)
