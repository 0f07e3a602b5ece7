"""The trainer against the whole app in Serve's local testing mode (one process, real handles)."""

import csv
import math

import pytest
import torch

from serve_app.client import RolloutClient
from serve_app.errors import PolicyVersionError
from serve_app.flowgrpo.sampler import replay_step
from serve_app.trainer import update as update_module
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.statistics import welch_t
from serve_app.trainer.loop import FlowGRPOTrainer, TrainingDivergedError, load_trainer_policy
from serve_app.weights import content_hash

# Whole training steps through the app: seconds each on 2 cores.
pytestmark = pytest.mark.slow

# Small and fast: 4 steps, 3 of them stochastic, 2 prompts x 4 samples. Chunks are never fused, so a rollout
# is the same computation whatever else is in flight beside it (the resume tests compare weights bitwise).
SHARED = ["sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=null",
          "replica.max_batch_size=1"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8",
           "trainer.eval_every=0", "trainer.image_every=1", "trainer.inner_epochs=1"]


@pytest.fixture
def local_app(start_local_app, tmp_path):
    """A fresh app per test with its own weights_dir, so version numbers never collide."""
    overrides = [*SHARED, f"replica.weights_dir={tmp_path / 'weights'}"]
    handle = start_local_app("diffusion_rollout", overrides, name=f"trainer-{tmp_path.name}")
    return RolloutClient(handle=handle), overrides


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


def test_the_trainer_takes_the_torch_threads_it_is_configured_with(local_app, tmp_path):
    before = torch.get_num_threads()
    try:
        make_trainer(local_app, tmp_path, "trainer.torch_threads=1")
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        make_trainer(local_app, tmp_path)  # null leaves the process's setting alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_unpublished_version_fails(local_app):
    client, _ = local_app
    with pytest.raises(PolicyVersionError, match="version 5"):
        client.rollout(["a cat"], 2, sampling={"num_steps": 4, "guidance_scale": 1.0, "sde_window_size": None},
                       policy_version=5)


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(local_app, tmp_path, monkeypatch):
    trainer = make_trainer(local_app, tmp_path, "trainer.checkpoint_every=1", "trainer.steps=3")
    real = update_module.clipped_ratio_loss

    def nan_from_step_1(*args, **kwargs):
        loss, ratio = real(*args, **kwargs)
        return (loss * math.nan if trainer.step >= 1 else loss), ratio

    monkeypatch.setattr(update_module, "clipped_ratio_loss", nan_from_step_1)
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


def resumed_trainer(local_app, trainer, *extra):
    """A new trainer (its own policy) resumed from `trainer`'s checkpoint, configured with `extra`."""
    client, overrides = local_app
    config = load_trainer_config("trainer/flowgrpo", [*overrides, *TRAINER, *extra])
    return FlowGRPOTrainer(config, client, trainer.out, policy=load_trainer_policy(config),
                           resume=trainer.out / "checkpoint", progress=False)


COMPARED = ("reward_mean", "loss", "ratio_max", "ratio_min", "staleness", "approx_kl")


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_resumed_run_is_the_run_it_would_have_been(local_app, tmp_path, staleness):
    """4 steps straight vs 2 steps, a new trainer resumed from the checkpoint, then 2 more: the same weights,
    bitwise, and the same metric rows. At staleness k the checkpoint holds k rollouts in flight, pinned to the
    versions the straight run pinned them to (rollout i to the version after i - k updates), and the resumed run
    sends them again as they were."""
    extra = ("trainer.lr=1e-2", "trainer.checkpoint_every=1", f"trainer.max_staleness={staleness}")
    straight = make_trainer(local_app, tmp_path / "straight", *extra)
    straight.train(4)
    first = make_trainer(local_app, tmp_path / "split", *extra)
    first.train(2)
    resumed = resumed_trainer(local_app, first, *extra)
    assert resumed.step == 2 and resumed.version == first.version
    assert resumed.pipeline.in_flight() == [(i, first.policy_versions[max(0, i - staleness)])
                                            for i in range(2, 2 + staleness)]
    resumed.train(4)
    theirs = straight.model.trainable_state()
    mine = resumed.model.trainable_state()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert any(v.abs().max() > 0 for k, v in mine.items() if "lora_B" in k)  # it trained
    rows = [list(csv.DictReader((run.out / "metrics.csv").open())) for run in (straight, resumed)]
    assert [float(r["step"]) for r in rows[1]] == [0, 1, 2, 3]
    assert [[float(r[c]) for c in COMPARED] for r in rows[0]] == [[float(r[c]) for c in COMPARED] for r in rows[1]]


def test_a_version_published_and_not_checkpointed_is_reused_and_other_weights_never_take_its_number(local_app, tmp_path):
    """A run killed between publishing step 2's version and checkpointing it: resumed, its step 2 gives the same
    weights, which keep their number (stored once). A resumed run whose update differs (two inner epochs) publishes
    under the next number: one number, one content."""
    extra = ("trainer.lr=1e-2", "trainer.max_staleness=1")
    run = make_trainer(local_app, tmp_path, *extra)
    run.train_step(), run.train_step()
    run.save_checkpoint()
    run.train_step()  # version 3, recorded by no checkpoint
    run.pipeline.close()
    store, unrecorded = run.store, run.version
    assert store.versions() == [1, 2, 3]
    same = resumed_trainer(local_app, run, *extra)
    same.train_step()
    assert same.version == unrecorded and store.versions() == [1, 2, 3]
    assert content_hash(same.model.publishable_state(), same.model.spec) == store.published_hash(3)
    same.pipeline.close()
    other = resumed_trainer(local_app, run, *extra, "trainer.inner_epochs=2")
    other.train_step()
    assert other.version == 4 and store.versions() == [1, 2, 3, 4]
    assert store.published_hash(4) != store.published_hash(3)
    assert content_hash(other.model.publishable_state(), other.model.spec) == store.published_hash(4)
    other.pipeline.close()


def test_reward_rises_with_the_demo_settings(local_app, tmp_path):
    """The demo's own settings (configs/trainer/flowgrpo.yaml: brightness toward 0.2, LoRA lr 5e-3,
    group 16, 4 inner epochs), shortened to 16 steps: the mean reward of the last 4 steps must beat
    that of the first 4 by a Welch t above 6, i.e. measured against the step-to-step noise of the
    reward mean (one batch's spread says nothing about how much the mean wanders between steps).
    Measured: t 25 to 45 (trainer.seed 0-2 with 1 and 2 torch threads, 3-5 with 2); the former settings
    (lr 5e-2, 2 inner epochs, attention targets) gave 2.8 to 12; no learning (lr 1e-9) gives -0.4."""
    client, overrides = local_app
    config = load_trainer_config("trainer/flowgrpo", [*overrides, "trainer.eval_every=0", "trainer.image_every=0",
                                                      "trainer.checkpoint_every=0"])
    trainer = FlowGRPOTrainer(config, client, tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    rows = trainer.train(16)
    rewards = [r["reward_mean"] for r in rows]
    # 4 = 2 rollouts of each prompt pair (the trainer alternates two pairs), so prompts don't bias the means.
    t = welch_t(rewards[:4], rewards[-4:])
    assert t > 6, (t, rewards)
    assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)
    assert [int(r["policy_version"]) for r in rows] == list(range(16))
    assert "Welch t" in trainer.summary()


def test_the_ema_is_published_and_evaluated_while_training_continues_from_the_policy(local_app, tmp_path):
    import csv

    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.ema_decay=0.5", "trainer.eval_every=1")
    trainer.train(2)  # evaluates before training (step 0) and after each step
    with (tmp_path / "out" / "eval.csv").open() as f:
        rows = [(int(r["step"]), r["weights"], int(r["policy_version"])) for r in csv.DictReader(f)]
    # v1, v3: the trained weights after steps 1 and 2; v2, v4: their EMA, evaluated in their place.
    assert rows == [(0, "policy", 0), (1, "ema", 2), (2, "ema", 4)]
    assert trainer.version == 3  # rollouts stay pinned to the policy, not to its average
    v1, v2, v3, v4 = (trainer.store.load(v).tensors for v in (1, 2, 3, 4))
    # EMAModel's warm-up: the first step copies the weights, the second keeps min(decay, 2/11) of them.
    keep = 2 / 11
    for key in v4:
        torch.testing.assert_close(v2[key], v1[key], atol=0, rtol=0)
        torch.testing.assert_close(v4[key], keep * v1[key] + (1 - keep) * v3[key], atol=1e-6, rtol=1e-5)
    assert any((v3[k] - v1[k]).abs().max() > 1e-4 for k in v3)  # the blend above is not vacuous


@pytest.mark.parametrize("max_staleness, expected", [(0, [0, 0, 0, 0]), (1, [0, 1, 1, 1]), (2, [0, 1, 2, 2])])
def test_pipelined_rollouts_stay_within_the_staleness_bound(local_app, tmp_path, max_staleness, expected):
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", f"trainer.max_staleness={max_staleness}")
    rows = trainer.train(4)
    assert [int(r["staleness"]) for r in rows] == expected
    assert all(r["dropped_batches"] == 0 for r in rows)
    # Each batch passed the weights-hash check of the version it was sampled at: a correct push passes.
    assert [int(r["policy_version"]) for r in rows] == [step - s for step, s in enumerate(expected)]
    for row in rows:
        if row["staleness"] == 0:
            assert row["onpolicy_ratio_dev"] < 1e-6
        else:  # sampled with older weights: the ratio-1 check does not apply, but the ratios are logged
            assert math.isnan(row["onpolicy_ratio_dev"]) and math.isfinite(row["ratio_max"])
    assert all(r["trainer_idle_s"] >= 0 and r["rollout_wait_s"] >= 0 for r in rows)
    # At every staleness a group replayed with the weights of the version that sampled it gives its log-probs
    # again, and every row of metrics.csv says so.
    with (tmp_path / "out" / "metrics.csv").open() as f:
        written = list(csv.DictReader(f))
    for row in written:
        assert float(row["mismatch_version"]) == float(row["policy_version"])
        assert float(row["mismatch_rows"]) == 4  # one group
        assert 0 <= float(row["mismatch_abs_log_ratio_max"]) <= 1e-6, row
        assert 0 < float(row["mismatch_check_s"]) < float(row["step_seconds"])


def serve_version_perturbed(monkeypatch, version: int, scale: float = 1.02) -> None:
    """Every replica serves `version` with its adapter's tensors scaled by `scale` once they are loaded and
    checked (as a replica whose weights drift after the read-back check would): the stamp and content hash
    still say `version`, so only the trainer's replay of its batches can tell."""
    from serve_app.weights.replica import PolicyVersions

    real = PolicyVersions.ensure

    def ensure(self, asked: int) -> None:
        switching = asked != self.current
        real(self, asked)
        if switching and asked == version:
            with torch.no_grad():
                for name, param in self.policy.transformer.named_parameters():
                    if "lora_" in name:
                        param.mul_(scale)

    monkeypatch.setattr(PolicyVersions, "ensure", ensure)


@pytest.mark.parametrize("action", ["stop", "warn"])
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_a_replica_serving_other_weights_is_caught_at_the_step_that_uses_its_batch(local_app, tmp_path, monkeypatch,
                                                                                  max_staleness, action):
    from serve_app.trainer.mismatch import RolloutMismatchError

    perturbed = 3  # published by step 2, sampled while step 3 trains; its batch is trained on at step 3 + k
    caught = perturbed + max_staleness
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", f"trainer.max_staleness={max_staleness}",
                           f"trainer.mismatch.action={action}", "trainer.image_every=0")
    serve_version_perturbed(monkeypatch, perturbed)
    if action == "stop":
        with pytest.raises(RolloutMismatchError, match=f"policy version {perturbed}, .* exceeds"):
            trainer.train(caught + 1)
        # Stopped before that step's optimizer step: nothing published, and the trainer's weights are the last
        # published version's (the behaviour weights swapped in for the check were swapped out again).
        assert trainer.step == caught and trainer.store.latest_version() == trainer.version == caught
        published = trainer.store.load(trainer.version).tensors
        assert all(torch.equal(v, published[k]) for k, v in trainer.model.publishable_state().items())
        rows = trainer.metrics.rows
    else:
        rows = trainer.train(caught + 1)
        assert rows[caught]["mismatch_version"] == perturbed
        assert rows[caught]["mismatch_abs_log_ratio_max"] > trainer.cfg.mismatch.max_abs_log_ratio
    assert len(rows) >= caught
    assert all(r["mismatch_abs_log_ratio_max"] <= 1e-6 for r in rows[:caught])  # the honest steps before it


def test_tis_takes_its_old_log_probs_from_the_one_behaviour_replay(local_app, tmp_path, monkeypatch):
    """With TIS on stale batches: the behaviour version's replay of every row is the trainer's old log-prob, so
    on an honest fp32 engine every importance weight is 1 (the current weights would give others); and it is
    the only no-grad replay of the step."""
    from serve_app.trainer import mismatch

    replays = []
    real = mismatch.replay_log_probs
    monkeypatch.setattr(mismatch, "replay_log_probs", lambda *a, **kw: replays.append(1) or real(*a, **kw))
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.max_staleness=1",
                           "trainer.mismatch.tis_cap=2.0", "trainer.image_every=0")
    rows = trainer.train(3)
    assert len(replays) == 3
    assert [int(r["staleness"]) for r in rows] == [0, 1, 1]
    for row in rows:
        assert row["mismatch_rows"] == 8  # every row
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and row["tis_truncated_frac"] == 0


def test_a_batch_staler_than_the_bound_is_dropped_and_counted(local_app, tmp_path):
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.max_staleness=1")
    trainer.pipeline.max_staleness = 2  # send one rollout more than the bound allows
    rows = trainer.train(3)
    assert max(r["staleness"] for r in rows) <= 1
    assert rows[-1]["dropped_batches"] >= 1


def test_an_adapter_bound_to_no_module_fails_the_first_step_that_uses_it(local_app, tmp_path, monkeypatch):
    from serve_app.errors import WeightMismatchError
    from serve_app.trainer.lora import TrainableTransformer
    from serve_app.weights import LoraSpec

    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2")
    adapter_tensors = len(trainer.model.publishable_state())
    # The published spec names target modules the replicas' transformer does not have.
    monkeypatch.setattr(TrainableTransformer, "spec",
                        property(lambda self: LoraSpec(rank=8, alpha=16.0, target_modules=["no_such_module"])))
    trainer.train_step()  # version 0: no adapter involved
    with pytest.raises(WeightMismatchError, match=rf"policy version 1: 0 of {adapter_tensors} adapter tensors bound"):
        trainer.train_step()


def test_an_adapter_never_delivered_is_caught_by_reading_the_modules_back(local_app, tmp_path, monkeypatch):
    import peft

    from serve_app.errors import WeightMismatchError

    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2")
    trainer.train_step()
    # The replica's load of the tensors silently does nothing: its fresh adapter stays at peft's init.
    monkeypatch.setattr(peft, "set_peft_model_state_dict", lambda *args, **kwargs: None)
    with pytest.raises(WeightMismatchError, match=r"policy version 1: \d+ of \d+ adapter tensors bound") as info:
        trainer.train_step()
    assert "replica" in str(info.value)


def test_mix_grpo_trains_through_the_app_on_the_windows_its_schedule_places(local_app, tmp_path):
    """trainer.algorithm mix_grpo: each request names its window's first step, the app samples exactly that
    window, and the trainer replays it (ratio 1 on-policy)."""
    client, overrides = local_app
    windows = []

    class Recording:
        def rollout(self, *args, **kwargs):
            batch = client.rollout(*args, **kwargs)
            windows.append(batch.trajectory.step_indices.tolist())
            return batch

    config = load_trainer_config("trainer/flowgrpo", [
        *overrides, *TRAINER, "trainer.lr=1e-2", "sampling.sde_window_size=1", "sampling.sde_window_range=[0,1]",
        "trainer.algorithm=mix_grpo", "trainer.mix_grpo.shift_interval=1", "trainer.mix_grpo.max_start=1"])
    trainer = FlowGRPOTrainer(config, Recording(), tmp_path / "out", policy=load_trainer_policy(config), progress=False)
    rows = trainer.train(3)
    assert windows == [[0], [1], [1]]
    assert all(row["onpolicy_ratio_dev"] < 1e-6 for row in rows)
    assert trainer.version == 3


def test_dance_grpo_trains_through_the_app_on_its_sde_step(local_app, tmp_path):
    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.algorithm=dance_grpo",
                           "sampling.sde_type=dance", "sampling.noise_level=0.3")
    rows = trainer.train(2)
    assert all(row["onpolicy_ratio_dev"] < 1e-6 for row in rows)
    assert rows[1]["mismatch_abs_log_ratio_max"] < 1e-5 and trainer.version == 2


AVERAGED = ("trainer.lr=1e-2", "trainer.algorithm=diffusion_nft", "trainer.diffusion_nft.sampling_decay_rate=0.25",
            "trainer.diffusion_nft.sampling_decay_max=0.4")


@pytest.mark.parametrize("staleness", [0, 1])
def test_diffusion_nft_samples_the_soft_updated_average_it_publishes(local_app, tmp_path, staleness):
    """With trainer.diffusion_nft.sampling_decay_*: after update i the version published is d_i old + (1 - d_i) theta
    (d = 0, 0.25, 0.4), not the trained weights; the rollouts are sampled by it and the velocity check takes their
    first step again with it (a check against the trained weights would miss by far more than 1e-4)."""
    trainer = make_trainer(local_app, tmp_path, *AVERAGED, f"trainer.max_staleness={staleness}")
    trained, rows = [], []
    for _ in range(3):
        rows.append(trainer.train_step())
        trained.append(trainer.model.publishable_state())
    assert all(row["nft_velocity_error"] < 1e-4 for row in rows)
    published = [trainer.store.load(version).tensors for version in (1, 2, 3)]
    expected = trained[0]  # d_0 = 0: the first update's weights
    for decay, theta, mine in zip((0.0, 0.25, 0.4), trained, published):
        expected = {k: decay * expected[k] + (1 - decay) * theta[k] for k in theta}
        assert mine.keys() == expected.keys()
        assert max(float((mine[k] - expected[k]).abs().max()) for k in mine) < 1e-7
    gap = max(float((published[2][k] - trained[2][k]).abs().max()) for k in trained[2])
    assert gap > 1e-3  # the version sampled is not the trained weights


def test_a_resumed_run_with_a_soft_updated_sampling_policy_is_the_run_it_would_have_been(local_app, tmp_path):
    """The checkpoint holds the sampling average beside the trained weights: 4 steps straight equal 2 + a resume + 2,
    bitwise, in the trained weights and in every version published."""
    extra = (*AVERAGED, "trainer.checkpoint_every=1", "trainer.max_staleness=1")
    straight = make_trainer(local_app, tmp_path / "straight", *extra)
    straight.train(4)
    straight_versions = [straight.store.load(v).tensors for v in straight.policy_versions[-2:]]
    first = make_trainer(local_app, tmp_path / "split", *extra)
    first.train(2)
    resumed = resumed_trainer(local_app, first, *extra)
    resumed.train(4)
    theirs, mine = straight.model.trainable_state(), resumed.model.trainable_state()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    for a, b in zip(straight_versions, [resumed.store.load(v).tensors for v in resumed.policy_versions[-2:]]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("staleness", [0, 1])
def test_diffusion_nft_trains_through_the_app_on_final_latents_it_checks(local_app, tmp_path, staleness):
    """trainer.algorithm diffusion_nft: the app returns the ODE's final latents and those after its first step alone;
    every step takes the first step of two of them again with the trainer's copy of the version that sampled them
    (the batch in flight: the version before)."""
    client, _ = local_app
    received = []

    class Recording:
        def rollout(self, *args, **kwargs):
            batch = client.rollout(*args, **kwargs)
            received.append((batch.trajectory.latents.shape[1], batch.trajectory.log_probs.shape[1], batch.policy_version))
            return batch

    trainer = make_trainer(local_app, tmp_path, "trainer.lr=1e-2", "trainer.algorithm=diffusion_nft",
                           f"trainer.max_staleness={staleness}")
    trainer.client = Recording()
    before = {k: v.clone() for k, v in trainer.model.publishable_state().items()}
    rows = trainer.train(3)
    assert all(latents == 2 and log_probs == 0 for latents, log_probs, _ in received)
    assert all(row["nft_velocity_error"] < 1e-4 for row in rows)
    assert [row["staleness"] for row in rows][1:] == [staleness] * 2
    assert all(math.isnan(row["ratio_mean"]) and math.isfinite(row["loss"]) for row in rows)
    after = trainer.model.publishable_state()
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-4 and trainer.version == 3
