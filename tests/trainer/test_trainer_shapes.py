"""The shapes-world run in Serve's local testing mode: evaluations before, during and after training."""

import csv

import pytest
from serve_app.client import RolloutClient
from serve_app.worlds.shapes.evaluation import EVAL_COLUMNS
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

# Whole training steps through the app: seconds each on 2 cores.
pytestmark = pytest.mark.slow


@pytest.fixture
def shapes_app(start_local_app, tmp_path):
    overrides = [f"replica.weights_dir={tmp_path / 'weights'}", "validation.num_steps=4"]
    handle = start_local_app("shapes_rollout", overrides, name=f"shapes-{tmp_path.name}")
    return RolloutClient(handle=handle), overrides


def test_eval_csv_grids_and_plot(shapes_app, tmp_path):
    client, overrides = shapes_app
    config = load_trainer_config("trainer/shapes", [
        *overrides, "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.eval_every=1",
        "trainer.evaluation.samples_per_prompt=1", "trainer.evaluation.grid_samples=1", "trainer.image_every=0",
        "trainer.evaluation.args.splits=[held_out,train]",
        "trainer.checkpoint_every=0", "sampling.num_steps=6", "sampling.sde_window_range=[0,3]",
        "trainer.max_staleness=0",  # the demo pipelines; this test checks every step is exactly on-policy
    ])
    assert len(config.trainer.prompts) == 76  # the train split, not the held-out prompts evaluated below
    trainer = FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    rows = trainer.train()
    out = tmp_path / "out"
    assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)
    with (out / "eval.csv").open() as f:
        both = list(csv.DictReader(f))
    assert [(int(r["step"]), r["split"]) for r in both] == [(s, split) for s in (0, 1, 2) for split in ("held_out", "train")]
    assert all(int(r["step"]) == 0 or r["images_sampled"] != "0" for r in both)
    evals = [r for r in both if r["split"] == "held_out"]
    assert [int(r["step"]) for r in evals] == [0, 1, 2]  # before training, then after each update
    assert [int(r["policy_version"]) for r in evals] == [0, 1, 2]
    assert [int(r["images_sampled"]) for r in evals] == [0, 8, 16]
    for row in evals:
        for column in EVAL_COLUMNS:
            assert 0.0 <= float(row[f"{column}_lo"]) <= float(row[column]) <= float(row[f"{column}_hi"]) <= 1.0
        change = float(row["strict_accuracy_change"])
        assert float(row["strict_accuracy_change_lo"]) <= change <= float(row["strict_accuracy_change_hi"])
        # One seed a prompt: resampling prompts is resampling images, the two intervals are one.
        assert (row["strict_accuracy_change_prompt_lo"], row["strict_accuracy_change_prompt_hi"]) == (
            row["strict_accuracy_change_lo"], row["strict_accuracy_change_hi"])
        # Paired: the same 14 images' verdicts against step 0's, so the change is what the rows say.
        assert change == pytest.approx(float(row["strict_accuracy"]) - float(evals[0]["strict_accuracy"]))
    assert (out / "eval_reference_held_out.json").is_file() and (out / "eval_reference_train.json").is_file()
    # The rows are the checker's verdicts on 14 held-out prompts x 1 fixed seed: multiples of 1/14.
    assert all(abs(float(r["strict_accuracy"]) * 14 - round(float(r["strict_accuracy"]) * 14)) < 1e-9 for r in evals)
    for name in ("eval_before.png", "eval_after.png", "eval_before_train.png", "eval_after_train.png",
                 "eval_accuracy.png", "eval_step00001.png", "eval_train_step00001.png", "reward_curve.png"):
        assert (out / name).is_file(), name
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["step", "policy_version", "reward_mean"]
    assert "reward_shapes_strict_mean" in header and "reward_shapes_partial_mean" in header
    assert "strict_accuracy" in trainer.summary() and "paired 95% interval" in trainer.summary()
