"""Data-parallel training (serve_app.trainer.distributed): 2 ranks on gloo give the one-process update.

One fixed rollout (the tiny model in Serve's local testing mode) is trained on once in this process and
once by 2 plain gloo processes (fsdp, ddp for DiffusionNFT, and a rank whose weights differ). Rank 0
publishes version 1 to its own weight store; the stores' tensors must agree within 1e-5, and every rank's
first replay must give ratio 1. Ray Train's TorchTrainer (ddp, the `--workers` path) trains against an app
deployed on the session's shared cluster: 2 steps give one process's weights within 1e-5, and a run with a rank killed
mid-update gives the uninterrupted run's, bitwise.

The plain gloo runs' ranks are processes forked from a server that imported the trainer once (rank_process,
tests/forked.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from serve_app.local_ray import free_loopback_port
from tests.forked import ForkedRun

# 2 prompts x 4 samples, 3 stochastic steps; micro-batches of 3 rows (uneven: 3+3+2 in one process, 3+1
# per rank), 2 inner epochs (the second step moves A as well as B, and its ratios are not 1), a KL term.
SHARED = ["sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=null"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=3",
           "trainer.inner_epochs=2", "trainer.lr=1e-2", "trainer.beta=0.04", "trainer.steps=1",
           "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=0"]


def fixed_source(batch):
    """A rollout source that always returns `batch` (sampled at version 0). Defined in a function, so
    Ray's cloudpickle ships the class by value to the Train worker that uses it."""

    class FixedSource:
        def rollout(self, prompts, group_size, sampling=None, policy_version=None, seed=None, *, timeout_s=None, fetch=True,
                    return_images=False):
            assert policy_version == 0 and group_size == batch.group_size, (policy_version, group_size)
            return batch

    return FixedSource()


def trainer_config(tmp_path: Path, name: str, *extra: str):
    from serve_app.trainer.config import load_trainer_config

    return load_trainer_config("trainer/flowgrpo", [*SHARED, *TRAINER, f"replica.weights_dir={tmp_path / name / 'weights'}",
                                                    *extra])


def published(config, version: int = 1) -> dict[str, torch.Tensor]:
    from serve_app.weights import open_weight_store

    return open_weight_store(config).load(version).tensors


def assert_same_update(single: dict[str, torch.Tensor], parallel: dict[str, torch.Tensor], base: dict[str, torch.Tensor]):
    assert single.keys() == parallel.keys() == base.keys()
    worst = max(float((single[k] - parallel[k]).abs().max()) for k in single)
    moved = max(float((single[k] - base[k]).abs().max()) for k in single)
    print(f"max |one process - 2 ranks| {worst:.2e}; largest change of a tensor element {moved:.2e}")  # -s shows it
    assert worst < 1e-5, worst
    # The update is 1000x the tolerance, so the agreement is not that of two no-ops.
    assert moved > 1e-2, moved
    # Both kinds of adapter tensor moved (A only from the second step on, once B is no longer zero).
    for kind in ("lora_A", "lora_B"):
        assert max(float((single[k] - base[k]).abs().max()) for k in single if kind in k) > 1e-3, kind


@pytest.fixture(scope="module")
def app_client(start_local_app, tmp_path_factory):
    """The tiny model's app in Serve's local testing mode, at version 0."""
    from serve_app.client import RolloutClient

    tmp = tmp_path_factory.mktemp("dp_app")
    handle = start_local_app("diffusion_rollout", [*SHARED, f"replica.weights_dir={tmp / 'weights'}"], name="dp-rollout")
    return RolloutClient(handle=handle)


def fixed_batch(client, config):
    """2 prompts x 4 samples at version 0, sampled as the configured algorithm's first rollout asks."""
    from serve_app.trainer.algorithms import rollout_sampling

    sampling = rollout_sampling(config.trainer, config.sampling, 0)
    batch = client.rollout(config.trainer.prompts[:2], 4, sampling=sampling, policy_version=0, seed=11)
    assert float(batch.advantages.abs().min()) > 0  # every row carries signal
    return batch


@pytest.fixture(scope="module")
def rollout(app_client, tmp_path_factory):
    """The fixed batch, with the trainer's own sampling."""
    return fixed_batch(app_client, trainer_config(tmp_path_factory.mktemp("dp_rollout"), "app"))


def train_in_one_process(config, batch, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """The reference: one process trains on the whole batch (world size 1) and publishes version 1; returns
    the published tensors, the tensors before and the step's metrics row."""
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    trainer = FlowGRPOTrainer(config, fixed_source(batch), out, policy=load_trainer_policy(config), progress=False)
    base = trainer.model.publishable_state()
    row = trainer.train_step()
    assert trainer.parallel.world_size == 1
    return published(config), base, row


@pytest.fixture(scope="module")
def one_process(rollout, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp_single")
    single, base, row = train_in_one_process(trainer_config(tmp, "single"), rollout, tmp / "single" / "out")
    assert row["onpolicy_ratio_dev"] < 1e-6
    return single, base


def test_shards_are_equal_blocks_of_whole_groups():
    from serve_app.trainer.parallel import shard_rows

    assert [r.tolist() for r in shard_rows(8, 2, 2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r.tolist() for r in shard_rows(12, 4, 3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="multiple of trainer.distributed.workers"):
        shard_rows(12, 4, 2)  # 3 groups over 2 ranks


def test_workers_must_divide_the_prompts_of_a_step(tmp_path, capsys):
    from serve_app.config import ConfigError
    from serve_app.trainer.__main__ import main

    with pytest.raises(ConfigError, match=r"prompts_per_step \(2\) must be a multiple of trainer.distributed.workers \(3\)"):
        trainer_config(tmp_path, "x", "trainer.distributed.workers=3")
    # The CLI's --workers is that setting, checked before anything connects to Ray.
    assert main(["--workers", "3", "--out", str(tmp_path / "out"), "trainer.prompts_per_step=2"]) == 2
    assert "must be a multiple of trainer.distributed.workers (3)" in capsys.readouterr().err


# The app on the session's shared cluster (tests/conftest.py: ray_cluster, gloo on loopback): one replica, one
# torch thread, chunks never fused, so each rollout is the same computation in every run; the trainer at
# staleness 1 with a checkpoint every step.
RESTART_APP_NAME = "flowgrpo-dp-restart"
RESTART_APP = [*SHARED, f"app_name={RESTART_APP_NAME}", "replica.num_cpus=0.1", "replica.torch_threads=1",
               "replica.max_batch_size=1", "replica.autoscaling.min_replicas=1", "replica.autoscaling.max_replicas=1",
               "ingress.num_cpus=0.1", "aggregator.num_cpus=0.1"]
# Micro-batches of 3 rows (3+1 per rank), 2 inner epochs and a KL term, as the one-process comparison above.
RESTART_TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=3",
                   "trainer.inner_epochs=2", "trainer.lr=1e-2", "trainer.beta=0.04", "trainer.steps=2",
                   "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=1",
                   "trainer.max_staleness=1", "trainer.torch_threads=1"]
WORKERS = ["trainer.distributed.workers=2", "trainer.distributed.cpus_per_worker=0.5"]


# Three training runs and a group restart: about 155 s alone on 2 cores, 230-310 s beside the other xdist worker
# in `make test`, which the suite-wide 300 s bound (pyproject.toml) does not leave room for.
@pytest.mark.timeout(600)
@pytest.mark.slow
@pytest.mark.cluster
def test_a_rank_killed_mid_update_restarts_the_group_into_the_run_it_would_have_been(ray_cluster, tmp_path, monkeypatch):
    """The `--workers 2` path (TorchTrainer, 2 gloo workers, DDP) against a deployed app: 2 steps straight, then 2
    steps with rank 1 SIGKILLed inside step 1's update. Ray Train restarts both workers
    (trainer.distributed.max_failures) from the checkpoint rank 0 reported after step 0, and the run ends with the
    straight run's weights, bitwise. The straight run itself gives one process's update (the same 2 steps by
    handle in this process) within 1e-5, and rank 0 alone writes the metrics, with each rank's ratio-1 check."""
    import csv

    import ray
    from ray import serve
    from safetensors.torch import load_file

    from serve_app.app import AppArgs, build_app
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.connect import connect_to_app
    from serve_app.trainer.distributed import run_data_parallel
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    overrides = [*RESTART_APP, f"replica.weights_dir={tmp_path / 'weights'}"]
    one = load_trainer_config("trainer/flowgrpo", [*overrides, *RESTART_TRAINER])
    config = load_trainer_config("trainer/flowgrpo", [*overrides, *RESTART_TRAINER, *WORKERS])
    serve.run(build_app(AppArgs(overrides=overrides)), name=RESTART_APP_NAME, route_prefix=None)
    try:
        # One process first: its version 1 differs from the ranks' in the last bits, so the ranks' runs
        # publish theirs under a new number (tests/trainer/test_trainer_crash.py) and sample from it alike.
        app = connect_to_app(one)
        single = FlowGRPOTrainer(one, app.client, tmp_path / "single", policy=load_trainer_policy(one),
                                 replica_handle=app.replica, progress=False)
        base = single.model.publishable_state()
        single.train()
        single_final = load_file(tmp_path / "single" / "lora_final.safetensors")
        free = ray.available_resources().get("CPU", 0.0)
        straight = run_data_parallel(config, tmp_path / "straight", progress=False)
        _wait_for_free_cpus(free)  # the straight run's workers release their CPUs after fit() has returned
        monkeypatch.setenv("FLOWGRPO_CRASH_AT", "update@1")
        monkeypatch.setenv("FLOWGRPO_CRASH_RANK", "1")
        killed = run_data_parallel(config, tmp_path / "killed", progress=False)
    finally:
        serve.delete(RESTART_APP_NAME)
    assert straight["restarted_from_step"] is None and killed["restarted_from_step"] == 1
    assert straight["steps"] == 2 and "final policy version" in straight["summary"]
    mine, theirs = (load_file(tmp_path / run / "lora_final.safetensors") for run in ("killed", "straight"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert_same_update(single_final, theirs, base)
    rows = [list(csv.DictReader((tmp_path / run / "metrics.csv").open())) for run in ("straight", "killed")]
    assert len(rows[0]) == 2  # rank 0 alone writes
    # The ratio-1 check ran on each rank's own shard and held there, at step 0; step 1 trains on a batch one
    # version old (staleness 1), which it does not measure.
    first, second = rows[0]
    assert max(float(first[f"onpolicy_ratio_dev{rank}"]) for rank in ("", "_rank0", "_rank1")) < 1e-6, first
    assert second["staleness"] == "1" and second["onpolicy_ratio_dev"] == "nan", second
    compared = ("reward_mean", "loss", "ratio_max", "staleness")
    assert [[float(r[c]) for c in compared] for r in rows[0]] == [[float(r[c]) for c in compared] for r in rows[1]]


def _wait_for_free_cpus(amount: float, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0.0) + 1e-9 < amount:
        assert time.monotonic() < deadline, f"the cluster's CPUs did not come back: {ray.available_resources()}"
        time.sleep(0.5)


def _run_ranks(tmp_path: Path, scenarios: list[dict], timeout_s: float = 240) -> list[dict]:
    """2 processes, one gloo rank each (rank_process), on 127.0.0.1; returns each rank's results."""
    port = free_loopback_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    runs = []
    for rank in range(2):
        spec = {"rank": rank, "world": 2, "port": port, "scenarios": scenarios, "result": str(tmp_path / f"rank{rank}.json")}
        runs.append(ForkedRun(f"{__name__}:rank_process", [json.dumps(spec)], env=env, log=tmp_path / f"rank{rank}.log"))
    finished = [run.wait(timeout_s) for run in runs]
    for run in finished:
        assert run.returncode == 0, run.output[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
def test_fsdp_shards_give_the_one_process_update_and_a_mismatch_on_one_rank_stops_both(rollout, one_process, tmp_path):
    single, base = one_process
    torch.save(rollout, tmp_path / "batch.pt")
    fsdp = trainer_config(tmp_path, "fsdp", "trainer.distributed.strategy=fsdp")
    mismatch = trainer_config(tmp_path, "mismatch")
    scenarios = [
        # max_staleness 1: the trainer keeps version 0's shards after publishing version 1 (the update of a batch
        # sampled with the current weights is the same at any max_staleness).
        {"name": "fsdp", "overrides": [*SHARED, *TRAINER, f"replica.weights_dir={tmp_path / 'fsdp' / 'weights'}",
                                       "trainer.distributed.strategy=fsdp", "trainer.max_staleness=1"],
         "out": str(tmp_path / "fsdp" / "out"), "batch": str(tmp_path / "batch.pt"), "replay_version_0": True},
        # Rank 1's frozen base weights differ (as if it had loaded another checkpoint): its replay cannot give 1.
        {"name": "mismatch", "overrides": [*SHARED, *TRAINER, f"replica.weights_dir={tmp_path / 'mismatch' / 'weights'}"],
         "out": str(tmp_path / "mismatch" / "out"), "batch": str(tmp_path / "batch.pt"), "perturb_rank": 1},
    ]
    ranks = _run_ranks(tmp_path, scenarios)

    # FSDP2 on gloo: the trainable tensors were sharded, and the update is the one-process one.
    for r in ranks:
        result = r["fsdp"]
        assert result.get("error") is None, result
        assert result["local_numel"] < result["full_numel"], result  # each rank held a part of the adapter
        assert result["onpolicy_ratio_dev"] < 1e-6 and result["version"] == 1
        # Version 0's shards swapped in replay the batch it sampled; swapped out, the trained weights are back, also
        # in the root module's parameters that a forward without backward leaves gathered.
        assert result["version_0_dev"] < 1e-6 and result["trained_dev"] > 1e-4, result
        assert result["restored_dev"] == 0, result
    assert_same_update(single, published(fsdp), base)
    # The checkpoint holds whole tensors (one process or ddp can resume it).
    from serve_app.trainer.checkpoint import load_checkpoint

    state = load_checkpoint(tmp_path / "fsdp" / "out" / "checkpoint")
    assert all(not hasattr(v, "device_mesh") for v in state.trainable.values())
    assert sum(v.numel() for v in state.trainable.values()) == ranks[0]["fsdp"]["full_numel"]

    # Rank 1's mismatch fails the step on both ranks, before any optimizer step; nothing is published.
    for r in ranks:
        error = r["mismatch"]["error"]
        assert error is not None and "OnPolicyMismatchError" in error and "on rank(s) [1] of 2" in error, error
    assert ranks[1]["mismatch"]["onpolicy_ratio_dev"] > 1e-4 and ranks[0]["mismatch"]["onpolicy_ratio_dev"] < 1e-6
    from serve_app.weights import open_weight_store

    assert open_weight_store(mismatch).versions() == []


@pytest.mark.slow
def test_diffusion_nft_on_two_ranks_gives_the_one_process_update(app_client, tmp_path):
    """trainer.algorithm diffusion_nft data-parallel (ddp on gloo): each rank draws the forward process of its
    shard's final latents and checks two of its rollouts by regenerating them; the gradients are averaged as the
    ratio-based update's are, so version 1 is the one-process one."""
    nft = ("trainer.algorithm=diffusion_nft", "sampling.group_noise=independent")
    batch = fixed_batch(app_client, trainer_config(tmp_path, "app", *nft))
    assert batch.trajectory.log_probs.shape[1] == 0  # final latents alone: no transition crossed the wire
    single, base, row = train_in_one_process(trainer_config(tmp_path, "single", *nft), batch, tmp_path / "single" / "out")
    assert row["nft_velocity_error"] < 1e-4
    torch.save(batch, tmp_path / "batch.pt")
    ddp = trainer_config(tmp_path, "ddp", *nft)
    scenario = {"name": "nft", "overrides": [*SHARED, *TRAINER, *nft, f"replica.weights_dir={tmp_path / 'ddp' / 'weights'}"],
                "out": str(tmp_path / "ddp" / "out"), "batch": str(tmp_path / "batch.pt")}
    ranks = _run_ranks(tmp_path, [scenario])
    assert all(r["nft"]["error"] is None and r["nft"]["version"] == 1 for r in ranks), ranks
    assert_same_update(single, published(ddp), base)


def _rank_main(spec: dict) -> None:
    """One gloo rank: each scenario trains one step on the saved batch with a fresh policy."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from serve_app.local_ray import loopback_ray_env
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.parallel import DataParallel
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    loopback_ray_env()
    torch.set_num_threads(1)
    rank = spec["rank"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=spec["world"], timeout=timedelta(seconds=120))
    results = {}
    try:
        for scenario in spec["scenarios"]:
            config = load_trainer_config("trainer/flowgrpo", scenario["overrides"])
            batch = torch.load(scenario["batch"], weights_only=False)
            policy = load_trainer_policy(config)
            if scenario.get("perturb_rank") == rank:
                with torch.no_grad():
                    policy.transformer.proj_out.weight.mul_(1.5)
            parallel = DataParallel(config.trainer.distributed.strategy)
            trainer = FlowGRPOTrainer(config, fixed_source(batch) if rank == 0 else None, scenario["out"], policy=policy,
                                      progress=False, parallel=parallel)
            params = trainer.model.parameters()
            result = {
                "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
                "full_numel": sum(p.numel() for p in params), "error": None,
            }
            stats = {}
            real_check = trainer.update.check_onpolicy

            def check(s, *args, real_check=real_check, stats=stats):
                stats["own"] = s.onpolicy_ratio_dev  # this rank's deviation, before the ranks exchange theirs
                real_check(s, *args)

            trainer.update.check_onpolicy = check
            try:
                trainer.train(1)
            except Exception as exc:  # reported to the test, which says what it expects
                result["error"] = f"{type(exc).__name__}: {exc}"
            result.update(onpolicy_ratio_dev=stats.get("own", float("nan")), version=trainer.version)
            if scenario.get("replay_version_0"):
                result.update(_replay_version_0(trainer, batch, rank, spec["world"]))
            results[scenario["name"]] = result
    finally:
        dist.destroy_process_group()
    Path(spec["result"]).write_text(json.dumps(results))


def _replay_version_0(trainer, batch, rank: int, world: int) -> dict[str, float]:
    """This rank's shard replayed (a collective under fsdp) with the trained weights, with version 0's kept
    tensors swapped in, and with the trained ones again."""
    from serve_app.flowgrpo.ratios import replay_log_probs
    from serve_app.trainer.parallel import shard_rows

    mine = batch.trajectory.take(shard_rows(len(batch), batch.group_size, world)[rank])
    trained = replay_log_probs(trainer.policy, mine)
    with trainer.model.at_version(0):
        version_0 = replay_log_probs(trainer.policy, mine)
    restored = replay_log_probs(trainer.policy, mine)
    return {"version_0_dev": float((version_0 - mine.log_probs).abs().max()),
            "trained_dev": float((trained - mine.log_probs).abs().max()),
            "restored_dev": float((restored - trained).abs().max())}


def rank_process(argv: list[str]) -> None:
    """One rank's process (tests/forked.py runs it): argv is its spec as JSON."""
    _rank_main(json.loads(argv[0]))
    # The rank has reported. Leave without the interpreter's teardown: after an FSDP scenario, static
    # destruction at exit meets a gloo thread still joinable and aborts the process (SIGABRT, "terminate
    # called without an active exception", no Python frame) in 2 of 9 runs measured.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_workers_that_do_not_fit_fail_at_once_naming_what_they_need_and_the_fix():
    from serve_app.trainer.config import DistributedSection
    from serve_app.trainer.connect import PlacementError, check_worker_placement

    section = DistributedSection(workers=2, cpus_per_worker=1.0)
    # The README's cluster: `ray start --head --num-cpus 2`, with the app's deployments holding 0.7 CPUs.
    with pytest.raises(PlacementError) as caught:
        check_worker_placement(section, available={"CPU": 1.3}, total={"CPU": 2.0})
    message = str(caught.value)
    assert "2 training workers need 2 CPU" in message and "1.3 of 2 CPU free" in message
    assert "trainer.distributed.cpus_per_worker (now 1; 0.65 would fit)" in message
    check_worker_placement(DistributedSection(workers=2, cpus_per_worker=0.5), available={"CPU": 1.3},
                           total={"CPU": 2.0})
    with pytest.raises(PlacementError, match="need 1 CPU, 2 GPU.*0 of 0 GPU free.*add GPU nodes"):
        check_worker_placement(DistributedSection(workers=2, cpus_per_worker=0.5, use_gpu=True),
                               available={"CPU": 4.0}, total={"CPU": 4.0})
