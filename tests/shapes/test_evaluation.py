"""Shapes-world evaluation: accuracies from the checker with their intervals, the paired change
against step 0 in eval.csv, and labelled grids."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from serve_app.flowgrpo.seeding import group_layout
from serve_app.rewards import TOTAL_KEY
from serve_app.worlds.shapes.evaluation import (
    EVAL_COLUMNS,
    INTERVAL_COLUMNS,
    ShapesEvaluator,
    eval_prompts,
    intervals,
    save_labelled_grid,
    score_images,
    summarize,
    verdict_label,
    verdicts,
)
from serve_app.worlds.shapes.scene import BACKGROUND, all_prompts, is_held_out, parse_prompt, render
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.evaluation import RunEvaluator, change_columns

BLANK = np.broadcast_to(np.array(BACKGROUND, dtype=np.uint8)[:, None, None], (3, 32, 32))  # no object at all


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


def test_intervals_bracket_the_accuracies():
    prompts = eval_prompts("held_out") * 2
    rng = np.random.default_rng(3)
    images = [render(parse_prompt(p), rng) for p in prompts[:14]]  # the first seed right, the second blank
    images += [BLANK] * 14
    found = verdicts(np.stack(images), prompts)
    scores, bounds = summarize(found), intervals(found)
    assert set(bounds) == set(INTERVAL_COLUMNS)
    for column, value in scores.items():
        assert bounds[f"{column}_lo"] < value == 0.5 < bounds[f"{column}_hi"], column
    # Wilson's interval of 14 of 28
    assert (bounds["strict_accuracy_lo"], bounds["strict_accuracy_hi"]) == pytest.approx((0.326, 0.674), abs=1e-3)


class RenderingClient:
    """A stand-in for the app: the world's renderer draws the first `right` seeds of every prompt
    exactly (of odd-numbered prompts `right_odd`, when given), the others are blank; seeds as the app
    derives them."""

    def __init__(self, right: int, right_odd: int | None = None) -> None:
        self.right = right
        self.right_odd = right if right_odd is None else right_odd

    def rollout(self, prompts, group_size, *, sampling, policy_version, seed, timeout_s, fetch, return_images):
        assert not fetch  # an evaluation reads images and ids, never the transitions
        prompt_index, sample_index, seeds = group_layout(seed, len(prompts), group_size)
        rng = np.random.default_rng(0)
        images = [render(parse_prompt(prompts[p]), rng) if s < (self.right_odd if p % 2 else self.right) else BLANK
                  for p, s in zip(prompt_index.tolist(), sample_index.tolist())]
        header = SimpleNamespace(prompt_index=prompt_index, seeds=seeds)
        return SimpleNamespace(images=torch.from_numpy(np.stack(images)), header=header,
                               rewards={TOTAL_KEY: torch.zeros(len(seeds))})


def _evaluate(evaluator, step):
    return evaluator.evaluate(step, step, weights="policy", train_minutes=float(step), images_sampled=8 * step)


def test_change_against_step_zero_survives_a_resume(tmp_path):
    config = load_trainer_config("trainer/shapes", ["trainer.evaluation.samples_per_prompt=4",
                                                    "trainer.evaluation.args.splits=[held_out]",
                                                    "trainer.evaluation.grid_samples=1"])
    run = RunEvaluator(config, RenderingClient(right=1), tmp_path)
    first = _evaluate(run, 0)
    assert first["strict_accuracy"] == 0.25
    assert [first[c] for c in change_columns("strict_accuracy")] == [0, 0, 0, 0, 0]
    assert (tmp_path / "eval_reference_held_out.json").is_file()

    run.client = RenderingClient(right=3)  # two more seeds of every prompt right: +50 points
    row = _evaluate(run, 1)
    assert row["strict_accuracy_change"] == pytest.approx(0.5)
    # Changes of 0 and 1, half each, on 56 images: about +-13 points around +50.
    assert 0.3 < row["strict_accuracy_change_lo"] < 0.5 < row["strict_accuracy_change_hi"] < 0.7
    # Every prompt changed by the same +50: resampling prompts finds nothing else.
    assert row["strict_accuracy_change_prompt_lo"] == pytest.approx(0.5) == row["strict_accuracy_change_prompt_hi"]

    resumed = RunEvaluator(config, RenderingClient(right=1), tmp_path, append=True)
    row = _evaluate(resumed, 2)
    assert row["strict_accuracy_change"] == 0  # against step 0, not against the last evaluation
    assert row["strict_accuracy_change_lo"] == row["strict_accuracy_change_hi"] == 0
    summary = resumed.summary()
    assert "14 held_out prompts x 4 seeds: 25.0% -> 25.0% (+0.0 points, paired 95% interval" in summary
    assert "not distinguishable from no change over images; +0.0 points to +0.0 points: not" in summary

    resumed.client = RenderingClient(right=4)
    _evaluate(resumed, 3)
    summary = resumed.summary()
    assert "+75.0 points, paired 95% interval +" in summary and ": distinguishable from no change over prompts)" in summary
    resumed.finish()
    assert (tmp_path / "eval_accuracy.png").is_file()

    other_seeds = load_trainer_config("trainer/shapes", ["trainer.evaluation.samples_per_prompt=2",
                                                         "trainer.evaluation.args.splits=[held_out]"])
    with pytest.raises(ValueError, match="pairing needs the same images"):
        _evaluate(RunEvaluator(other_seeds, RenderingClient(right=1), tmp_path, append=True), 4)


def test_eval_csv_has_the_change_over_prompts_wider_when_prompts_differ(tmp_path):
    import csv

    config = load_trainer_config("trainer/shapes", ["trainer.evaluation.samples_per_prompt=4",
                                                    "trainer.evaluation.args.splits=[held_out]",
                                                    "trainer.evaluation.grid_samples=1"])
    run = RunEvaluator(config, RenderingClient(right=1), tmp_path)
    _evaluate(run, 0)
    run.client = RenderingClient(right=4, right_odd=1)  # the even prompts learn (+75 points), the odd ones do not
    row = _evaluate(run, 1)
    assert row["strict_accuracy_change"] == pytest.approx(0.375)
    image = row["strict_accuracy_change_hi"] - row["strict_accuracy_change_lo"]
    prompt = row["strict_accuracy_change_prompt_hi"] - row["strict_accuracy_change_prompt_lo"]
    # 7 prompts of +75 and 7 of 0: the prompt-level interval is about 1.5 times as wide as the image-level one.
    assert prompt > 1.3 * image and row["strict_accuracy_change_prompt_lo"] > 0
    with (tmp_path / "eval.csv").open() as f:
        reader = csv.DictReader(f)
        written = list(reader)
    assert set(change_columns("strict_accuracy")) <= set(reader.fieldnames)
    assert [float(written[1][c]) for c in change_columns("strict_accuracy")] == pytest.approx(
        [row[c] for c in change_columns("strict_accuracy")])
    assert "over images; +" in run.summary() and "over prompts)" in run.summary()


def test_a_large_split_is_capped():
    evaluator = ShapesEvaluator(None, splits=["held_out", "train"], max_images_per_split=448)
    assert evaluator.samples_per_prompt("held_out", 32) == 32  # 14 x 32 = 448
    assert evaluator.samples_per_prompt("train", 32) == 5  # 76 x 5 = 380
    assert evaluator.samples_per_prompt("train", 2) == 2
    assert ShapesEvaluator(None, splits=["train"], max_images_per_split=10).samples_per_prompt("train", 4) == 1
    assert ShapesEvaluator(None, splits=["train"]).samples_per_prompt("train", 32) == 32
    with pytest.raises(ValueError, match="max_images_per_split"):
        ShapesEvaluator(None, max_images_per_split=0)
