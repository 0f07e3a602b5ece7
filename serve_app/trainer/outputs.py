"""What a run leaves in `outputs/<run>/`: metrics.csv (one row a step), reward_curve.png, image grids and
the summary it prints (eval.csv: evaluation.py; checkpoints: checkpoint.py)."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from serve_app.rewards import TOTAL_KEY
from serve_app.trainer.statistics import first_and_last, welch_t

if TYPE_CHECKING:
    from serve_app.schemas import TrajectoryBatch
    from serve_app.trainer.update import UpdateStats

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
        self.rows[:] = [r for r in self.rows if r["step"] <= step]  # in place: others hold the list
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


# Pixels per inch of a captioned grid: its cells and font sizes are given in inches and points, as a figure's.
GRID_DPI = 130
_PASSED, _FAILED = (0, 100, 0), (139, 0, 0)  # dark green, dark red


def _wrapped(text: str, font, width: float) -> list[str]:
    """`text`'s lines, each broken at spaces to fit `width` pixels (a word longer than that keeps a line of its own)."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if line and font.getlength(candidate) > width:
                lines.append(line)
                candidate = word
            line = candidate
        lines.append(line)
    return lines


def save_captioned_grid(pictures: Sequence[np.ndarray], captions: Sequence[str], passed: Sequence[bool], path: Path, *,
                        columns: int, cell_inches: tuple[float, float], fontsize: float = 5.5, title: str = "",
                        title_size: float = 9) -> Path:
    """Pictures (uint8 [H, W, 3]) in a grid of `columns`, each scaled up (nearest) above its caption, the caption
    green when it `passed` and red when not (the worlds' evaluation grids). Drawn with PIL: an evaluation of a
    hundred images writes its grid in milliseconds, where laying out as many captioned plots took seconds."""
    from PIL import Image, ImageDraw, ImageFont

    pad = 4
    cell_w, cell_h = (round(inches * GRID_DPI) for inches in cell_inches)
    font = ImageFont.load_default(size=fontsize * GRID_DPI / 72)
    title_font = ImageFont.load_default(size=title_size * GRID_DPI / 72)
    line_h = font.getbbox("Ag")[3] + 2
    wrapped = [_wrapped(caption, font, cell_w - 2 * pad) for caption in captions]
    caption_h = max((len(lines) for lines in wrapped), default=0) * line_h
    title_lines = _wrapped(title, title_font, columns * cell_w - 2 * pad) if title else []
    title_h = len(title_lines) * (title_font.getbbox("Ag")[3] + 2) + (pad if title else 0)
    rows = -(-len(pictures) // columns)
    canvas = Image.new("RGB", (columns * cell_w, title_h + rows * cell_h), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.multiline_text((canvas.width / 2, pad), "\n".join(title_lines), fill="black", font=title_font,
                            anchor="ma", align="center")
    room_w, room_h = cell_w - 2 * pad, max(cell_h - caption_h - 3 * pad, 1)
    for i, (picture, lines, ok) in enumerate(zip(pictures, wrapped, passed)):
        row, column = divmod(i, columns)
        left, top = column * cell_w, title_h + row * cell_h
        image = Image.fromarray(np.ascontiguousarray(picture))
        scale = min(room_w / image.width, room_h / image.height)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.NEAREST)
        canvas.paste(image, (left + (cell_w - image.width) // 2, top + pad))
        draw.multiline_text((left + cell_w / 2, top + 2 * pad + image.height), "\n".join(lines), font=font,
                            fill=_PASSED if ok else _FAILED, anchor="ma", align="center")
    path = Path(path)
    canvas.save(path)
    return path


def metrics_row(step: int, batch: TrajectoryBatch, stats: UpdateStats, *, inner_epochs: int, sample_s: float,
                train_s: float, weight_sync_s: float, step_s: float) -> dict[str, float]:
    """One step's metrics.csv row: the rollout's rewards and advantages, the update's ratios and losses,
    and where the time went."""
    # DiffusionNFT has no ratio: its ratio columns are NaN.
    ratios = torch.cat(stats.ratios) if stats.ratios else torch.full((1,), math.nan)
    total = batch.rewards[TOTAL_KEY]
    advantages = batch.advantages.float()
    n = len(batch)
    row = {
        "step": step,
        "policy_version": batch.policy_version,
        "reward_mean": float(total.mean()),
        "reward_std": float(total.std(unbiased=False)),
        "advantage_mean": float(advantages.mean()),
        "advantage_std": float(advantages.std(unbiased=False)),
        "ratio_mean": float(ratios.mean()),
        "ratio_min": float(ratios.min()),
        "ratio_max": float(ratios.max()),
        "onpolicy_ratio_dev": stats.onpolicy_ratio_dev,
        "clip_frac": _mean(stats.clip_fracs),
        "approx_kl": _mean(stats.approx_kls),
        "kl": _mean(stats.kls),
        "loss": statistics.mean(stats.losses),
        "grad_norm": statistics.mean(stats.grad_norms),
        "tied_group_fraction": float(batch.metrics.get("tied_group_fraction", math.nan)),
        "sample_images_per_s": n / sample_s,
        "train_images_per_s": n * inner_epochs / train_s,
        "weight_sync_s": weight_sync_s,
        "step_seconds": step_s,
        "eval_reward_mean": math.nan,
    }
    for key, value in batch.rewards.items():
        if key != TOTAL_KEY:
            row[f"reward_{key}_mean"] = float(value.mean())
    return row


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else math.nan


def run_summary(rows: list[dict[str, float]], *, evaluation: str, final_version: int, out: Path) -> str:
    """What the run printed at its end: the evaluation's summary, the reward's change, seconds a step."""
    if not rows:
        return "no steps"
    per_step = statistics.mean(r["step_seconds"] for r in rows)
    rewards = [r["reward_mean"] for r in rows]
    if len(rewards) >= 4:
        first, last = first_and_last(rewards)
        change = (f"reward mean of the first {len(first)} steps {statistics.mean(first):.5f}, of the last "
                  f"{len(last)} {statistics.mean(last):.5f} (Welch t {welch_t(first, last):+.1f} against the "
                  "step-to-step noise)")
    else:
        change = f"reward mean {statistics.mean(rewards):.5f}"
    return (
        (f"{evaluation}\n" if evaluation else "")
        + f"steps {len(rows)} | {change} | {per_step:.1f} s/step | final policy version {final_version} | "
        f"outputs in {out}"
    )
