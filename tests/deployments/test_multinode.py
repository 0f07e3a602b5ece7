"""Several Ray nodes on this one machine (ray.cluster_utils.Cluster, all on 127.0.0.1, token auth):
replicas placed on two nodes by a custom resource, weights through the object store (no folder any two
nodes share), and a node lost in the middle of a training run.

One module-scoped cluster: a head (Serve's controller, the ingress, the aggregator, the weight
registry, this driver and its trainer) and nodes A and B, each with its own temp dir, no CPUs and one
`rollout_slot`, the resource every replica asks for: two replicas, one per node. The second test adds
a spare node with a slot, so Serve has somewhere to restart the replica of the node it removes.

Replicas never fuse chunks and use one torch thread, so a chunk gives bit-for-bit the same trajectory
on any replica and in this process.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch

from serve_app.config import ConfigError, load_config
from serve_app.retry import RetryPolicy
from serve_app.serving.options import OptionConflictError, check_running_options, deployment_options
from serve_app.local_ray import free_loopback_port
from tests.replicas import wait_for_running_replicas

APP = "flowgrpo-multinode"
SLOT = "rollout_slot"
MB = 2**20
OVERRIDES = [
    f"app_name={APP}",
    "weights.transport=object_store",
    "sampling.num_steps=4",
    "sampling.guidance_scale=1.0",
    "sampling.sde_window_size=null",
    "ingress.chunk_size=2",
    # A chunk lost with its node fails its request (503) instead of running again at the ingress: the
    # client's retry of the whole rollout is what the node-loss test exercises.
    "ingress.chunk_retry.attempts=1",
    "replica.num_cpus=0",
    f"replica.resources={{{SLOT}: 1}}",
    "replica.torch_threads=1",
    "replica.max_batch_size=1",
    "replica.max_ongoing_requests=1",  # a request of several chunks keeps both replicas busy
    "replica.autoscaling.min_replicas=2",
    "replica.autoscaling.max_replicas=2",
]
TRAINER = [
    "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8", "trainer.inner_epochs=1",
    "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=0", "trainer.lr=1e-2",
]


# --------------------------------------------------------------------------------------------
# The placement knob, without a cluster


def test_replica_resources_become_ray_actor_options_and_are_checked():
    config = load_config("diffusion_rollout", [f"replica.resources={{{SLOT}: 1}}", "replica.num_cpus=0"])
    assert deployment_options(config)["DiffusionReplica"]["ray_actor_options"] == {
        "num_cpus": 0, "num_gpus": 0, "resources": {SLOT: 1.0}}
    # No custom resources: nothing is passed, Serve's default stands.
    assert "resources" not in deployment_options(load_config("diffusion_rollout"))["DiffusionReplica"]["ray_actor_options"]
    for bad, message in (("{CPU: 1}", "set it with replica.num_cpus"), (f"{{{SLOT}: 1.5}}", "(0, 1] or a whole number"),
                         (f"{{{SLOT}: 0}}", "(0, 1] or a whole number")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("diffusion_rollout", [f"replica.resources={bad}"])


@pytest.mark.parametrize(("assigned", "conflict"), [
    ({"CPU": 0.5, SLOT: 1.0}, None),
    ({"CPU": 0.5}, "ray_actor_options.resources = {} where the rollout config has replica.resources = {'rollout_slot': 1.0}"),
    ({"CPU": 0.5, SLOT: 1.0, "other": 1.0}, "ray_actor_options.resources = {'rollout_slot': 1.0, 'other': 1.0}"),
])
def test_a_replica_run_with_other_resources_refuses_to_start(monkeypatch, assigned, conflict):
    import types

    import ray
    from ray import serve

    config = load_config("diffusion_rollout", [f"replica.resources={{{SLOT}: 1}}"])
    running = types.SimpleNamespace(**{k: getattr(config.replica, k) for k in (
        "max_ongoing_requests", "max_queued_requests", "health_check_period_s", "health_check_timeout_s")},
        autoscaling_config=types.SimpleNamespace(**config.replica.autoscaling.model_dump()))
    monkeypatch.setattr(serve, "get_replica_context", lambda: types.SimpleNamespace(_deployment_config=running))
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(get_assigned_resources=lambda: assigned))
    if conflict is None:
        check_running_options(config, "DiffusionReplica")
    else:
        with pytest.raises(OptionConflictError, match=re.escape(conflict)):
            check_running_options(config, "DiffusionReplica")


# --------------------------------------------------------------------------------------------
# The cluster


@dataclass
class MultiNode:
    cluster: Any  # ray.cluster_utils.Cluster
    metrics_ports: dict[str, int] = field(default_factory=dict)  # node id -> its metrics agent's export port
    temp_dirs: list[str] = field(default_factory=list)

    def node_args(self, **extra: Any) -> dict[str, Any]:
        """A node of its own: temp dir (short: Ray's socket paths must fit 107 bytes), small object store,
        a metrics export port on loopback."""
        temp = tempfile.mkdtemp(prefix="fgmn", dir="/tmp")
        self.temp_dirs.append(temp)
        return {"object_store_memory": 100 * MB, "temp_dir": temp, "metrics_export_port": free_loopback_port(), **extra}

    def add_node(self, **extra: Any):
        args = self.node_args(num_cpus=0, resources={SLOT: 1}, **extra)
        node = self.cluster.add_node(**args)
        self.metrics_ports[node.node_id] = args["metrics_export_port"]
        return node

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id


@pytest.fixture(scope="module")
def multinode(flowgrpo_home):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app.app import AppArgs, build_app

    assert not ray.is_initialized(), "an earlier test left Ray initialized in this process"
    nodes = MultiNode(cluster=None)
    head = nodes.node_args(num_cpus=1, include_dashboard=False, _system_config={"metrics_report_interval_ms": 1000})
    try:
        nodes.cluster = Cluster(initialize_head=True, head_node_args=head)
        nodes.metrics_ports[nodes.head_id] = head["metrics_export_port"]
        nodes.add_node()
        nodes.add_node()
        ray.init(address=nodes.cluster.address, logging_level="ERROR",
                 runtime_env={"env_vars": {"FLOWGRPO_HOME": flowgrpo_home}})
        serve.start(proxy_location="Disabled")  # handles only: no HTTP proxy on any node
        serve.run(build_app(AppArgs(overrides=OVERRIDES)), name=APP, route_prefix=None)
        yield nodes
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if nodes.cluster is not None:
            nodes.cluster.shutdown()
        for temp in nodes.temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)


def _actors(prefix: str) -> dict[str, tuple[str, int]]:
    """{name: (node id, pid)} of the live named actors whose name starts with `prefix` (Serve names a
    replica's actor SERVE_REPLICA::<app>#<deployment>#<id>)."""
    import ray

    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            found[entry["name"]] = ray.get(actor.__ray_call__.remote(
                lambda _self: (ray.get_runtime_context().get_node_id(), os.getpid())), timeout=30)
    return found


def _replicas(deployment: str = "DiffusionReplica") -> dict[str, tuple[str, int]]:
    return _actors(f"SERVE_REPLICA::{APP}#{deployment}#")


def _wait_for_replicas_on(node_ids: set[str], timeout_s: float = 90) -> dict[str, tuple[str, int]]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            replicas = _replicas()
            if {node for node, _ in replicas.values()} == node_ids and len(replicas) == len(node_ids):
                return replicas
        except Exception:  # an actor listed a moment ago may be dead by the time it is asked
            replicas = {}
        assert time.monotonic() < deadline, f"replicas on {replicas} after {timeout_s} s, expected on {node_ids}"
        time.sleep(0.5)


def _trainer(tmp_path, client):
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer

    config = load_trainer_config("trainer/flowgrpo", [*OVERRIDES, *TRAINER])
    return FlowGRPOTrainer(config, client, tmp_path / "out", progress=False)


def _scrape(port: int, metric: str) -> list[float]:
    """Values of `metric` for this app in the Prometheus text of one node's metrics agent (a counter's
    name ends in _total there)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(f"ray_{metric}{{") and f'application="{APP}"' in line]


def _wait_for_metric(port: int, metric: str, accept, timeout_s: float = 30) -> list[float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = _scrape(port, metric)
        if values and accept(values):
            return values
        assert time.monotonic() < deadline, f"{metric} on port {port}: {values}"
        time.sleep(0.5)


PROMPTS = ["a red circle", "two cats"]
LARGE = {"height": 128, "width": 128}


@pytest.mark.cluster
@pytest.mark.slow
def test_replicas_on_two_nodes_serve_a_version_like_one_process(multinode, tmp_path, flowgrpo_home):
    from serve_app.app import AppArgs, run_local
    from serve_app.client import RolloutClient
    from serve_app.weights import weights_dir

    a, b = multinode.cluster.worker_nodes
    # Placement, as Ray reports it: one replica on each slot node; the rest of the app on the head.
    _wait_for_replicas_on({a.node_id, b.node_id})
    others = {**_replicas("TokenizerIngress"), **_replicas("TrajectoryAggregator"),
              **_actors("weights/")}
    assert len(others) == 3 and {node for node, _ in others.values()} == {multinode.head_id}, others

    # The trainer publishes version 1 through the object store.
    client = RolloutClient(APP)
    trainer = _trainer(tmp_path, client)
    row = trainer.train_step()
    assert (int(row["policy_version"]), trainer.version) == (0, 1) and row["onpolicy_ratio_dev"] < 1e-6
    assert not weights_dir(trainer.config).exists()  # no folder: the registry holds the versions

    # 2 prompts x 4 samples in chunks of 2 on replicas that take one chunk at a time: both nodes serve.
    batch = client.rollout(PROMPTS, 4, policy_version=1, seed=123)
    for node in (a, b):
        port = multinode.metrics_ports[node.node_id]
        _wait_for_metric(port, "flowgrpo_replica_policy_version", lambda v: v == [1.0])
        assert sum(_wait_for_metric(port, "flowgrpo_images_generated_total", lambda v: sum(v) > 0)) > 0

    # The reference: the same request in this one process (Serve's local testing mode), version 1 fetched
    # from the same registry.
    threads = torch.get_num_threads()
    try:
        reference = run_local(AppArgs(overrides=OVERRIDES), name=f"{APP}-reference").rollout.remote(
            {"prompts": PROMPTS, "group_size": 4, "policy_version": 1, "seed": 123}).result(timeout_s=120)
    finally:
        torch.set_num_threads(threads)  # the local replica set it to replica.torch_threads
    got, want = batch.trajectory, reference.trajectory
    assert (batch.policy_version, got.policy_version, want.policy_version) == (1, 1, 1)
    assert got.weights_hash == want.weights_hash == trainer.store.published_hash(1)
    assert torch.equal(got.seeds, want.seeds) and torch.equal(got.prompt_index, want.prompt_index)
    for name in ("latents", "log_probs"):
        difference = (getattr(got, name) - getattr(want, name)).abs().max().item()
        assert difference <= 1e-6, (name, difference)
    assert torch.equal(got.images, want.images)
    assert torch.allclose(batch.advantages, reference.advantages, atol=1e-6)
    trainer.finish()


@dataclass
class _Call:
    prompts: list[str]
    group_size: int
    sampling: Any
    policy_version: int | None
    seed: int | None
    batch: Any
    resent: int  # times the client sent this rollout again after losing it


class _Recorder:
    """The trainer's rollout source: the real client, recording each rollout it is asked for."""

    def __init__(self, client) -> None:
        self.client = client
        self.calls: list[_Call] = []

    def rollout(self, prompts, group_size, sampling=None, policy_version=None, seed=None, *, timeout_s=None, fetch=True,
                return_images=False):
        lost = self.client.lost_rollouts
        batch = self.client.rollout(prompts, group_size, sampling, policy_version, seed, timeout_s=timeout_s, fetch=fetch,
                                    return_images=return_images)
        self.calls.append(_Call(list(prompts), group_size, sampling, policy_version, seed, batch,
                                self.client.lost_rollouts - lost))
        return batch


def _replica_actor(replica_name: str):
    import ray

    namespace = next(e["namespace"] for e in ray.util.list_named_actors(all_namespaces=True) if e["name"] == replica_name)
    return ray.get_actor(replica_name, namespace=namespace)


def _cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def _ongoing_requests(replica) -> int:
    """What a replica counts as in its hands (Serve's ReplicaActor answers this on a thread of its own, so
    it answers while the replica computes)."""
    import ray

    return ray.get(replica.get_num_ongoing_requests.remote(), timeout=10)


@pytest.mark.cluster
@pytest.mark.slow
def test_a_node_lost_mid_run_costs_one_identical_retry_and_no_wrong_version(multinode, tmp_path):
    from serve_app.client import RolloutClient

    a, b = multinode.cluster.worker_nodes
    ((victim, victim_pid),) = [(name, pid) for name, (node, pid) in _wait_for_replicas_on({a.node_id, b.node_id}).items()
                               if node == a.node_id]
    spare = multinode.add_node()
    recorder = _Recorder(RolloutClient(APP, retry=RetryPolicy(attempts=2, backoff_s=2.0, max_backoff_s=2.0)))
    trainer = _trainer(tmp_path, recorder)
    rows = [trainer.train_step()]  # undisturbed; publishes the next version

    # The next step's rollout runs while node A goes: once A's replica computes a chunk, freeze it (the chunk
    # is then certainly lost with the node, not finished a moment before) and remove the node. Computing:
    # the replica counts a request in hand (Serve's router may still send elsewhere a request whose replica
    # dies before taking it) and has used CPU since (its CPU time alone also moves with health checks).
    result: dict[str, Any] = {}

    def disturbed_step() -> None:
        try:
            result["row"] = trainer.train_step()
        except BaseException as exc:  # shown by the assertion below, not lost in the thread
            result["error"] = exc

    step = threading.Thread(target=disturbed_step, daemon=True)
    victim_replica = _replica_actor(victim)
    assert _ongoing_requests(victim_replica) == 0
    step.start()
    deadline = time.monotonic() + 60
    while _ongoing_requests(victim_replica) == 0:
        assert step.is_alive() and time.monotonic() < deadline, "node A's replica never took a chunk"
    busy_from = _cpu_seconds(victim_pid)
    while _cpu_seconds(victim_pid) - busy_from < 0.02:
        assert step.is_alive() and time.monotonic() < deadline, "node A's replica never started on its chunk"
        time.sleep(0.002)
    os.kill(victim_pid, signal.SIGSTOP)
    try:
        multinode.cluster.remove_node(a)
    finally:
        try:
            os.kill(victim_pid, signal.SIGKILL)  # a stopped process may outlive its raylet
        except ProcessLookupError:
            pass
    step.join(timeout=180)
    assert not step.is_alive() and "row" in result, f"the training step did not finish after the node loss: {result}"
    rows.append(result["row"])
    rows.append(trainer.train_step())  # training continues on the nodes left

    # Serve restarted the lost replica on the spare node; the client resent exactly one rollout.
    _wait_for_replicas_on({b.node_id, spare.node_id})
    assert [c.resent for c in recorder.calls] == [0, 1, 0]
    # Every trajectory carries the version its request was pinned to, and that version's weights.
    versions = [c.policy_version for c in recorder.calls]
    assert versions == [int(r["policy_version"]) for r in rows] and len(set(versions)) == 3
    for call in recorder.calls:
        assert call.batch.policy_version == call.batch.trajectory.policy_version == call.policy_version
        assert call.batch.trajectory.weights_hash == trainer.store.published_hash(call.policy_version)
    assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)  # each step replayed the weights it sampled with

    # The resent rollout is the batch the undisturbed request gives: ask again, on a cluster at rest.
    lost = recorder.calls[1]
    again = RolloutClient(APP).rollout(lost.prompts, lost.group_size, lost.sampling, lost.policy_version, lost.seed,
                                       timeout_s=120)
    for name in ("latents", "log_probs", "images", "seeds", "prompt_index", "sample_index"):
        assert torch.equal(getattr(lost.batch.trajectory, name), getattr(again.trajectory, name)), name
    assert torch.equal(lost.batch.advantages, again.advantages)
    # The restarted replica serves pinned versions on the spare node (once Serve routes to it). Its actor is up
    # (above) before it has loaded its policy: on a loaded machine that takes longer than the routing loop below
    # allows, so first wait for Serve to count it RUNNING.
    assert wait_for_running_replicas(APP, 2, timeout_s=180) == 2, "the restarted replica did not finish loading"
    port, deadline = multinode.metrics_ports[spare.node_id], time.monotonic() + 60
    while lost.policy_version not in _scrape(port, "flowgrpo_replica_policy_version"):
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "flowgrpo" in line][:20]
        RolloutClient(APP).rollout(lost.prompts, lost.group_size, lost.sampling, lost.policy_version, lost.seed)
        time.sleep(1.5)  # metrics_report_interval_ms = 1000
    trainer.finish()


@pytest.mark.cluster
@pytest.mark.slow
def test_a_trainer_on_its_own_node_fetches_the_transitions_from_the_replicas_nodes_alone(multinode):
    """The data plane across nodes: the trainer's batch is what one process samples, and its transitions
    go from the replicas' nodes to the trainer's; the ingress's node (the head) holds references only.
    Last in the module: it adds a node the other tests' placement does not expect."""
    import ray

    from serve_app.app import AppArgs, run_local

    multinode.cluster.add_node(**multinode.node_args(num_cpus=1, resources={"trainer_slot": 1}))

    @ray.remote(num_cpus=0, resources={"trainer_slot": 1})
    def trainer_side():
        from serve_app.client import RolloutClient

        # 128 px: a chunk's transitions (135 kB) exceed Ray's 100 kB inline limit, so they live in the object
        # store of the node that made them, as a real model's do (smaller ones travel inline with their reference).
        batch = RolloutClient(APP).rollout(PROMPTS, 4, LARGE, policy_version=0, seed=77)  # fetches the transitions
        locations = ray.experimental.get_object_locations([chunk.transitions for chunk in batch.chunks])
        return (ray.get_runtime_context().get_node_id(), [set(at["node_ids"]) for at in locations.values()],
                batch.transitions)

    trainer_node, held_on, got = ray.get(trainer_side.remote(), timeout=300)
    replica_nodes = {node for node, _ in _replicas().values()}
    assert trainer_node not in replica_nodes | {multinode.head_id}
    for nodes in held_on:
        assert multinode.head_id not in nodes, held_on  # nothing of a trajectory on the ingress's node
        assert trainer_node in nodes and nodes - {trainer_node} <= replica_nodes, (nodes, replica_nodes)
    threads = torch.get_num_threads()
    try:
        want = run_local(AppArgs(overrides=OVERRIDES), name=f"{APP}-reference-v0").rollout.remote(
            {"prompts": PROMPTS, "group_size": 4, "sampling": LARGE, "policy_version": 0, "seed": 77}
        ).result(timeout_s=120).transitions
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.seeds, want.seeds) and torch.equal(got.prompt_index, want.prompt_index)
    for name in ("latents", "log_probs"):
        assert (getattr(got, name) - getattr(want, name)).abs().max().item() <= 1e-6, name
