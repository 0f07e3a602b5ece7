"""Deployment options have one home, the rollout config; a replica run with other options refuses to start."""

import types

import pytest

from serve_app.config import load_config
from serve_app.serving.options import OptionConflictError, check_running_options, deployment_options

CONFIG = load_config("diffusion_rollout", ["replica.num_gpus=1", "replica.autoscaling.max_replicas=8"])


def test_options_are_computed_from_the_config():
    options = deployment_options(CONFIG)
    replica = options["DiffusionReplica"]
    assert replica["ray_actor_options"] == {"num_cpus": CONFIG.replica.num_cpus, "num_gpus": 1}
    assert replica["autoscaling_config"]["max_replicas"] == 8
    assert "initial_replicas" not in replica["autoscaling_config"]  # None: Serve's own default (min_replicas)
    assert replica["health_check_period_s"] == CONFIG.replica.health_check_period_s
    assert options["TrajectoryAggregator"]["max_ongoing_requests"] == CONFIG.aggregator.max_ongoing_requests
    assert options["TokenizerIngress"]["max_queued_requests"] == CONFIG.ingress.max_queued_requests


def test_outside_a_serve_replica_there_is_nothing_to_check():
    check_running_options(CONFIG, "DiffusionReplica")  # no replica context: returns


def _fake_replica(monkeypatch, *, gpus: float, max_replicas: int) -> None:
    """What Serve and Ray report inside a replica whose serve_config.yaml restated some options."""
    import ray
    from ray import serve

    scaling = types.SimpleNamespace(**{**CONFIG.replica.autoscaling.model_dump(), "max_replicas": max_replicas})
    running = types.SimpleNamespace(
        max_ongoing_requests=CONFIG.replica.max_ongoing_requests, max_queued_requests=CONFIG.replica.max_queued_requests,
        health_check_period_s=CONFIG.replica.health_check_period_s,
        health_check_timeout_s=CONFIG.replica.health_check_timeout_s, autoscaling_config=scaling,
    )
    monkeypatch.setattr(serve, "get_replica_context", lambda: types.SimpleNamespace(_deployment_config=running))
    resources = {"CPU": CONFIG.replica.num_cpus, **({"GPU": gpus} if gpus else {})}
    context = types.SimpleNamespace(get_assigned_resources=lambda: resources)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: context)


def test_matching_options_pass(monkeypatch):
    _fake_replica(monkeypatch, gpus=1, max_replicas=8)
    check_running_options(CONFIG, "DiffusionReplica")


def test_an_option_set_twice_fails_naming_both_places(monkeypatch):
    _fake_replica(monkeypatch, gpus=0, max_replicas=2)
    with pytest.raises(OptionConflictError) as info:
        check_running_options(CONFIG, "DiffusionReplica")
    message = str(info.value)
    assert "ray_actor_options.num_gpus = 0.0 where the rollout config has replica.num_gpus = 1.0" in message
    assert "autoscaling_config.max_replicas = 2 where the rollout config has replica.autoscaling.max_replicas = 8" in message
    assert "serve_config.yaml" in message and "'replica.num_gpus=...'" in message
