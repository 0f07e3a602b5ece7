"""`build_app(args)`: the deployment graph, and the `import_path` of serve_config.yaml.

    TokenizerIngress --(chunks)--> DiffusionReplica x N (autoscaled)
           \\--(each chunk's images as it arrives, then all trajectories)--> TrajectoryAggregator --> TrajectoryBatch
                                                     \\--(uint8 images, prompts)--> RewardServer_<key> x M
                                                        (one deployment per reward placed on one)

Every deployment option comes from the rollout config (serve_app.serving.options); serve_config.yaml's
`args` choose the config and override it, and its `deployments:` restate nothing.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from serve_app.config import RolloutConfig, load_config
from serve_app.serving.options import deployment_options, reward_server_options
from serve_app.rewards.composite import reward_keys


class AppArgs(BaseModel):
    """The `args:` of serve_config.yaml (validated by Serve before build_app runs)."""

    model_config = ConfigDict(extra="forbid")

    config: str = Field("diffusion_rollout", description="Config name under configs/ (or a .yaml path).")
    overrides: list[str] = Field(default_factory=list, description="Overrides, e.g. sampling.num_steps=4, model=tiny_sd3.")


def build_graph(config: RolloutConfig) -> Application:
    # Imported here: deployments/ pull in Ray Serve, FastAPI and the models only when a graph is built.
    from deployments.diffusion_replica import DiffusionReplica
    from deployments.reward_server import RewardServer
    from deployments.tokenizer_ingress import TokenizerIngress
    from deployments.trajectory_aggregator import TrajectoryAggregator

    options = deployment_options(config)
    replica = serve.deployment(DiffusionReplica, name="DiffusionReplica", **options["DiffusionReplica"]).bind(config)
    specs = config.reward.components
    reward_servers = {
        key: serve.deployment(RewardServer, name=f"RewardServer_{key}", **reward_server_options(spec)).bind(spec, key)
        for key, spec in zip(reward_keys(specs), specs)
        if spec.placement == "deployment"
    }
    aggregator = serve.deployment(
        TrajectoryAggregator, name="TrajectoryAggregator", **options["TrajectoryAggregator"]
    ).bind(config, reward_servers)
    return serve.deployment(TokenizerIngress, name="TokenizerIngress", **options["TokenizerIngress"]).bind(
        replica, aggregator, config
    )


def build_app(args: AppArgs) -> Application:
    """Validate the args, load the config (failing on unknown keys), wire the graph."""
    if isinstance(args, dict):  # called directly from Python rather than by `serve run/deploy`
        args = AppArgs.model_validate(args)
    return build_graph(load_config(args.config, args.overrides))


def run_local(args: AppArgs | dict, *, name: str) -> DeploymentHandle:
    """The whole app in Serve's local testing mode: one process, no Ray cluster, real handles and
    @serve.batch (tests, benchmarks, notebooks). Returns the ingress handle."""
    allow_serve_batch_in_local_mode()
    return serve.run(build_app(args), name=name, route_prefix=None, _local_testing_mode=True)


def allow_serve_batch_in_local_mode() -> None:
    """Ray 2.60's local testing mode sets no replica context, and @serve.batch reads it only to log a
    sizing warning (ray-project/ray#48477 lists get_replica_context() there as a follow-up); that
    lookup raises, so it is skipped in this process. Real clusters run @serve.batch unpatched."""
    from ray.serve.batching import _BatchQueue

    _BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
