"""The trainer against the whole app in Serve's local testing mode (one process, real handles)."""

import math

import pytest
import torch
from ray import serve

from serve_app.app import AppArgs, build_app
from serve_app.client import RolloutClient
from serve_app.errors import PolicyVersionError
from serve_app.flowgrpo.sampler import replay_step
from serve_app.trainer import trainer as trainer_module
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.trainer import FlowGRPOTrainer, TrainingDivergedError, load_trainer_policy

# Small and fast: 4 steps, 3 of them stochastic, 2 prompts x 4 samples.
SHARED = ["sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=null"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8",
           "trainer.eval_every=0", "trainer.image_every=1", "trainer.inner_epochs=1"]


@pytest.fixture
def local_app(flowgrpo_home, tmp_path):
    """A fresh app per test with its own weights_dir, so version numbers never collide."""
    from ray.serve.batching import _BatchQueue

    overrides = [*SHARED, f"replica.weights_dir={tmp_path / 'weights'}"]
    with pytest.MonkeyPatch.context() as mp:
        # See tests/deployments/test_app_local.py: local testing mode has no replica context.
        mp.setattr(_BatchQueue, "_warn_if_max_batch_size_exceeds_max_ongoing_requests", lambda self: None)
        handle = serve.run(build_app(AppArgs(config="diffusion_rollout", overrides=overrides)),
                           name=f"trainer-{tmp_path.name}", _local_testing_mode=True)
        yield RolloutClient(handle=handle), overrides


def make_trainer(local_app, tmp_path, *extra):
    client, overrides = local_app
    config = load_trainer_config("trainer/flowgrpo", [*overrides, *TRAINER, *extra])
    # Its own policy: the adapter mutates the transformer, so the session's tiny_policy stays untouched.
    return FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)


def test_first_ratio_is_one_and_published_version_matches_the_replica(local_app, tmp_path):
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2")
    row = trainer.train_step()
    # On-policy: the trainer's weights at version 0 equal the replica's, so every first replay gives 1.
    assert row["policy_version"] == 0
    assert row["onpolicy_ratio_dev"] < 1e-6
    assert abs(row["ratio_max"] - 1) < 1e-6 and abs(row["ratio_min"] - 1) < 1e-6  # one pass: nothing moved yet
    assert trainer.version == 1 and trainer.store.versions() == [1]

    client = trainer.client
    batch = client.rollout(["a photo of a cat"], 3, sampling=trainer.sampling, policy_version=1, seed=7)
    assert batch.policy_version == 1
    trajectory = batch.trajectory
    with torch.no_grad():
        mine = torch.stack([replay_step(trainer.policy, trajectory, k).log_prob for k in range(trajectory.log_probs.shape[1])], 1)
        with trainer.model.reference():
            base = torch.stack([replay_step(trainer.policy, trajectory, k).log_prob for k in range(trajectory.log_probs.shape[1])], 1)
    # The replica installed exactly the trainer's adapter: replayed log-probs agree to fp32 rounding ...
    torch.testing.assert_close(mine, trajectory.log_probs, atol=1e-6, rtol=0)
    # ... and the adapter is not a no-op any more (so the agreement above is a real check).
    assert (base - trajectory.log_probs).abs().max() > 1e-4

    # The next training step is pinned to version 1 and still starts on-policy.
    row = trainer.train_step()
    assert row["policy_version"] == 1 and row["onpolicy_ratio_dev"] < 1e-6
    assert (tmp_path / "out" / "metrics.csv").read_text().splitlines()[0].startswith("step,policy_version,reward_mean")
    assert (tmp_path / "out" / "train_step00000.png").is_file()


def test_unpublished_version_fails(local_app):
    client, _ = local_app
    with pytest.raises(PolicyVersionError, match="version 5"):
        client.rollout(["a cat"], 2, sampling={"num_steps": 4, "guidance_scale": 1.0, "sde_window_size": None},
                       policy_version=5)


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(local_app, tmp_path, monkeypatch):
    trainer = make_trainer(local_app, tmp_path, "trainer.checkpoint_every=1", "trainer.steps=3")
    real = trainer_module.clipped_ratio_loss

    def nan_from_step_1(*args, **kwargs):
        loss, ratio = real(*args, **kwargs)
        return (loss * math.nan if trainer.step >= 1 else loss), ratio

    monkeypatch.setattr(trainer_module, "clipped_ratio_loss", nan_from_step_1)
    trainer.train_step()
    trainer.save_checkpoint()
    checkpoint = tmp_path / "out" / "checkpoint"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    weights_before = {k: v.clone() for k, v in trainer.model.trainable_state().items()}
    with pytest.raises(TrainingDivergedError, match=r"at step 1;.*last finite values \(step 0\): loss"):
        trainer.train(3)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    for k, v in trainer.model.trainable_state().items():
        assert torch.equal(v, weights_before[k])
    assert trainer.store.versions() == [1]  # nothing published for the diverged step


def test_resume_continues_from_the_checkpoint(local_app, tmp_path):
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.checkpoint_every=1")
    trainer.train(2)
    state = trainer.model.trainable_state()
    resumed = FlowGRPOTrainer(trainer.config, trainer.client, tmp_path / "out", policy=load_trainer_policy(trainer.config),
                              resume=tmp_path / "out" / "checkpoint", progress=False)
    assert resumed.step == 2 and resumed.version == trainer.version == 2
    for k, v in resumed.model.trainable_state().items():
        assert torch.equal(v, state[k])
    row = resumed.train_step()
    assert row["step"] == 2 and row["policy_version"] == 2 and row["onpolicy_ratio_dev"] < 1e-6
    assert [int(r["step"]) for r in resumed.metrics.rows] == [0, 1, 2]


def test_reward_rises_with_the_demo_settings(local_app, tmp_path):
    """The demo's own settings (configs/trainer/flowgrpo.yaml: brightness toward 0.2, LoRA lr 5e-2,
    group 16, 2 inner epochs), shortened: the reward must clear 3 step-0 stds within 16 steps."""
    client, overrides = local_app
    config = load_trainer_config("trainer/flowgrpo", [*overrides, "trainer.eval_every=0", "trainer.image_every=0",
                                                      "trainer.checkpoint_every=0"])
    trainer = FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    rows = trainer.train(16)
    rewards = [r["reward_mean"] for r in rows]
    std0 = rows[0]["reward_std"]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last - first > 3 * std0, (rewards, std0)
    assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)
    assert [int(r["policy_version"]) for r in rows] == list(range(16))
