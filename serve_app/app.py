"""`build_app(args)`: the deployment graph, and the `import_path` of serve_config.yaml.

    TokenizerIngress --(chunks)--> DiffusionReplica x N (autoscaled)
           \\--(DeploymentResponses)--> TrajectoryAggregator --> TrajectoryBatch
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from serve_app.config import RolloutConfig, load_config


class AppArgs(BaseModel):
    """The `args:` of serve_config.yaml (validated by Serve before build_app runs)."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field("diffusion_rollout", description="Config name under configs/ (or a .yaml path).")
    overrides: list[str] = Field(default_factory=list, description="Dotlist overrides, e.g. sampling.num_steps=4.")


def deployment_options(config: RolloutConfig) -> dict[str, dict]:
    """Serve options of each deployment, computed from the config (so the YAML is the one place to tune)."""
    replica, ingress, aggregator = config.replica, config.ingress, config.aggregator
    autoscaling = replica.autoscaling.model_dump()
    if autoscaling["initial_replicas"] is None:
        del autoscaling["initial_replicas"]
    return {
        "TokenizerIngress": {
            "ray_actor_options": {"num_cpus": ingress.num_cpus},
            "max_ongoing_requests": ingress.max_ongoing_requests,
            "max_queued_requests": ingress.max_queued_requests,
        },
        "DiffusionReplica": {
            "ray_actor_options": {"num_cpus": replica.num_cpus, "num_gpus": replica.num_gpus},
            "autoscaling_config": autoscaling,
            "max_ongoing_requests": replica.max_ongoing_requests,
            "max_queued_requests": replica.max_queued_requests,
            "health_check_period_s": 10,
        },
        "TrajectoryAggregator": {
            "ray_actor_options": {"num_cpus": aggregator.num_cpus},
            "max_ongoing_requests": 64,
        },
    }


def build_graph(config: RolloutConfig) -> Application:
    # Imported here: deployments/ pull in Ray Serve, FastAPI and the models only when a graph is built.
    from deployments.diffusion_replica import DiffusionReplica
    from deployments.tokenizer_ingress import TokenizerIngress
    from deployments.trajectory_aggregator import TrajectoryAggregator

    options = deployment_options(config)
    replica = serve.deployment(DiffusionReplica, name="DiffusionReplica", **options["DiffusionReplica"]).bind(config)
    aggregator = serve.deployment(
        TrajectoryAggregator, name="TrajectoryAggregator", **options["TrajectoryAggregator"]
    ).bind(config)
    return serve.deployment(TokenizerIngress, name="TokenizerIngress", **options["TokenizerIngress"]).bind(
        replica, aggregator, config
    )


def build_app(args: AppArgs) -> Application:
    """Validate the args, load the config (failing on unknown keys), wire the graph."""
    if isinstance(args, dict):  # called directly from Python rather than by `serve run/deploy`
        args = AppArgs.model_validate(args)
    return build_graph(load_config(args.config, args.overrides))
