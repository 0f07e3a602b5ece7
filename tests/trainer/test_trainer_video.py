"""The trainer on videos: one FlowGRPO step with the tiny Wan through the whole app (Serve's local testing
mode) replays 5-D trajectories with ratio 1, publishes v1, evaluates it, and the replica serves v1 exactly."""

import pytest
import torch
from PIL import Image

from serve_app.client import RolloutClient
from serve_app.flowgrpo.sampler import replay_step
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.evaluation import change_columns
from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

pytestmark = pytest.mark.slow

SHARED = ["model=tiny_wan", "reward=video_brightness", "sampling.num_frames=5", "sampling.num_steps=3",
          "sampling.guidance_scale=1.0", "sampling.sde_window_size=null"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.micro_batch_size=4", "trainer.eval_every=1",
           "trainer.image_every=1", "trainer.inner_epochs=1", "trainer.lr=1e-2",
           "trainer.lora.target_modules=[to_q,to_k,to_v,to_out.0]"]


def test_one_training_step_on_videos_replays_with_ratio_one(start_local_app, tmp_path):
    overrides = [*SHARED, f"replica.weights_dir={tmp_path / 'weights'}"]
    client = RolloutClient(handle=start_local_app("diffusion_rollout", overrides, name=f"wan-trainer-{tmp_path.name}"))
    config = load_trainer_config("trainer/flowgrpo", [*overrides, *TRAINER])
    trainer = FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    row = trainer.train_step()
    assert row["policy_version"] == 0 and row["onpolicy_ratio_dev"] < 1e-6
    assert abs(row["ratio_max"] - 1) < 1e-6 and abs(row["ratio_min"] - 1) < 1e-6
    assert trainer.version == 1
    # The step's videos as filmstrips: 4 videos a row each, 5 frames of 32 px.
    assert Image.open(tmp_path / "out" / "train_step00000.png").size == (5 * 32, 4 * 32)
    # The ODE evaluation after the step ran on videos too (the video reward's mean, filmstrip grids).
    header, first = (tmp_path / "out" / "eval.csv").read_text().splitlines()[:2]
    assert header.endswith("eval_reward_mean," + ",".join(change_columns("eval_reward_mean")))
    assert first.startswith("1,fixed,1,policy,")
    assert Image.open(tmp_path / "out" / "eval_step00001.png").size[0] == 5 * 32

    batch = client.rollout(["a red circle"], 2, sampling=trainer.sampling, policy_version=1, seed=7)
    trajectory = batch.trajectory
    assert batch.policy_version == 1 and trajectory.images.shape == (2, 5, 3, 32, 32)
    with torch.no_grad():
        window = trajectory.log_probs.shape[1]
        mine = torch.stack([replay_step(trainer.policy, trajectory, k).log_prob for k in range(window)], 1)
        with trainer.model.reference():
            base = torch.stack([replay_step(trainer.policy, trajectory, k).log_prob for k in range(window)], 1)
    torch.testing.assert_close(mine, trajectory.log_probs, atol=1e-6, rtol=0)  # the replica holds v1 exactly
    assert float((base - trajectory.log_probs).abs().max()) > 1e-4  # and v1 is not the base model (6e-4 here)
