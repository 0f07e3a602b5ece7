"""The edit rewards (called with each sample's input image) and the evaluator through the trainer's
RunEvaluator: the request carries the split's source images, and every edit is scored against its own."""

import csv
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from serve_app.flowgrpo.seeding import group_layout
from serve_app.rewards import TOTAL_KEY
from serve_app.rewards.registry import declares_input_images
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.evaluation import RewardEvaluator, RunEvaluator
from serve_app.worlds.edit import parse_instruction
from serve_app.worlds.edit.evaluation import EditEvaluator, eval_examples, train_prompts
from serve_app.worlds.edit.rewards import edit_partial, edit_strict


def test_rewards_compare_each_edit_with_its_own_source():
    examples = eval_examples("held_out", 2)[:4]
    prompts = [e.instruction.text() for e in examples]
    sources = [[torch.from_numpy(e.source.render())] for e in examples]
    targets = torch.from_numpy(np.stack([e.target.render() for e in examples]))
    assert declares_input_images("serve_app.worlds.edit.rewards:edit_strict")
    assert declares_input_images("serve_app.worlds.edit.rewards:edit_partial")
    assert edit_strict()(targets, prompts, input_images=sources).tolist() == [1.0] * 4
    unchanged = torch.stack([s[0] for s in sources])
    assert edit_strict()(unchanged, prompts, input_images=sources).tolist() == [0.0] * 4
    assert all(0 < v < 1 for v in edit_partial()(unchanged, prompts, input_images=sources).tolist())
    # The same edits scored against the sources of other prompts: not these edits.
    shifted = sources[1:] + sources[:1]
    assert edit_strict()(targets, prompts, input_images=shifted).sum() < 4
    with pytest.raises(ValueError, match="one input image"):
        edit_strict()(targets, prompts, input_images=[[]] * 4)


class EditClient:
    """A stand-in for the app that draws each prompt's target scene (`perfect`) or returns its source."""

    def __init__(self, perfect) -> None:
        self.perfect, self.requests = perfect, []
        self.targets = {(e.instruction.text(), e.source.render().tobytes()): e.target.render()
                        for s in ("held_out", "train") for e in eval_examples(s)}

    def rollout(self, prompts, group_size, *, sampling, policy_version, seed, timeout_s, fetch, return_images, images):
        self.requests.append((list(prompts), images))
        prompt_index, _, seeds = group_layout(seed, len(prompts), group_size)
        drawn = []
        for p in prompt_index.tolist():
            source = images[p][0].numpy()
            drawn.append(self.targets[prompts[p], source.tobytes()] if self.perfect(p) else source)
        header = SimpleNamespace(prompt_index=prompt_index, seeds=seeds)
        return SimpleNamespace(images=torch.from_numpy(np.stack(drawn)), header=header,
                               rewards={TOTAL_KEY: torch.zeros(len(seeds))})


def test_the_evaluator_sends_and_scores_against_each_prompts_source(tmp_path):
    config = load_trainer_config("trainer/edit", ["trainer.evaluation.samples_per_prompt=2"])
    client = EditClient(lambda p: False)
    run = RunEvaluator(config, client, tmp_path)
    first = run.evaluate(0, 0, weights="policy", train_minutes=0.0, images_sampled=0)
    prompts, images = client.requests[0]
    assert len(prompts) == 48 and len(images) == 48 and all(len(i) == 1 for i in images)  # 6 held-out x 8 scenes
    assert len(set(prompts)) == 6 and {parse_instruction(p).text() for p in prompts} == set(prompts)
    assert first["strict_accuracy"] == 0.0 and first["kept_accuracy"] == 1.0
    # Prompts 0-23 edited right: half the held-out prompts (three of the six instructions).
    client.perfect = lambda p: p < 24
    row = run.evaluate(1, 1, weights="policy", train_minutes=1.0, images_sampled=8)
    assert row["strict_accuracy"] == pytest.approx(0.5) == pytest.approx(row["strict_accuracy_change"])
    # The prompt-level interval resamples the 48 (instruction, scene) prompts: wider than over 96 images,
    # and clear of zero.
    lo, hi = row["strict_accuracy_change_lo"], row["strict_accuracy_change_hi"]
    prompt_lo, prompt_hi = row["strict_accuracy_change_prompt_lo"], row["strict_accuracy_change_prompt_hi"]
    assert 0 < prompt_lo < lo < 0.5 < hi < prompt_hi
    run.finish()
    for name in ("eval_before.png", "eval_after.png", "eval_before_train.png", "eval_accuracy.png"):
        assert (tmp_path / name).is_file(), name
    with (tmp_path / "eval.csv").open() as f:
        assert [r["split"] for r in csv.DictReader(f)] == ["held_out", "train"] * 2


def test_the_trainer_prompts_carry_their_source_images():
    config = load_trainer_config("trainer/edit")
    prompts = config.trainer.training_prompts()
    assert [p.text for p in prompts] == config.trainer.prompts and len(prompts) == 21 * 24
    assert all(len(p.images) == 1 and p.images[0].dtype == torch.uint8 for p in prompts)
    held_out = {e.instruction.text() for e in eval_examples("held_out")}
    assert not held_out & set(config.trainer.prompts)
    # Seeded, and varied: each instruction with scenes of its own.
    again = train_prompts()
    assert all(torch.equal(a.images[0], b.images[0]) for a, b in zip(prompts, again, strict=True))
    assert len({p.images[0].numpy().tobytes() for p in again}) > len(again) // 2
    assert isinstance(EditEvaluator(config, splits=["train"]).input_images("train")[0][0], torch.Tensor)


def test_the_default_evaluator_sends_its_prompts_images():
    config = load_trainer_config("trainer/edit")
    evaluator = RewardEvaluator(config)
    first = config.trainer.training_prompts()[: config.trainer.prompts_per_step]
    assert evaluator.splits() == {"fixed": [p.text for p in first]}
    sent = evaluator.input_images("fixed")
    assert len(sent) == 8 and all(torch.equal(s[0], p.images[0]) for s, p in zip(sent, first, strict=True))
    assert RewardEvaluator(load_trainer_config("trainer/flowgrpo")).input_images("fixed") is None
