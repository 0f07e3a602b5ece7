"""On a real cluster: one client's bad request never fails another's, a killed replica loses no request,
and every error answer, back-pressure's included, is a clean JSON body.

On the session's single-node cluster on 127.0.0.1 (tests/conftest.py), an app of exactly two replicas
that never fuse chunks (max_batch_size 1) and use one torch thread each, so a chunk re-run on the other
replica gives bit-for-bit the trajectory of the undisturbed run; beside it, an app of one replica with a
short queue and no chunk re-runs.
"""

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch

from tests.replicas import running_replicas

pytestmark = pytest.mark.cluster

APP = "flowgrpo-reliability"
OVERRIDES = [
    f"app_name={APP}",
    "sampling.num_steps=10",
    "ingress.chunk_size=4",
    "replica.num_cpus=0.2",
    "replica.torch_threads=1",
    "replica.max_batch_size=1",
    "replica.max_ongoing_requests=2",
    "replica.autoscaling.min_replicas=2",
    "replica.autoscaling.max_replicas=2",
]


# One replica that takes two chunks at once, queues one more and re-runs none: back-pressure and a lost chunk.
SINGLE_APP = f"{APP}-single"
SINGLE = [o.replace(APP, SINGLE_APP) for o in OVERRIDES if not o.startswith("replica.autoscaling.m")] + [
    "replica.max_queued_requests=1", "ingress.chunk_retry.attempts=1",
    "replica.autoscaling.min_replicas=1", "replica.autoscaling.max_replicas=1"]


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The module's two apps on the session's shared cluster (tests/conftest.py), deployed together (their
    replicas start side by side) and deleted when this module ends; returns the main app's base URL (the
    single-replica app's is beside it, SINGLE_APP in place of APP)."""
    from ray import serve

    from serve_app.app import AppArgs, build_app

    serve.run_many([serve.RunTarget(build_app(AppArgs(overrides=overrides)), name=name, route_prefix=f"/{name}")
                    for name, overrides in ((APP, OVERRIDES), (SINGLE_APP, SINGLE))])
    yield f"{ray_cluster.url}/{APP}"
    for name in (APP, SINGLE_APP):
        if name in serve.status().applications:
            serve.delete(name)


def _body(seed: int, **extra) -> dict:
    return {"prompts": [f"a cat number {seed}"], "group_size": 8, "seed": seed, **extra}


def _post(url: str, body: dict, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{url}/v1/rollouts", json=body, timeout=timeout)


# Bad requests of three kinds, each with the status and field its answer must carry.
BAD = [({"policy_version": 999999}, 409, ""),
       ({"sampling": {"height": 33}}, 422, "sampling.height"),
       ({"sampling": {"height": 2**63}}, 422, "sampling.height")]


def test_bad_requests_beside_good_ones_fail_alone(cluster):
    """Three bad requests among eight good ones, all sent at once: each bad one gets its own answer, every
    good one a 200."""
    bodies = [_body(i) for i in range(8)]
    at = (1, 4, 7)  # where the bad ones go: among the good ones, not after them
    for position, (bad, _, _) in zip(at, BAD):
        bodies.insert(position, _body(100 + position, **bad))
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: _post(cluster, b), bodies))
    failed = [responses[position] for position in at]
    good = [r for i, r in enumerate(responses) if i not in at]
    assert [r.status_code for r in good] == [200] * 8, [r.text[:200] for r in good]
    for answer, (_, status, field) in zip(failed, BAD):
        assert answer.status_code == status and answer.json()["field"] == field, answer.text


def _replica_pids(app: str) -> list[int]:
    """Ray titles each actor process `ray::<class>`, and `ray::<class>.<method>` while a method runs (a
    health check can be running when we look); the app name is unique to this module."""
    import psutil

    title = f"ray::ServeReplica:{app}:DiffusionReplica"
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [""])[0].strip().split(".", 1)[0] == title]


def _kill_one_replica_during(url: str, app: str, seeds: range) -> list[httpx.Response]:
    """Send one request per seed at once and SIGKILL a DiffusionReplica while they run."""
    pids = _replica_pids(app)
    assert len(pids) == 2, pids
    with ThreadPoolExecutor(len(seeds)) as pool:
        futures = [pool.submit(_post, url, _body(s)) for s in seeds]
        time.sleep(0.5)  # every request is planned and its chunks are on the replicas
        os.kill(pids[0], signal.SIGKILL)
        responses = [f.result() for f in futures]
    _wait_for_two_replicas(app)
    assert pids[0] not in _replica_pids(app)  # Serve replaced the killed process
    return responses


def _trajectory(response: httpx.Response) -> torch.Tensor:
    return torch.tensor([s["log_probs"] for s in response.json()["samples"]])


def _wait_for_two_replicas(app: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_replica_pids(app)) != 2 or running_replicas(app) != 2:
        assert time.monotonic() < deadline, "Serve did not restart the killed replica"
        time.sleep(1)


def test_a_killed_replica_loses_no_request(cluster):
    seeds = range(10)
    undisturbed = [_post(cluster, _body(s)) for s in seeds]
    assert all(r.status_code == 200 for r in undisturbed)
    disturbed = _kill_one_replica_during(cluster, APP, seeds)
    assert [r.status_code for r in disturbed] == [200] * 10, [r.text[:300] for r in disturbed]
    for before, after in zip(undisturbed, disturbed):
        # Re-run chunks come from their seeds: exactly the undisturbed trajectories.
        assert torch.equal(_trajectory(before), _trajectory(after))
        assert [s["seed"] for s in before.json()["samples"]] == [s["seed"] for s in after.json()["samples"]]


def test_a_batch_outlives_the_replicas_that_sampled_it(cluster):
    """A batch's tensors stay where the replicas made them until the trainer fetches them; owned by the
    ingress that asked for them, they survive those replicas' deaths."""
    from serve_app.client import RolloutClient

    client = RolloutClient(APP)
    request = (["a cat", "a dog"], 8)  # four chunks, most often on both replicas
    for seed in range(31, 41):  # a replica that ends its chunk before the next is routed may get them all
        unfetched = client.rollout(*request, seed=seed, fetch=False)
        if len({c.header.sampled_by for c in unfetched.chunks}) == 2:
            break
    assert len({c.header.sampled_by for c in unfetched.chunks}) == 2
    pids = _replica_pids(APP)
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    _wait_for_two_replicas(APP)
    assert not set(pids) & set(_replica_pids(APP))
    got = unfetched.trajectory
    want = client.rollout(*request, seed=seed).trajectory  # sampled again by the new replicas
    torch.testing.assert_close(got.latents, want.latents, atol=0, rtol=0)
    torch.testing.assert_close(got.log_probs, want.log_probs, atol=0, rtol=0)
    assert torch.equal(got.images, want.images)


def _cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def test_backpressure_gives_503_with_a_message(cluster):
    """The single-replica app: a burst of 12 one-chunk requests gets 503s (the replica holds two chunks and
    its queue one more), the rest succeed."""
    def call(i: int) -> httpx.Response:
        body = {"prompts": [f"burst {i}"], "group_size": 4, "seed": i, "sampling": {"num_steps": 8, "sde_window_range": [0, 5]}}
        return _post(cluster.replace(APP, SINGLE_APP), body)

    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(call, range(12)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 1, codes
    rejected = next(r for r in responses if r.status_code == 503).json()
    assert rejected["error"] == "overloaded" and "retry" in rejected["message"]


def test_without_retries_a_lost_chunk_is_a_json_503(cluster):
    """The single-replica app, whose chunks are not re-run: the requests whose chunks that replica holds when
    it is killed get a JSON 503 naming the cause, none a 500. Each request is one chunk (group_size =
    ingress.chunk_size) and there are as many as the replica takes at once (max_ongoing_requests 2), so
    every chunk is on the replica when it dies; the kill waits until the replica's CPU time shows it
    computing one. The app is deleted without waiting for Serve to restart the replica."""
    from ray import serve

    url = cluster.replace(APP, SINGLE_APP)
    try:
        (pid,) = _replica_pids(SINGLE_APP)
        # 80 steps: a chunk computes for several times the CPU time the threshold below waits for, which an
        # idle replica takes far longer to spend than a request takes to reach it.
        bodies = [{"prompts": [f"a lost cat {i}"], "group_size": 4, "seed": i, "sampling": {"num_steps": 80}}
                  for i in range(2)]
        busy_from = _cpu_seconds(pid)
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(_post, url, body) for body in bodies]
            deadline = time.monotonic() + 60
            while _cpu_seconds(pid) - busy_from < 0.2:  # the replica is computing a chunk
                assert time.monotonic() < deadline and not all(f.done() for f in futures), "no chunk reached the replica"
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            responses = [f.result() for f in futures]
        codes = [r.status_code for r in responses]
        # A request whose chunk had not reached the replica yet runs on the restarted one (200).
        assert set(codes) <= {200, 503} and 503 in codes, [r.text[:300] for r in responses]
        for response in responses:
            if response.status_code == 503:
                body = response.json()
                assert body["error"] == "ReplicaUnavailableError" and "retry" in body["message"], body
    finally:
        serve.delete(SINGLE_APP)


def test_error_bodies_carry_the_typed_cause_without_internals(cluster):
    missing = _post(cluster, _body(1, policy_version=999999))
    assert missing.status_code == 409
    body = missing.json()
    assert body == {"error": "PolicyVersionError", "field": "",
                    "message": "policy version 999999 does not exist; available: 0 (base)"}
    malformed = httpx.post(f"{cluster}/v1/rollouts", content=b'{"prompts": ["a"', timeout=60,
                           headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["field"] == "body", malformed.text
    for field, value in (("policy_version", True), ("policy_version", "7"), ("group_size", 2.0)):
        response = _post(cluster, {"prompts": ["a"], "group_size": 2, field: value})
        assert response.status_code == 422 and response.json()["field"] == field, (field, value, response.text)
    for sampling, field in (({"guidance_scale": 1e308}, "sampling.guidance_scale"),
                            ({"num_steps": "7"}, "sampling.num_steps")):
        response = _post(cluster, {"prompts": ["a"], "group_size": 2, "sampling": sampling})
        assert response.status_code == 422 and response.json()["field"] == field, response.text
    surrogate = httpx.post(f"{cluster}/v1/rollouts", timeout=60, headers={"content-type": "application/json"},
                           content=json.dumps({"prompts": ["a \ud800 circle"], "group_size": 2}).encode())
    assert surrogate.status_code == 422 and surrogate.json()["field"] == "prompts[0]", surrogate.text
    infinite = httpx.post(f"{cluster}/v1/rollouts", timeout=60, headers={"content-type": "application/json"},
                          content=b'{"prompts": ["a"], "group_size": 2, "sampling": {"noise_level": Infinity}}')
    assert infinite.status_code == 422 and infinite.json()["field"] == "sampling.noise_level", infinite.text
    spec = httpx.get(f"{cluster}/openapi.json", timeout=10).json()
    documented = spec["paths"]["/v1/rollouts"]["post"]["responses"]
    assert {"400", "409", "413", "422", "503"} <= set(documented)


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    import psutil

    return [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _grpc_status(port: int, token: str | None) -> grpc.StatusCode:
    """The status of an empty call over loopback to the method Serve replicas serve each other
    (the one that unpickles its request), with or without the cluster's token."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
        metadata = [("authorization", f"Bearer {token}")] if token else []
        try:
            call(b"", metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_nothing_beyond_loopback_serves_a_client_without_the_token(cluster):
    import psutil

    # Every process of this cluster: ray.init started them under this test process.
    pids = {psutil.Process().pid, *(p.pid for p in psutil.Process().children(recursive=True))}
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    exposed = [(ip, port, pid) for ip, port, pid in _listening(pids) if ip not in loopback]
    # Serve's replicas start their inter-deployment gRPC server on [::]; nothing else listens beyond loopback.
    titles = {pid: psutil.Process(pid).cmdline()[0] for _, _, pid in exposed}
    assert exposed and all(t.startswith("ray::ServeReplica:") for t in titles.values()), titles
    for _, port, pid in exposed:
        assert _grpc_status(port, None) == grpc.StatusCode.UNAUTHENTICATED, titles[pid]
        # With the token the same call gets past authentication (and fails on its empty request):
        # the refusal above is the token's, not the request's.
        assert _grpc_status(port, os.environ["RAY_AUTH_TOKEN"]) != grpc.StatusCode.UNAUTHENTICATED, titles[pid]
