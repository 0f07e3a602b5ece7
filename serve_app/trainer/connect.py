"""How a trainer process reaches the deployed app: by handle on its Ray cluster (the rollout client and, for
prefetching new versions, the replicas' handle; versions go to the app's weight store), or over HTTP alone
(rollouts and versions through the HTTP API; Ray is never imported). The CLI and rank 0 of a data-parallel
run connect the same way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from serve_app.schemas import BASE_HASH
from serve_app.trainer.config import DistributedSection, TrainerRunConfig
from serve_app.weights.versions import LoraSpec, WeightKind


@dataclass(frozen=True)
class AppConnection:
    client: Any  # RolloutClient, or HttpRolloutClient
    replica: Any | None  # the DiffusionReplica deployment handle, with trainer.prefetch (by handle only)
    publisher: Any | None = None  # where versions go; None: the config's weight store


class HttpPublisher:
    """The trainer's WeightPublisher over the HTTP API: POST /v1/weights numbers and stores each version; the
    hashes of versions this process published are known without asking."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._hashes: dict[int, str] = {0: BASE_HASH}

    def publish_next(self, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                     lora: LoraSpec | None = None) -> tuple[int, str]:
        version, digest = self.client.publish(tensors, kind=kind, lora=lora)
        self._hashes[version] = digest
        return version, digest

    def published_hash(self, version: int) -> str:
        if version not in self._hashes:
            self._hashes[version] = self.client.version(version).weights_hash
        return self._hashes[version]


def connect_over_http(url: str, token: str | None) -> AppConnection:
    """The app's HTTP API at `url` (bearer `token`): checked now, so a wrong address fails before training.

    Raises:
        ConnectionLostError: nothing answers at `url`.
    """
    from serve_app.http_client import HttpRolloutClient

    client = HttpRolloutClient(url, token)
    client.versions()  # an unreachable address or a refused token fails here, with the cause
    return AppConnection(client, None, HttpPublisher(client))


def connect_to_app(config: TrainerRunConfig) -> AppConnection:
    """The app `config.app_name` on the Ray cluster this process is connected to.

    Raises:
        AppNotDeployedError: the app is not running (the message says how to start it).
    """
    from serve_app.client import RolloutClient

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
