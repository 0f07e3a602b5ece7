"""How a trainer process reaches the deployed app: the rollout client and, for prefetching new versions,
the replicas' handle. The CLI and rank 0 of a data-parallel run connect the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.client import RolloutClient
from serve_app.trainer.config import DistributedSection, TrainerRunConfig


@dataclass(frozen=True)
class AppConnection:
    client: RolloutClient
    replica: Any | None  # the DiffusionReplica deployment handle, with trainer.prefetch


def connect_to_app(config: TrainerRunConfig) -> AppConnection:
    """The app `config.app_name` on the Ray cluster this process is connected to.

    Raises:
        AppNotDeployedError: the app is not running (the message says how to start it).
    """
    client = RolloutClient(config.app_name)
    _ = client.handle  # fails now, with the deploy hint, when the app is not running
    replica = None
    if config.trainer.prefetch:
        from ray import serve

        replica = serve.get_deployment_handle("DiffusionReplica", config.app_name)
    return AppConnection(client, replica)


class PlacementError(RuntimeError):
    """The cluster cannot place the training workers the config asks for."""


def check_worker_placement(section: DistributedSection, *, available: dict[str, float], total: dict[str, float]) -> None:
    """Raise PlacementError unless `section.workers` workers fit in the cluster's free resources now.

    Ray Train would otherwise wait for them without a word: a run asked for more CPUs than the app left
    free sits silent until someone gives up on it.
    """
    wanted = {"CPU": section.workers * section.cpus_per_worker}
    if section.use_gpu:
        wanted["GPU"] = float(section.workers)
    short = {name: amount for name, amount in wanted.items() if available.get(name, 0.0) + 1e-9 < amount}
    if not short:
        return
    asked = ", ".join(f"{amount:g} {name}" for name, amount in wanted.items())
    free = ", ".join(f"{available.get(name, 0.0):g} of {total.get(name, 0.0):g} {name}" for name in wanted)
    fix = (f"lower trainer.distributed.cpus_per_worker (now {section.cpus_per_worker:g}; "
           f"{max(available.get('CPU', 0.0), 0.0) / section.workers:.2g} would fit), use fewer --workers, "
           "or start the cluster with more CPUs (`ray start --head --num-cpus N` counts logical CPUs)")
    if "GPU" in short:
        fix = "add GPU nodes, use fewer --workers, or trainer.distributed.use_gpu=false"
    raise PlacementError(
        f"{section.workers} training workers need {asked}; the cluster has {free} free (the rollout app's "
        f"deployments hold the rest): {fix}"
    )
