"""Shapes-world evaluation: accuracies from the checker and labelled grids."""

import numpy as np
import pytest
import torch

from serve_app.shapes.evaluation import (
    EVAL_COLUMNS,
    eval_prompts,
    save_labelled_grid,
    score_images,
    verdict_label,
    verdicts,
)
from serve_app.shapes.scene import BACKGROUND, all_prompts, is_held_out, parse_prompt, render


def test_splits_partition_the_grammar():
    train, held_out = eval_prompts("train"), eval_prompts("held_out")
    assert sorted(train + held_out) == sorted(all_prompts()) and not set(train) & set(held_out)
    assert all(is_held_out(p) for p in held_out) and not any(is_held_out(p) for p in train)
    with pytest.raises(ValueError, match="unknown split"):
        eval_prompts("test")


def test_rendered_scenes_score_one_and_blank_images_zero():
    prompts = eval_prompts("held_out")
    rng = np.random.default_rng(0)
    truth = torch.from_numpy(np.stack([render(parse_prompt(p), rng) for p in prompts]))
    scores = score_images(truth, prompts)
    assert set(scores) == set(EVAL_COLUMNS) and all(v == 1.0 for v in scores.values())

    blank = torch.tensor(BACKGROUND, dtype=torch.uint8).view(1, 3, 1, 1).expand(len(prompts), 3, 32, 32)
    assert all(v == 0.0 for v in score_images(blank, prompts).values())


def test_swapped_prompts_get_partial_credit_and_a_label_that_says_why():
    rng = np.random.default_rng(1)
    image = render(parse_prompt("a red circle"), rng)[None]
    scores = score_images(image, ["a blue circle"])  # count and shape right, colour wrong
    assert scores["strict_accuracy"] == 0.0 and scores["partial_score"] == pytest.approx(2 / 3)
    assert (scores["count_accuracy"], scores["colour_accuracy"], scores["shape_accuracy"]) == (1.0, 0.0, 1.0)
    label = verdict_label(verdicts(image, ["a blue circle"])[0])
    assert label.startswith("x colour") and "red circle" in label
    assert verdict_label(verdicts(image, ["a red circle"])[0]) == "OK"


def test_labelled_grid_is_written(tmp_path):
    rng = np.random.default_rng(2)
    prompts = ["a red circle", "two blue squares", "a green triangle"]
    images = np.stack([render(parse_prompt(p), rng) for p in prompts])
    path = save_labelled_grid(images, prompts, tmp_path / "grid.png", columns=2, title="t")
    from PIL import Image

    assert Image.open(path).size[0] > 100
    with pytest.raises(ValueError, match="3 images for 2 prompts"):
        score_images(images, prompts[:2])
