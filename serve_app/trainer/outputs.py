"""What a run leaves in `outputs/<run>/`: metrics.csv, reward_curve.png and image grids (eval.csv: evaluation.py)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import torch

METRIC_COLUMNS = [
    "step", "policy_version", "reward_mean", "reward_std", "advantage_mean", "advantage_std",
    "ratio_mean", "ratio_min", "ratio_max", "onpolicy_ratio_dev", "clip_frac", "approx_kl", "kl", "loss",
    "grad_norm", "tied_group_fraction", "sample_images_per_s", "train_images_per_s", "weight_sync_s",
    "step_seconds", "staleness", "dropped_batches", "trainer_idle_s", "rollout_wait_s", "eval_reward_mean",
]


class MetricsLog:
    """One CSV row per step; columns not in `columns` (e.g. `reward_<key>_mean`) are added from the first row."""

    def __init__(self, path: Path, *, append: bool = False, columns: list[str] | None = None) -> None:
        self.path = path
        self.leading = columns or METRIC_COLUMNS
        self.rows: list[dict[str, float]] = []
        self.columns: list[str] | None = None
        if append and path.is_file():
            with path.open() as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows = [{k: _number_or_text(v) for k, v in row.items() if v not in ("", None)} for row in reader]

    def append(self, row: dict[str, float]) -> None:
        if self.columns is None:
            extra = sorted(k for k in row if k not in self.leading)
            self.columns = self.leading + extra
            with self.path.open("w", newline="") as f:
                csv.DictWriter(f, self.columns).writeheader()
        self.rows.append(row)
        with self.path.open("a", newline="") as f:
            csv.DictWriter(f, self.columns, extrasaction="ignore").writerow(
                {k: ("" if row.get(k) is None else row.get(k)) for k in self.columns}
            )

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint, and rewrite the file."""
        self.rows = [r for r in self.rows if r["step"] <= step]
        if self.columns is not None:
            with self.path.open("w", newline="") as f:
                writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
                writer.writeheader()
                for row in self.rows:
                    writer.writerow(row)


def _number_or_text(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value  # e.g. eval.csv's split


def plot_reward_curve(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    mean = [r["reward_mean"] for r in rows]
    std = [r["reward_std"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, mean, label="reward mean (rollout)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    evals = [(r["step"], r["eval_reward_mean"]) for r in rows if not math.isnan(r.get("eval_reward_mean", math.nan))]
    if evals:
        ax.plot(*zip(*evals), "o-", label="reward mean (ODE eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def save_image_grid(images: torch.Tensor, path: Path, *, columns: int) -> None:
    """uint8 [B, 3, H, W] -> one PNG, `columns` images a row (a group a row when columns = group size).
    Videos uint8 [B, F, 3, H, W] are filmstrips: one video a row, its frames in order."""
    from PIL import Image

    if images.ndim == 5:
        images, columns = images.flatten(0, 1), images.shape[1]
    b, _, h, w = images.shape
    rows = math.ceil(b / columns)
    grid = torch.zeros(3, rows * h, columns * w, dtype=torch.uint8)
    for i in range(b):
        r, c = divmod(i, columns)
        grid[:, r * h:(r + 1) * h, c * w:(c + 1) * w] = images[i]
    Image.fromarray(grid.permute(1, 2, 0).contiguous().numpy()).save(path)
