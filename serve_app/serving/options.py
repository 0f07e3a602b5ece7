"""The Serve options of each deployment, computed from the rollout config: their one home.

``build_app`` applies them with ``serve.deployment(...)``. Serve then applies the ``deployments:``
entries of a serve_config.yaml over them, so an option set in both places would silently take the
YAML's value (a replica asked for with a GPU starting without one). Each deployment therefore checks,
in its constructor, that Serve runs it with exactly the config's options, and fails its deployment
with a message naming both places when it does not (:func:`check_running_options`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from serve_app.config import AutoscalingConfig, RolloutConfig
from serve_app.errors import RolloutError
from serve_app.rewards.composite import RewardSpec


@dataclass(frozen=True)
class Option:
    serve: str  # dotted name in Serve's deployment options
    setting: str  # dotted name in the rollout config


OPTIONS: dict[str, tuple[Option, ...]] = {
    "TokenizerIngress": (
        Option("ray_actor_options.num_cpus", "ingress.num_cpus"),
        Option("max_ongoing_requests", "ingress.max_ongoing_requests"),
        Option("max_queued_requests", "ingress.max_queued_requests"),
    ),
    "DiffusionReplica": (
        Option("ray_actor_options.num_cpus", "replica.num_cpus"),
        Option("ray_actor_options.num_gpus", "replica.num_gpus"),
        Option("ray_actor_options.resources", "replica.resources"),
        Option("max_ongoing_requests", "replica.max_ongoing_requests"),
        Option("max_queued_requests", "replica.max_queued_requests"),
        Option("health_check_period_s", "replica.health_check_period_s"),
        Option("health_check_timeout_s", "replica.health_check_timeout_s"),
        *(Option(f"autoscaling_config.{key}", f"replica.autoscaling.{key}") for key in AutoscalingConfig.model_fields),
    ),
    "TrajectoryAggregator": (
        Option("ray_actor_options.num_cpus", "aggregator.num_cpus"),
        Option("max_ongoing_requests", "aggregator.max_ongoing_requests"),
    ),
}


# Ray's own resources: what `get_assigned_resources` reports besides the custom ones a deployment asked for.
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class OptionConflictError(RolloutError):
    """Serve runs a deployment with an option other than the config's: it was set a second time."""


def _configured(config: RolloutConfig, deployment: str) -> dict[str, Any]:
    """{serve option: value} of one deployment; None and {} (Serve's own default, e.g. initial_replicas, no
    custom resources) left out."""
    values = {o.serve: attrgetter(o.setting)(config) for o in OPTIONS[deployment]}
    return {name: value for name, value in values.items() if value is not None and value != {}}


def deployment_options(config: RolloutConfig) -> dict[str, dict[str, Any]]:
    """Keyword arguments of ``serve.deployment`` for each deployment of the app."""
    options: dict[str, dict[str, Any]] = {}
    for deployment in OPTIONS:
        nested: dict[str, Any] = {}
        for name, value in _configured(config, deployment).items():
            *parents, leaf = name.split(".")
            node = nested
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        options[deployment] = nested
    return options


def check_running_options(config: RolloutConfig, deployment: str) -> None:
    """Raise OptionConflictError if this Serve replica runs with options other than the config's.

    Outside a Serve replica (local testing mode, the plain classes) there is nothing to check.
    """
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:
        return
    # The replica context is the one place a replica can read the options Serve applied; Ray 2.60
    # marks the field private but fills it before the user constructor runs.
    running = context._deployment_config
    resources = ray.get_runtime_context().get_assigned_resources()
    conflicts, settings = [], []
    for option in OPTIONS[deployment]:
        expected = attrgetter(option.setting)(config)
        if expected is None:
            continue
        if option.serve == "ray_actor_options.resources":
            custom = {k: v for k, v in resources.items() if k not in RAY_RESOURCES}
            if not _same_resources(custom, expected):
                conflicts.append(f"{option.serve} = {custom} where the rollout config has {option.setting} = {expected}")
                settings.append(f"'{option.setting}=...'")
            continue
        if option.serve.startswith("ray_actor_options."):
            actual = resources.get("GPU" if option.serve.endswith("num_gpus") else "CPU", 0.0)
        elif option.serve.startswith("autoscaling_config."):
            scaling = running.autoscaling_config
            actual = None if scaling is None else getattr(scaling, option.serve.split(".", 1)[1])
        else:
            actual = getattr(running, option.serve)
        if actual is None or not math.isclose(float(actual), float(expected), rel_tol=1e-9, abs_tol=1e-9):
            conflicts.append(f"{option.serve} = {actual} where the rollout config has {option.setting} = {expected}")
            settings.append(f"'{option.setting}=...'")
    if conflicts:
        raise OptionConflictError(
            f"{deployment} runs with Serve options other than the rollout config's: {'; '.join(conflicts)}. "
            "They were set a second time, most likely in the `deployments:` entries of serve_config.yaml, which "
            f"Serve applies over build_app's. Set each option in one place: the app's `args.overrides` "
            f"({', '.join(settings)}), not `deployments:`."
        )


def _same_resources(actual: dict[str, float], expected: dict[str, float]) -> bool:
    return actual.keys() == expected.keys() and all(
        math.isclose(float(actual[k]), float(expected[k]), rel_tol=1e-9, abs_tol=1e-9) for k in expected
    )


def reward_server_options(spec: RewardSpec) -> dict[str, Any]:
    """Keyword arguments of ``serve.deployment`` for the RewardServer of one reward component
    (``placement: deployment``): its own resources, replicas or autoscaling, and runtime_env."""
    server = spec.server
    actor: dict[str, Any] = {"num_cpus": server.num_cpus, "num_gpus": server.num_gpus}
    if server.runtime_env:
        actor["runtime_env"] = dict(server.runtime_env)
    options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": server.max_ongoing_requests}
    if server.max_replicas is None:
        options["num_replicas"] = server.min_replicas
    else:
        options["autoscaling_config"] = {
            "min_replicas": server.min_replicas,
            "max_replicas": server.max_replicas,
            "target_ongoing_requests": server.target_ongoing_requests,
        }
    return options


def check_reward_server_options(spec: RewardSpec, key: str) -> None:
    """Raise OptionConflictError if this RewardServer replica runs with Serve options other than its
    reward spec's (``reward.components[].server``). Outside a Serve replica there is nothing to check."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:
        return
    running = context._deployment_config  # filled before the constructor runs (see check_running_options)
    resources = ray.get_runtime_context().get_assigned_resources()
    server = spec.server
    scaling = running.autoscaling_config
    found = {
        "num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0),
        "max_ongoing_requests": running.max_ongoing_requests,
        "min_replicas": running.num_replicas if scaling is None else scaling.min_replicas,
    }
    expected = {"num_cpus": server.num_cpus, "num_gpus": server.num_gpus,
                "max_ongoing_requests": server.max_ongoing_requests, "min_replicas": server.min_replicas}
    conflicts = [f"{name} = {found[name]} where the spec has {value}" for name, value in expected.items()
                 if found[name] is None or not math.isclose(float(found[name]), float(value), abs_tol=1e-9)]
    if conflicts:
        raise OptionConflictError(
            f"RewardServer_{key} runs with Serve options other than its reward spec's (reward.components[].server): "
            f"{'; '.join(conflicts)}. Set them in the reward spec, not in the `deployments:` of serve_config.yaml."
        )
