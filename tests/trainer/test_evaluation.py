"""The default evaluator (the configured reward): its paired change against step 0 in eval.csv, with the
interval over images and the one over prompts, and the summary that states both."""

import csv
from types import SimpleNamespace

import pytest
import torch

from serve_app.flowgrpo.seeding import group_layout
from serve_app.rewards import TOTAL_KEY
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.evaluation import RewardEvaluator, RunEvaluator, change_columns

PROMPTS = ["a photo of a cat", "a red house", "a bowl of fruit", "a mountain lake at dawn"]


class RewardClient:
    """A stand-in for the app: image (prompt p, sample s) gets the reward `reward(p, s)`; seeds as the app
    derives them."""

    def __init__(self, reward) -> None:
        self.reward = reward

    def rollout(self, prompts, group_size, *, sampling, policy_version, seed, timeout_s, fetch, return_images):
        assert not fetch  # an evaluation reads images and ids, never the transitions
        prompt_index, sample_index, seeds = group_layout(seed, len(prompts), group_size)
        rewards = torch.tensor([self.reward(p, s) for p, s in zip(prompt_index.tolist(), sample_index.tolist())])
        images = torch.zeros(len(seeds), 3, 8, 8, dtype=torch.uint8)
        header = SimpleNamespace(prompt_index=prompt_index, seeds=seeds)
        return SimpleNamespace(images=images, header=header, rewards={TOTAL_KEY: rewards})


def test_the_reward_change_has_intervals_over_images_and_over_prompts(tmp_path):
    config = load_trainer_config("trainer/flowgrpo", [f"trainer.evaluation.args.prompts=[{','.join(PROMPTS)}]",
                                                      "trainer.evaluation.samples_per_prompt=8"])
    assert RewardEvaluator.paired
    run = RunEvaluator(config, RewardClient(lambda p, s: 0.5 + 0.01 * s), tmp_path)
    first = run.evaluate(0, 0, weights="policy", train_minutes=0.0, images_sampled=0)
    assert [first[c] for c in change_columns("eval_reward_mean")] == [0, 0, 0, 0, 0]
    # Every seed of prompt p gains 0.1 (p + 1): the seeds agree, the prompts do not.
    run.client = RewardClient(lambda p, s: 0.5 + 0.01 * s + 0.1 * (p + 1))
    row = run.evaluate(1, 1, weights="policy", train_minutes=1.0, images_sampled=64)
    change, lo, hi, prompt_lo, prompt_hi = (row[c] for c in change_columns("eval_reward_mean"))
    assert change == pytest.approx(0.25) == pytest.approx(row["eval_reward_mean"] - first["eval_reward_mean"])
    assert lo <= change <= hi and prompt_lo <= change <= prompt_hi
    # 32 images but 4 prompts: resampling the prompts gives about twice the width.
    assert prompt_hi - prompt_lo > 1.5 * (hi - lo)
    with (tmp_path / "eval.csv").open() as f:
        reader = csv.DictReader(f)
        written = list(reader)
    assert reader.fieldnames[-5:] == change_columns("eval_reward_mean")
    assert [float(written[1][c]) for c in change_columns("eval_reward_mean")] == pytest.approx([change, lo, hi, prompt_lo,
                                                                                              prompt_hi])
    summary = run.summary()
    assert "over images; +" in summary and "over prompts)" in summary, summary
