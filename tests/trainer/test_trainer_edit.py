"""The editing-world run in Serve's local testing mode: prompts with source images, rewards that see
them, on-policy replays, and evaluations of held-out instructions against their own sources."""

import csv

import pytest
from serve_app.client import RolloutClient
from serve_app.worlds.edit.evaluation import EVAL_COLUMNS
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

pytestmark = pytest.mark.slow


def test_edit_world_training_steps_and_evaluations(start_local_app, tmp_path):
    overrides = [f"replica.weights_dir={tmp_path / 'weights'}", "validation.num_steps=4"]
    client = RolloutClient(handle=start_local_app("edit_rollout", overrides, name=f"edit-{tmp_path.name}"))
    config = load_trainer_config("trainer/edit", [
        *overrides, "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.eval_every=2",
        "trainer.evaluation.samples_per_prompt=1", "trainer.evaluation.grid_samples=1", "trainer.image_every=0",
        "trainer.evaluation.args.scenes_per_instruction={held_out: 2, train: 1}",
        "trainer.checkpoint_every=0", "sampling.num_steps=6", "sampling.sde_window_range=[0,3]", "trainer.max_staleness=0",
    ])
    trainer = FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    rows = trainer.train()
    out = tmp_path / "out"
    assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)  # replays see the sources the samples saw
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "reward_edit_strict_mean" in header and "reward_edit_partial_mean" in header
    with (out / "eval.csv").open() as f:
        evals = list(csv.DictReader(f))
    assert [(int(r["step"]), r["split"]) for r in evals] == [(s, split) for s in (0, 2) for split in ("held_out", "train")]
    held_out = [r for r in evals if r["split"] == "held_out"]
    for row in held_out:
        for column in EVAL_COLUMNS:
            assert 0.0 <= float(row[f"{column}_lo"]) <= float(row[column]) <= float(row[f"{column}_hi"]) <= 1.0
        # 6 held-out instructions x 2 scenes x 1 seed: multiples of 1/12.
        assert abs(float(row["strict_accuracy"]) * 12 - round(float(row["strict_accuracy"]) * 12)) < 1e-9
    assert float(held_out[1]["strict_accuracy_change"]) == pytest.approx(
        float(held_out[1]["strict_accuracy"]) - float(held_out[0]["strict_accuracy"]))
    for name in ("eval_before.png", "eval_after.png", "eval_after_train.png", "eval_accuracy.png"):
        assert (out / name).is_file(), name
