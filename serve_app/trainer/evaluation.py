"""The run's ODE evaluations: fixed prompts x seeds sampled through the app at the newest version.

Every evaluation appends a row to `eval.csv` (step = updates completed, so step 0 is the model
before training) and saves a grid; `finish()` adds the accuracy plot and `eval_before.png` /
`eval_after.png`. With `trainer.evaluation.kind: shapes` the rows hold the shapes-world checker's
accuracies and the grids are captioned with prompt and verdict.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from serve_app.trainer.config import TrainerRunConfig
from serve_app.trainer.outputs import MetricsLog, save_image_grid

BASE_COLUMNS = ["step", "split", "policy_version", "train_minutes", "images_sampled", "eval_reward_mean"]


class RunEvaluator:
    def __init__(self, config: TrainerRunConfig, client: Any, out: Path, *, append: bool = False) -> None:
        self.config, self.client, self.out = config, client, out
        self.settings = config.trainer.evaluation
        self.shapes = self.settings.kind == "shapes"
        if self.shapes:
            from serve_app.shapes.evaluation import EVAL_COLUMNS, eval_prompts

            self.splits = {split: eval_prompts(split) for split in self.settings.splits}
            columns = BASE_COLUMNS + list(EVAL_COLUMNS)
        else:
            self.splits = {"prompts": self.settings.prompts or config.trainer.prompts[: config.trainer.prompts_per_step]}
            columns = BASE_COLUMNS
        self.log = MetricsLog(out / "eval.csv", append=append, columns=columns)

    @property
    def rows(self) -> list[dict[str, float]]:
        """The first split's rows (what summaries and benchmarks compare)."""
        first = next(iter(self.splits))
        return [r for r in self.log.rows if r.get("split", first) == first]

    def _grid_path(self, step: int, split: str) -> Path:
        return self.out / (f"eval_step{step:05d}.png" if split == next(iter(self.splits)) else f"eval_{split}_step{step:05d}.png")

    def evaluate(self, step: int, version: int, *, train_minutes: float, images_sampled: int) -> dict[str, float]:
        """One row per split; returns the first split's."""
        rows = [self._evaluate_split(split, prompts, step, version, train_minutes=train_minutes,
                                     images_sampled=images_sampled) for split, prompts in self.splits.items()]
        return rows[0]

    def _evaluate_split(self, split: str, split_prompts: list[str], step: int, version: int, *,
                        train_minutes: float, images_sampled: int) -> dict[str, float]:
        validation = self.config.validation
        sampling = self.config.sampling.for_validation(num_steps=validation.num_steps, seed=validation.seed)
        per_prompt = self.settings.samples_per_prompt
        batch = self.client.rollout(split_prompts, per_prompt, sampling=sampling, policy_version=version,
                                    seed=validation.seed, timeout_s=self.config.trainer.rollout_timeout_s)
        images = batch.trajectory.images
        prompts = [split_prompts[i] for i in batch.trajectory.prompt_index.tolist()]
        row = {"step": step, "split": split, "policy_version": version, "train_minutes": train_minutes,
               "images_sampled": images_sampled, "eval_reward_mean": float(batch.rewards["total"].mean())}
        shown = min(self.settings.grid_samples, per_prompt)
        keep = torch.tensor([i for i in range(len(prompts)) if i % per_prompt < shown])
        path = self._grid_path(step, split)
        if self.shapes:
            from serve_app.shapes.evaluation import save_labelled_grid, score_images

            row.update(score_images(images, prompts))
            save_labelled_grid(images[keep], [prompts[i] for i in keep.tolist()], path, columns=shown,
                               title=f"{split} prompts, step {step} (policy v{version}): "
                                     f"strict accuracy {row['strict_accuracy']:.0%}")
        else:
            save_image_grid(images[keep], path, columns=shown)
        self.log.append(row)
        return row

    def finish(self) -> None:
        if not self.rows:
            return
        first, last = int(self.rows[0]["step"]), int(self.rows[-1]["step"])
        for split in self.splits:
            suffix = "" if split == next(iter(self.splits)) else f"_{split}"
            shutil.copyfile(self._grid_path(first, split), self.out / f"eval_before{suffix}.png")
            shutil.copyfile(self._grid_path(last, split), self.out / f"eval_after{suffix}.png")
        if self.shapes:
            plot_accuracy(self.log.rows, self.out / "eval_accuracy.png")

    def summary(self) -> str:
        lines = []
        key = "strict_accuracy" if self.shapes else "eval_reward_mean"
        for split, prompts in self.splits.items():
            rows = [r for r in self.log.rows if r.get("split", split) == split]
            if len(rows) < 2:
                continue
            first, last = rows[0], rows[-1]
            change = last[key] - first[key]
            shown = (f"{first[key]:.1%} -> {last[key]:.1%} ({100 * change:+.1f} points)" if self.shapes
                     else f"{first[key]:.5f} -> {last[key]:.5f} ({change:+.5f})")
            lines.append(f"eval {key} on {len(prompts)} {split} prompts x {self.settings.samples_per_prompt} seeds: "
                         f"{shown} from step {int(first['step'])} to {int(last['step'])} "
                         f"({last['train_minutes']:.1f} min of training)")
        return "\n".join(lines)


def plot_accuracy(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serve_app.shapes.evaluation import EVAL_COLUMNS

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    splits = list(dict.fromkeys(r.get("split", "") for r in rows))
    for split, line in zip(splits, ("-", ":")):
        mine = [r for r in rows if r.get("split", "") == split]
        steps = [r["step"] for r in mine]
        for column, colour in zip(EVAL_COLUMNS, ("k", "tab:purple", "tab:blue", "tab:red", "tab:green")):
            strict = column == "strict_accuracy"
            ax.plot(steps, [r.get(column, math.nan) for r in mine], line, color=colour, marker="o" if strict else None,
                    linewidth=2.5 if strict else 1, label=f"{column} ({split})")
    ax.set_xlabel("training step")
    ax.set_ylabel("accuracy (ODE, fixed seeds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
