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

BASE_COLUMNS = ["step", "policy_version", "train_minutes", "images_sampled", "eval_reward_mean"]


class RunEvaluator:
    def __init__(self, config: TrainerRunConfig, client: Any, out: Path, *, append: bool = False) -> None:
        self.config, self.client, self.out = config, client, out
        self.settings = config.trainer.evaluation
        self.shapes = self.settings.kind == "shapes"
        if self.shapes:
            from serve_app.shapes.evaluation import EVAL_COLUMNS, eval_prompts

            self.prompts = self.settings.prompts or eval_prompts("held_out")
            columns = BASE_COLUMNS + list(EVAL_COLUMNS)
        else:
            self.prompts = self.settings.prompts or config.trainer.prompts[: config.trainer.prompts_per_step]
            columns = BASE_COLUMNS
        self.log = MetricsLog(out / "eval.csv", append=append, columns=columns)

    @property
    def rows(self) -> list[dict[str, float]]:
        return self.log.rows

    def evaluate(self, step: int, version: int, *, train_minutes: float, images_sampled: int) -> dict[str, float]:
        validation = self.config.validation
        sampling = self.config.sampling.for_validation(num_steps=validation.num_steps, seed=validation.seed)
        per_prompt = self.settings.samples_per_prompt
        batch = self.client.rollout(self.prompts, per_prompt, sampling=sampling, policy_version=version,
                                    seed=validation.seed, timeout_s=self.config.trainer.rollout_timeout_s)
        images = batch.trajectory.images
        prompts = [self.prompts[i] for i in batch.trajectory.prompt_index.tolist()]
        row = {"step": step, "policy_version": version, "train_minutes": train_minutes,
               "images_sampled": images_sampled, "eval_reward_mean": float(batch.rewards["total"].mean())}
        shown = min(self.settings.grid_samples, per_prompt)
        keep = torch.tensor([i for i in range(len(prompts)) if i % per_prompt < shown])
        path = self.out / f"eval_step{step:05d}.png"
        if self.shapes:
            from serve_app.shapes.evaluation import save_labelled_grid, score_images

            row.update(score_images(images, prompts))
            save_labelled_grid(images[keep], [prompts[i] for i in keep.tolist()], path, columns=shown,
                               title=f"step {step} (policy v{version}): strict accuracy {row['strict_accuracy']:.0%}")
        else:
            save_image_grid(images[keep], path, columns=shown)
        self.log.append(row)
        return row

    def finish(self) -> None:
        if not self.rows:
            return
        first, last = int(self.rows[0]["step"]), int(self.rows[-1]["step"])
        shutil.copyfile(self.out / f"eval_step{first:05d}.png", self.out / "eval_before.png")
        shutil.copyfile(self.out / f"eval_step{last:05d}.png", self.out / "eval_after.png")
        if self.shapes:
            plot_accuracy(self.rows, self.out / "eval_accuracy.png")

    def summary(self) -> str:
        if len(self.rows) < 2:
            return ""
        first, last = self.rows[0], self.rows[-1]
        key = "strict_accuracy" if self.shapes else "eval_reward_mean"
        change = last[key] - first[key]
        shown = f"{first[key]:.1%} -> {last[key]:.1%} ({100 * change:+.1f} points)" if self.shapes else \
            f"{first[key]:.5f} -> {last[key]:.5f} ({change:+.5f})"
        return (f"eval {key} on {len(self.prompts)} prompts x {self.settings.samples_per_prompt} seeds: {shown} "
                f"from step {int(first['step'])} to {int(last['step'])} ({last['train_minutes']:.1f} min of training)")


def plot_accuracy(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from serve_app.shapes.evaluation import EVAL_COLUMNS

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for column in EVAL_COLUMNS:
        values = [r.get(column, math.nan) for r in rows]
        ax.plot(steps, values, "o-" if column == "strict_accuracy" else ".--", label=column,
                linewidth=2.5 if column == "strict_accuracy" else 1)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out accuracy (ODE)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
