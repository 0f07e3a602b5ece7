"""What only a real Ray cluster shows: actors, HTTP, @serve.batch, autoscaling, and the HTTP API
through Serve's proxy (the binary answer bitwise what a handle caller gets, clients that disconnect leaving no
objects).

The session's single-node cluster on 127.0.0.1 (tests/conftest.py: ray_cluster), the app deployed for
this module and deleted at its end. Requests are bounded in number and time.
"""

import base64
import io
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import httpx
import pytest
import torch

from serve_app.http_client import HttpRolloutClient
from tests.http_server import assert_same_batch
from tests.object_store import back_to, objects
from tests.replicas import running_replicas, wait_for_running_replicas

pytestmark = pytest.mark.cluster

OVERRIDES = [
    "sampling.num_steps=4",
    "sampling.sde_window_range=[0,2]",
    "ingress.chunk_size=4",
    "ingress.max_prompts=8",
    "ingress.max_samples=32",
    "replica.num_cpus=0.2",
    "replica.autoscaling.min_replicas=1",
    "replica.autoscaling.max_replicas=2",
    "replica.autoscaling.target_ongoing_requests=1",
    "replica.autoscaling.upscale_delay_s=0.5",
    "replica.autoscaling.downscale_delay_s=3",
    "replica.autoscaling.look_back_period_s=1",
    "replica.max_ongoing_requests=2",
    "replica.max_batch_size=2",
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> list[str]:
    """The main app's weight folder, this module's own (a FLOWGRPO_TEST_HOME kept between runs already
    holds the versions an earlier run published)."""
    return [f"replica.weights_dir={tmp_path_factory.mktemp('weights')}"]


@pytest.fixture(scope="module")
def cluster(ray_cluster, weights):
    """The module's app on the session's shared cluster (tests/conftest.py, autoscaling metrics pushed every
    0.5 s), deleted when this module ends; returns the base URL. Videos over HTTP:
    tests/deployments/test_app_video.py; back-pressure: tests/deployments/test_reliability.py."""
    from ray import serve

    from serve_app.app import AppArgs, build_app

    serve.run(build_app(AppArgs(overrides=OVERRIDES + weights)), name="flowgrpo", route_prefix="/")
    yield ray_cluster.url
    serve.delete("flowgrpo")


def test_whole_graph_by_handle(cluster):
    from serve_app.client import RolloutClient

    batch = RolloutClient("flowgrpo").rollout(["a cat", "two red circles"], group_size=4, seed=9)
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.sample_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert t.log_probs.shape == (8, 2) and torch.isfinite(t.log_probs).all()
    assert t.images.shape == (8, 3, 32, 32) and t.images.dtype == torch.uint8
    assert len(t.prompt_embeds) == 2  # once per prompt, not per sample
    assert batch.advantages.shape == (8,) and torch.isfinite(batch.advantages).all()


def test_http_matches_handle_seeds(cluster):
    from serve_app.client import RolloutClient

    by_handle = RolloutClient("flowgrpo").rollout(["a cat", "two red circles"], group_size=4, seed=9)
    body = {"prompts": ["a cat", "two red circles"], "group_size": 4, "seed": 9, "return_images": True}
    response = httpx.post(f"{cluster}/v1/rollouts", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()
    samples = answer["samples"]
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(p, i) for p in range(2) for i in range(4)]
    assert [s["seed"] for s in samples] == by_handle.trajectory.seeds.tolist()
    got = torch.tensor([s["log_probs"] for s in samples])
    torch.testing.assert_close(got, by_handle.trajectory.log_probs, atol=1e-5, rtol=0)
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(samples[0]["image_png_base64"])))
    assert image.size == (32, 32)
    assert "reward_mean" in answer["metrics"]


def test_health_and_openapi(cluster):
    assert httpx.get(f"{cluster}/healthz", timeout=10).json() == {"status": "ok"}
    spec = httpx.get(f"{cluster}/openapi.json", timeout=10).json()
    assert "/v1/rollouts" in spec["paths"]
    assert httpx.get(f"{cluster}/docs", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"prompts": [], "group_size": 2}, 422, "prompts"),
        ({"prompts": ["a"], "group_size": 0}, 422, "group_size"),
        ({"prompts": [""], "group_size": 2}, 422, "prompts[0]"),
        ({"prompts": ["a"], "group_size": 2, "sampling": {"noise_level": -1}}, 422, "sampling.noise_level"),
        ({"prompts": ["a"], "group_size": 2, "bogus": 1}, 422, "bogus"),
        ({"prompts": ["a"] * 9, "group_size": 2}, 413, "prompts"),
        ({"prompts": ["a"] * 8, "group_size": 5}, 413, "group_size"),
        ({"prompts": ["a"], "group_size": 2, "sampling": {"height": 36}}, 422, "sampling.height"),
    ],
)
def test_bad_input_gets_a_status_code_and_the_field(cluster, body, status, field):
    response = httpx.post(f"{cluster}/v1/rollouts", json=body, timeout=60)
    assert response.status_code == status, response.text
    payload = response.json()
    assert payload["field"] == field and payload["message"]


def test_64_concurrent_http_requests_with_mixed_prompt_lengths(cluster):
    def call(i: int) -> int:
        prompt = "a cat " + "and a very long tail " * (i % 9)
        body = {"prompts": [prompt], "group_size": 2, "seed": i, "sampling": {"num_steps": 2, "sde_window_range": [0, 1], "sde_window_size": 1}}
        return httpx.post(f"{cluster}/v1/rollouts", json=body, timeout=300).status_code

    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(call, range(64)))
    assert codes == [200] * 64


def test_app_not_deployed_says_how_to_deploy(cluster):
    from serve_app.client import RolloutClient
    from serve_app.errors import AppNotDeployedError

    with pytest.raises(AppNotDeployedError, match="serve deploy serve_config.yaml"):
        RolloutClient("no-such-app").rollout(["a cat"], 2)


def test_autoscaling_up_under_load_and_back_down_and_new_replicas_serve_the_pushed_version(cluster, weights):
    from serve_app.client import RolloutClient
    from serve_app.config import load_config
    from serve_app.weights import LoraSpec, open_weight_store

    client = RolloutClient("flowgrpo")
    wait_for_running_replicas("flowgrpo", 1, timeout_s=90)  # earlier tests' load may have scaled it up
    # Push version 1 while only one replica runs: the one autoscaling adds must fetch it itself.
    store = open_weight_store(load_config("diffusion_rollout", OVERRIDES + weights))
    g = torch.Generator().manual_seed(0)
    store.publish(1, {"proj_out.lora_A.weight": torch.randn(2, 32, generator=g) * 0.3,
                      "proj_out.lora_B.weight": torch.randn(16, 2, generator=g) * 0.3},
                  kind="lora", lora=LoraSpec(rank=2, alpha=2.0, target_modules=["proj_out"]))
    sampling = {"num_steps": 8, "sde_window_range": [0, 5]}
    reference = client.rollout(["a pinned cat"], 4, sampling, policy_version=1, seed=5).trajectory
    assert reference.policy_version == 1
    # Six requests stay in flight until the second replica runs: the load never pauses between rounds, where
    # a pause longer than the downscale delay could stop a replica that a loaded machine is still starting.
    def request(i: int):
        return client.rollout(["a pinned cat"], 4, sampling, 1, 5) if i % 6 == 0 else client.rollout([f"load {i}"], 4, sampling, 1)

    deadline = time.monotonic() + 120
    peak, pinned, sent = 1, [], 6
    with ThreadPoolExecutor(6) as pool:
        in_flight = {pool.submit(request, i): i for i in range(sent)}
        while in_flight:
            done, _ = wait(in_flight, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in done:
                batch = future.result()
                if in_flight.pop(future) % 6 == 0:
                    pinned.append(batch.trajectory)
                if peak < 2 and time.monotonic() < deadline:
                    in_flight[pool.submit(request, sent)] = sent
                    sent += 1
            if peak < 2:  # serve.status() costs the driver a third of a second of CPU: asked until the peak is seen
                peak = max(peak, running_replicas("flowgrpo"))
    assert peak == 2 and pinned
    # Keep asking after the scale-up, so requests reach the new replica too; these batches' tensors stay
    # where the replicas made them (fetch=False) until after the scale-down.
    # On a loaded machine the new replica may take its first requests a few rounds later: rounds of 8 go out
    # until both replicas sampled some (bounded in time).
    unfetched, sampled_by, deadline = [], set(), time.monotonic() + 60
    with ThreadPoolExecutor(4) as pool:
        while len(sampled_by) < 2 and time.monotonic() < deadline:
            more = list(pool.map(lambda _: client.rollout(["a pinned cat"], 4, sampling, 1, 5, fetch=False), range(8)))
            unfetched += more
            sampled_by |= {chunk.header.sampled_by for batch in more for chunk in batch.chunks}
    assert len(sampled_by) == 2, sampled_by  # both replicas sampled some of them
    for t in pinned:
        assert t.policy_version == 1
        torch.testing.assert_close(t.latents, reference.latents, atol=1e-5, rtol=0)
    assert wait_for_running_replicas("flowgrpo", 1, timeout_s=90) == 1
    # The tensors a replica made outlive it: the ingress that asked for them owns them, not the replica.
    deadline = time.monotonic() + 60
    while len(_live_replica_ids()) > 1 and time.monotonic() < deadline:  # the stopping one shuts down
        time.sleep(0.5)
    gone = sampled_by - _live_replica_ids()
    assert len(gone) == 1, (sampled_by, _live_replica_ids())
    for batch in unfetched:
        t = batch.trajectory
        assert t.policy_version == 1
        torch.testing.assert_close(t.latents, reference.latents, atol=1e-5, rtol=0)
        assert torch.equal(t.images, reference.images)


def _live_replica_ids() -> set[str]:
    """The Serve ids of this app's live DiffusionReplica actors (named SERVE_REPLICA::<app>#<deployment>#<id>)."""
    import ray

    prefix = "SERVE_REPLICA::flowgrpo#DiffusionReplica#"
    return {e["name"][len(prefix):] for e in ray.util.list_named_actors(all_namespaces=True)
            if e["name"].startswith(prefix)}


# --- the HTTP API through Serve's proxy --------------------------------------------------------

# 128 px: a chunk's transitions (48 kB a sample) live in the object store, not inline with their reference.
LARGE = {"height": 128, "width": 128}


def test_the_binary_answer_through_serves_proxy_is_what_the_handle_gives(cluster):
    from serve_app.client import RolloutClient

    by_handle = RolloutClient("flowgrpo").rollout(["a cat", "a dog"], 4, LARGE, seed=5, return_images=True)
    over_http = HttpRolloutClient(cluster).rollout(["a cat", "a dog"], 4, LARGE, seed=5, return_images=True)
    assert_same_batch(over_http, by_handle)
    assert torch.equal(over_http.images, by_handle.images)
    assert over_http.transitions.latents.shape[1:] == (3, 256, 16)


def test_a_client_that_disconnects_leaves_no_objects(cluster):
    body = {"prompts": ["a cat", "a dog", "a bird"], "group_size": 8, "seed": 2, "sampling": LARGE,
            "return_trajectory": True, "return_images": True}
    headers = {"Accept": "application/vnd.flowgrpo.trajectory+safetensors"}
    client = HttpRolloutClient(cluster)
    client.rollout(["warm"], 4, LARGE, seed=0)  # the replicas have run once: their state is built
    before = objects()
    # Gone while the replicas sample: the request is cancelled, its chunks' objects freed.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster}/v1/rollouts", json=body, headers=headers, timeout=httpx.Timeout(60, read=0.5))
    assert back_to(before) <= before
    # Gone after the first bytes of the answer (a 1.3 MB body): nothing is kept for it either.
    with httpx.stream("POST", f"{cluster}/v1/rollouts", json=body, headers=headers, timeout=120) as answer:
        assert answer.status_code == 200
        next(answer.iter_raw(1024))
    assert back_to(before) <= before
    # The service serves the next request as before.
    assert client.rollout(["a cat"], 2, LARGE, seed=3).transitions.latents.shape[0] == 2
