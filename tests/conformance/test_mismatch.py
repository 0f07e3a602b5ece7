"""The trainer's rollout-vs-replay mismatch monitor and truncated importance sampling, on trajectories of
the deliberately imperfect engine (velocities rounded to bf16 during rollout only)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from serve_app.config import IngressConfig
from serve_app.serving.engine_contract import replay_verdict
from serve_app.flowgrpo.advantages import group_advantages
from serve_app.flowgrpo.sampler import replay_step
from serve_app.serving.ingress import RolloutPlanner
from serve_app.rewards import TOTAL_KEY
from serve_app.schemas import PromptEmbeds, RolloutRequest, SamplingParams, Trajectory, TrajectoryBatch
from serve_app.flowgrpo.ratios import summarize_log_ratios
from serve_app.trainer.mismatch import MismatchMonitor, RolloutMismatchError, truncated_is_weight

from tests.conformance.fake_engine import fake_bf16_engine

# No CFG (half the forwards), 3 steps, 2 of them stochastic.
SAMPLING = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=1.0, noise_level=1.0,
                          sde_window_size=2, sde_window_range=(0, 1))


class InProcessSource:
    """The trainer's RolloutSource without Ray: planner -> an engine -> a TrajectoryBatch whose reward is
    the images' mean brightness (what the reward is does not matter here, only that groups differ)."""

    def __init__(self, engine, policy) -> None:
        self.engine = engine
        self.planner = RolloutPlanner(policy.text_processor(), IngressConfig(chunk_size=4), SAMPLING,
                                      policy.geometry, max_work=2**22)

    def rollout(self, prompts, group_size, sampling=None, policy_version=None, seed=None, *, timeout_s=None, fetch=True,
                return_images=False):
        plan = self.planner.plan(RolloutRequest(prompts=list(prompts), group_size=group_size, seed=seed,
                                                policy_version=policy_version))
        results, _ = self.engine.generate(plan.chunks)
        trajectory = Trajectory.cat(results)
        reward = trajectory.images.float().mean(dim=(1, 2, 3)) / 255.0
        return TrajectoryBatch.of(trajectory, prompts, group_size, {TOTAL_KEY: reward},
                                  group_advantages(reward, trajectory.prompt_index).float(), {}, plan.request_id)


@pytest.fixture(scope="module")
def policy(conformance_policies):
    return conformance_policies("tiny-qwen-image")


@pytest.fixture(scope="module")
def fake_batch(policy):
    return InProcessSource(fake_bf16_engine(policy), policy).rollout(["a cat", "a dog"], 2, seed=3)


def test_the_monitor_reports_the_quantiles_the_conformance_check_sees(policy, fake_batch, caplog):
    trajectory = fake_batch.trajectory
    monitor = MismatchMonitor(max_abs_log_ratio=1e-6, action="warn", check_groups="all")
    monitor.check(policy, trajectory, seed=0, micro_batch_size=2)
    with caplog.at_level(logging.WARNING, logger="serve_app.trainer.mismatch"):
        row = monitor.end()
    verdict = replay_verdict(policy, trajectory)
    assert not verdict.ok
    # The same transitions replayed in other batch shapes: equal up to fp32 rounding of O(1) log-probs
    # (a few 1e-7), far below the mismatch itself (~5e-5).
    for q in ("p50", "p99", "max"):
        assert row[f"mismatch_abs_log_ratio_{q}"] == pytest.approx(getattr(verdict.summary, q), abs=1e-6)
    assert row["mismatch_abs_log_ratio_max"] > 10 * 1e-6
    assert "exceeds trainer.mismatch.max_abs_log_ratio 1e-06" in caplog.text
    assert "tis_weight_mean" not in row  # TIS off: no columns for it
    assert row["mismatch_version"] == 0 and row["mismatch_rows"] == len(trajectory) and row["mismatch_check_s"] > 0


def test_stop_raises_at_the_check_and_a_looser_bound_passes(policy, fake_batch, caplog):
    trajectory = fake_batch.trajectory
    strict = MismatchMonitor(max_abs_log_ratio=1e-6, action="stop", check_groups="all")
    with pytest.raises(RolloutMismatchError, match=r"policy version 0, .* p99 .* max .* exceeds"):
        strict.check(policy, trajectory, seed=0, micro_batch_size=2)
    loose = MismatchMonitor(max_abs_log_ratio=0.1, action="stop", check_groups="all")
    with caplog.at_level(logging.WARNING):
        loose.check(policy, trajectory, seed=0, micro_batch_size=2)
        row = loose.end()
    assert 0 < row["mismatch_abs_log_ratio_max"] < 0.1 and "mismatch" not in caplog.text
    # Nothing checked since (end clears the update): the columns are NaN, not zero.
    assert all(math.isnan(v) for v in loose.end().values())


def grouped_trajectory(groups: int, group_size: int) -> Trajectory:
    """A hand-made trajectory of `groups` whole groups (only its layout matters here)."""
    n = groups * group_size
    return Trajectory(
        latents=torch.zeros(n, 2, 4), log_probs=torch.zeros(n, 1), sigmas=torch.linspace(1, 0, 3),
        step_indices=torch.tensor([0]), images=torch.zeros(n, 3, 4, 4, dtype=torch.uint8), seeds=torch.arange(n),
        prompt_embeds=PromptEmbeds(torch.zeros(groups, 2, 4), torch.ones(groups, 2, dtype=torch.bool)),
        embed_row=torch.arange(groups).repeat_interleave(group_size), negative_embeds=None, sampling=SAMPLING,
        prompt_index=torch.arange(groups).repeat_interleave(group_size), sample_index=torch.arange(group_size).repeat(groups),
        policy_version=0, weights_hash="base",
    )


def test_the_checked_rows_are_whole_groups_drawn_with_the_step_seed():
    trajectory = grouped_trajectory(groups=8, group_size=4)
    monitor = MismatchMonitor(max_abs_log_ratio=1e-5, check_groups=2)

    def groups(seed):
        rows = monitor.check_rows(trajectory, seed=seed)
        picked = trajectory.prompt_index[rows].unique()
        # Whole groups, in batch order.
        assert torch.equal(rows, torch.isin(trajectory.prompt_index, picked).nonzero().flatten()) and len(picked) == 2
        return tuple(picked.tolist())

    assert all(groups(seed) == groups(seed) for seed in range(5))  # the same seed, the same rows
    assert len({groups(seed) for seed in range(20)}) > 5  # other steps' seeds, other groups
    assert monitor.check_rows(grouped_trajectory(1, 4), seed=0).tolist() == [0, 1, 2, 3]  # fewer groups: all
    everything = torch.arange(32)
    assert torch.equal(MismatchMonitor(max_abs_log_ratio=1e-5, check_groups="all").check_rows(trajectory, seed=0), everything)
    # TIS needs every row's trainer log-prob.
    assert torch.equal(MismatchMonitor(max_abs_log_ratio=1e-5, tis_cap=2.0).check_rows(trajectory, seed=0), everything)
    with pytest.raises(ValueError, match="check_groups"):
        MismatchMonitor(max_abs_log_ratio=1e-5, check_groups=0)


def test_tis_bounds_the_weights_and_restores_ratio_one(policy, fake_batch):
    trajectory, advantages = fake_batch.trajectory, fake_batch.advantages
    cap = 1.0  # the trainer/rollout log ratios straddle 0: about half the weights are truncated
    monitor = MismatchMonitor(max_abs_log_ratio=1.0, tis_cap=cap)
    monitor.check(policy, trajectory, seed=0, micro_batch_size=4)  # every row: the trainer's old log-probs
    raw, corrected, weights = [], [], []
    with torch.no_grad():
        for rows in torch.arange(len(trajectory)).split(2):
            for k in range(trajectory.log_probs.shape[1]):
                new = replay_step(policy, trajectory, k, rows=rows).log_prob
                rollout = trajectory.log_probs[rows, k]
                old, weighted = monitor.correct(rows, k, rollout, advantages[rows])
                raw.append(new - rollout)
                corrected.append(new - old)
                weights.append(weighted / advantages[rows])
                torch.testing.assert_close(weights[-1], torch.exp(new - rollout).clamp(max=cap), atol=2e-6, rtol=0)
    weights = torch.cat(weights)
    row = monitor.end()
    # Against the trainer's own pre-update log-prob the first ratio is 1 again; against the engine's it is not.
    assert summarize_log_ratios(torch.cat(corrected)).max <= 1e-6
    assert summarize_log_ratios(torch.cat(raw)).max > 1e-5
    assert bool((weights <= cap + 1e-6).all())
    assert 0 < row["tis_truncated_frac"] < 1 and row["tis_weight_mean"] <= cap


def test_truncation_bounds_a_large_mismatch():
    # An engine far off (log ratios up to +-3): the raw importance weights reach e^3 ~ 20, TIS keeps them <= 2.
    rollout = torch.zeros(7)
    trainer = torch.tensor([-3.0, -1.0, -0.1, 0.0, 0.1, 1.0, 3.0])
    weights = truncated_is_weight(trainer, rollout, cap=2.0)
    assert float(torch.exp(trainer - rollout).max()) > 20
    torch.testing.assert_close(weights, torch.tensor([math.exp(-3), math.exp(-1), math.exp(-0.1), 1.0,
                                                      math.exp(0.1), 2.0, 2.0]))
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weight(trainer, rollout, cap=0.0)


def test_the_trainer_logs_the_mismatch_and_trains_through_it_with_tis(policy, fake_batch, tmp_path):
    """One training step against the fake engine: the monitor's columns reach metrics.csv; with TIS the
    on-policy check holds (ratio against the trainer's own pre-update log-probs)."""
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer, OnPolicyMismatchError, load_trainer_policy

    def trainer_with(name, *overrides):
        config = load_trainer_config("trainer/flowgrpo", [
            "sampling.num_steps=3", "sampling.guidance_scale=1.0", "sampling.sde_window_size=2",
            "sampling.sde_window_range=[0,1]", f"replica.weights_dir={tmp_path / name / 'weights'}",
            "trainer.prompts_per_step=2", "trainer.group_size=2", "trainer.micro_batch_size=4",
            "trainer.inner_epochs=1", "trainer.eval_every=0", "trainer.image_every=0", *overrides,
        ])
        # The trainer's own copy (its adapter changes the transformer); the engine samples with the
        # module's untouched policy, so both hold the base weights at version 0.
        return FlowGRPOTrainer(config, InProcessSource(fake_bf16_engine(policy), policy), tmp_path / name / "out",
                               policy=load_trainer_policy(config), progress=False)

    # Without TIS the strict on-policy check catches the engine, as it must.
    with pytest.raises(OnPolicyMismatchError, match="ratio - 1"):
        trainer_with("strict", "trainer.onpolicy_tolerance=1e-6").train_step()
    row = trainer_with("tis", "trainer.mismatch.tis_cap=2.0").train_step()
    assert row["onpolicy_ratio_dev"] < 1e-6
    assert row["mismatch_abs_log_ratio_max"] > 1e-5 and row["mismatch_abs_log_ratio_p50"] <= row["mismatch_abs_log_ratio_p99"]
    assert 0 < row["tis_weight_mean"] <= 2.0
    header = (tmp_path / "tis" / "out" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"mismatch_abs_log_ratio_p50", "mismatch_abs_log_ratio_p99", "mismatch_abs_log_ratio_max",
            "tis_weight_mean", "tis_truncated_frac"} <= set(header)
