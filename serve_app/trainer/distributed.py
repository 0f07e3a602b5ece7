"""Data-parallel training on Ray Train: N TorchTrainer workers run the same FlowGRPOTrainer, each with its
rank's DataParallel (serve_app.trainer.parallel says what one step does on N ranks).

    python -m serve_app.trainer --workers 2 --out outputs/dp [key=value ...]
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.trainer.connect import check_worker_placement
from serve_app.trainer.faults import CRASH_ENV
from serve_app.trainer.parallel import DataParallel

if TYPE_CHECKING:
    from serve_app.trainer.config import TrainerRunConfig
    from serve_app.trainer.loop import RolloutSource


# -- Ray Train -------------------------------------------------------------------------------


def run_data_parallel(config: TrainerRunConfig, out_dir: str | Path, *, resume: str | Path | None = None,
                      source: RolloutSource | None = None, progress: bool = True) -> dict[str, Any]:
    """Train with trainer.distributed.workers TorchTrainer workers (gloo on CPU, nccl with use_gpu) on the
    Ray cluster this process is connected to; returns rank 0's final report (summary, policy_version, steps).

    Args:
        config: the run's config (trainer.steps steps).
        out_dir: outputs/<run>, written by rank 0 only.
        resume: a checkpoint directory every worker can read (ddp only).
        source: a picklable rollout source for rank 0 (tests); default: RolloutClient(config.app_name),
            found by rank 0 inside the cluster.
    """
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    section = config.trainer.distributed
    if resume is not None and section.strategy == "fsdp":
        raise ValueError("--resume is not supported with trainer.distributed.strategy fsdp; resume with ddp "
                         "(checkpoints hold whole tensors, so a ddp or one-process run can continue them)")
    check_worker_placement(section, available=ray.available_resources(), total=ray.cluster_resources())
    out = Path(out_dir).absolute()
    resources = {"CPU": section.cpus_per_worker} | ({"GPU": 1} if section.use_gpu else {})
    trainer = TorchTrainer(
        _worker_loop,
        train_loop_config={"config": config, "out": str(out), "resume": None if resume is None else str(Path(resume).absolute()),
                           "source": source, "progress": progress, "started_at": time.time(),
                           # A rehearsed pre-emption (serve_app.trainer.faults), on one rank with FLOWGRPO_CRASH_RANK.
                           "crash_at": os.environ.get(CRASH_ENV), "crash_rank": os.environ.get("FLOWGRPO_CRASH_RANK")},
        torch_config=TorchConfig(backend="nccl" if section.use_gpu else "gloo"),
        scaling_config=ScalingConfig(num_workers=section.workers, use_gpu=section.use_gpu, resources_per_worker=resources),
        # A fresh run name each launch: Ray Train restores a run whose name it finds in the storage path.
        run_config=RunConfig(name=f"flowgrpo-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=str(out / "ray_train"),
                             # fsdp runs cannot resume (above), so they are not restarted either.
                             failure_config=FailureConfig(max_failures=section.max_failures if section.strategy == "ddp" else 0)),
    )
    result = trainer.fit()
    return dict(result.metrics or {})


def _worker_loop(loop_config: dict[str, Any]) -> None:
    """One Train worker: the same FlowGRPOTrainer as one process, with its rank's DataParallel."""
    import ray.train

    from serve_app.trainer.connect import connect_to_app
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    config: TrainerRunConfig = loop_config["config"]
    parallel = DataParallel(config.trainer.distributed.strategy)
    resume = loop_config["resume"]
    # A worker died and Ray Train restarted the group (trainer.distributed.max_failures): the checkpoint rank 0
    # wrote during this run (after it started) is where the group continues from.
    latest = Path(loop_config["out"]) / "checkpoint" / "state.json"
    restarted = latest.is_file() and latest.stat().st_mtime > loop_config["started_at"]
    if restarted:
        resume = str(latest.parent.resolve())
    crash_rank = loop_config["crash_rank"]
    if not restarted and loop_config["crash_at"] and (crash_rank is None or int(crash_rank) == parallel.rank):
        os.environ[CRASH_ENV] = loop_config["crash_at"]  # the first attempt only: a restart does not die again
    else:
        os.environ.pop(CRASH_ENV, None)
    source, replica = loop_config["source"], None
    if parallel.is_leader and source is None:  # only rank 0 talks to the app
        app = connect_to_app(config)
        source, replica = app.client, app.replica
    # The policy before the trainer, as in one process: the adapter's seeded init then draws the same numbers.
    policy = load_trainer_policy(config)
    trainer = FlowGRPOTrainer(config, source, loop_config["out"], policy=policy, resume=resume,
                              replica_handle=replica, progress=loop_config["progress"] and parallel.is_leader,
                              parallel=parallel)
    trainer.train()
    if parallel.is_leader:
        # Ray Train keeps metrics only with a checkpoint: rank 0 attaches the run's final one (train() just
        # wrote it; Ray copies it under <out>/ray_train), which also makes it the Result's checkpoint.
        report = {"policy_version": trainer.version, "steps": trainer.step, "summary": trainer.summary(),
                  "restarted_from_step": trainer.resumed_from_step if restarted else None}
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(str((trainer.out / "checkpoint").resolve())))
    else:
        ray.train.report({"policy_version": trainer.version, "steps": trainer.step})

