"""Every metric the shipped Grafana dashboard queries is one a running app and trainer export.

The session's shared cluster on loopback (tests/conftest.py), with a known metrics export port and a 1 s
report interval, runs the app; traffic, two training steps, a dropped batch and a weight mismatch make every series appear; then the
Prometheus text of the node's metrics agent is scraped over loopback.
"""

import json
import re
import time
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.cluster

DASHBOARD = Path(__file__).resolve().parents[2] / "serve_app" / "monitoring" / "flowgrpo_grafana_dashboard.json"
APP = "flowgrpo-metrics"


def unscorable(images, prompts):
    """A reward on its own RewardServer that fails on prompts saying "unscorable" (weight 0: the
    training steps see brightness only): its retries, failures and dropped groups reach the metrics. It
    scores what its RewardServer's runtime_env says, which this test process does not have."""
    import os

    # A RewardServer fuses calls: this one may hold several prompts.
    if any("unscorable" in p for p in prompts):
        raise ConnectionError("the scorer refused the prompt")
    return torch.full((len(prompts),), float(os.environ["FLOWGRPO_TEST_REWARD_VALUE"]))


# Imported by the reward's replica through the driver's working directory, which Ray puts on its path.
REWARDS = ("reward.components=[{name: brightness, args: {target: 0.8}}, {name: 'tests.deployments.test_metrics:unscorable',"
           " weight: 0.0, placement: deployment, groupwise: false, retry: {attempts: 2, backoff_s: 0.0}, on_error: drop_group,"
           " server: {runtime_env: {env_vars: {FLOWGRPO_TEST_REWARD_VALUE: '0.25'}}}}]")


@pytest.fixture(scope="module")
def cluster(ray_cluster, tmp_path_factory):
    """The app on the session's shared cluster (tests/conftest.py: a known metrics export port, a 1 s
    report interval), deleted when this module ends. Nothing has exported a flowgrpo series there yet
    (conftest runs this module first in the session; a process once connected to Ray exports what it
    records later to the next cluster it joins): every series the test sees is this module's app's or
    trainer's."""
    from ray import serve

    from serve_app.app import AppArgs, build_app

    port = ray_cluster.metrics_port
    deadline = time.monotonic() + 60
    while True:  # the metrics agent answers a moment after the cluster starts
        try:
            exported = _exported(port)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the node's metrics agent did not answer"
            time.sleep(0.5)
    earlier = sorted(set(re.findall(r"^(ray_flowgrpo_\w+)[{ ]", exported, re.MULTILINE)))
    assert not earlier, f"an earlier module's app or trainer exported {earlier} on the shared cluster"
    overrides = [f"app_name={APP}", f"replica.weights_dir={tmp_path_factory.mktemp('weights')}",
                 "sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=null", REWARDS]
    serve.run(build_app(AppArgs(overrides=overrides)), name=APP, route_prefix=None)
    yield port, overrides
    serve.delete(APP)


def _queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return {name for e in exprs for name in re.findall(r"\bray_flowgrpo_\w+", e)}


def _exported(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _drive_every_series(overrides: list[str], out: Path) -> None:
    """Rollouts, three training steps with one batch dropped, a group a reward fails on, and a request
    at a version whose adapter binds to no module (a weight mismatch on a replica)."""
    from serve_app.client import RolloutClient
    from serve_app.errors import WeightMismatchError
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer
    from serve_app.weights import LoraSpec, open_weight_store

    config = load_trainer_config("trainer/flowgrpo", [
        *overrides, "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8",
        "trainer.inner_epochs=1", "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=0",
        "trainer.max_staleness=1",
    ])
    trainer = FlowGRPOTrainer(config, RolloutClient(APP), out, progress=False)
    trainer.pipeline.max_staleness = 2  # one rollout more in flight than the bound: one batch is dropped
    rows = [trainer.train_step() for _ in range(3)]
    assert rows[-1]["dropped_batches"] >= 1
    trainer.finish()
    batch = RolloutClient(APP).rollout(["a cat", "an unscorable cat"], 2)
    assert list(batch.dropped_groups) == [1] and batch.rewards["unscorable"].tolist() == [0.25, 0.25]
    store = open_weight_store(config)
    version = store.latest_version() + 1
    store.publish(version, {"nothing.lora_A.weight": torch.zeros(2, 2)}, kind="lora",
                  lora=LoraSpec(rank=2, alpha=2.0, target_modules=["no_such_module"]))
    with pytest.raises(WeightMismatchError, match="0 of 1 adapter tensors bound"):
        RolloutClient(APP).rollout(["a cat"], 2, policy_version=version)


def test_every_metric_the_dashboard_queries_is_exported(cluster, tmp_path):
    port, overrides = cluster
    queried = _queried_metrics()
    assert len(queried) >= 10, queried
    _drive_every_series(overrides, tmp_path)
    # Gauges are exported while they are fresh (Ray drops a gauge ~30 s after its last set), so the
    # series are gathered over the scrapes of the next seconds, not required in a single one.
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while not queried <= seen and time.monotonic() < deadline:
        seen |= set(re.findall(r"^(ray_flowgrpo_\w+)[{ ]", _exported(port), re.MULTILINE))
        time.sleep(1)
    assert queried <= seen, f"queried by the dashboard but not exported: {sorted(queried - seen)}"
