"""The moving-shapes evaluator: accuracies with intervals from the checker, the direction headline,
filmstrips and the plot - on rendered videos whose verdicts are known."""

import numpy as np
import pytest
import torch

from serve_app.worlds.motion import MotionSpec, render
from serve_app.worlds.motion.evaluation import EVAL_COLUMNS, MotionEvaluator, eval_prompts, score_videos
from serve_app.trainer.config import load_trainer_config


def rendered(prompts, *, seed=0, frames=4):
    rng = np.random.default_rng(seed)
    specs = [MotionSpec.of(*p.removeprefix("a ").replace(" moving ", " ", 1).split(" ", 2)) for p in prompts]
    return torch.from_numpy(np.stack([render(s, rng, frames=frames) for s in specs]))


def test_splits_partition_the_grammar():
    train, held_out = eval_prompts("train"), eval_prompts("held_out")
    assert len(train) == 36 and len(held_out) == 12 and not set(train) & set(held_out)
    assert eval_prompts("all") == train + held_out
    with pytest.raises(ValueError, match="unknown split"):
        eval_prompts("test")


def test_scores_direction_apart_from_the_rest():
    asked = ["a red circle moving left to right"] * 4
    drawn = ["a red circle moving left to right", "a blue circle moving left to right",
             "a red circle moving right to left", "a red square moving top to bottom"]
    scores = score_videos(rendered(drawn), asked)
    assert scores["direction_accuracy"] == pytest.approx(0.5)  # the blue circle still moves the asked way
    assert scores["strict_accuracy"] == pytest.approx(0.25)
    assert scores["colour_accuracy"] == pytest.approx(0.75)
    assert scores["one_object_direction_accuracy"] == pytest.approx(0.5)  # one object in every frame of all four


def test_a_second_blob_keeps_direction_and_loses_one_object_direction(add_second_blob):
    videos = rendered(["a red circle moving top to bottom"] * 2)
    add_second_blob(videos[1])  # a second object the direction (the largest object's path) ignores
    scores = score_videos(videos, ["a red circle moving top to bottom"] * 2)
    assert scores["direction_accuracy"] == 1.0
    assert scores["count_accuracy"] == scores["one_object_direction_accuracy"] == 0.5


def test_evaluator_headline_intervals_grid_and_plot(tmp_path):
    config = load_trainer_config("trainer/motion")
    evaluator = MotionEvaluator(config, splits=["held_out", "train"], max_images_per_split=24)
    assert list(evaluator.splits()) == ["held_out", "train"]
    assert evaluator.samples_per_prompt("held_out", 32) == 2 and evaluator.samples_per_prompt("train", 32) == 1
    prompts = eval_prompts("held_out")
    videos = rendered(prompts)
    scores = evaluator.score(videos, prompts)
    assert evaluator.headline == "direction_accuracy" and scores.per_image == [1.0] * len(prompts)
    assert set(scores.metrics) == set(evaluator.columns)
    for column in EVAL_COLUMNS:
        assert scores.metrics[f"{column}_lo"] <= scores.metrics[column] <= scores.metrics[f"{column}_hi"]
    assert scores.metrics["direction_accuracy_lo"] < 1.0  # 12 videos do not prove 100%
    evaluator.save_grid(videos[:4], prompts[:4], tmp_path / "grid.png", columns=2, title="rendered")
    rows = [{"step": s, "split": "held_out", **scores.metrics} for s in (0, 10)]
    evaluator.plot(rows, tmp_path)
    assert (tmp_path / "grid.png").stat().st_size > 0 and (tmp_path / "eval_accuracy.png").stat().st_size > 0
