"""The HTTP API on a real cluster, through Serve's HTTP proxy: the binary answer bitwise what a handle caller
gets, versions published over HTTP into Ray's object store (weights.transport: object_store) and served, the
token read from the file the config names, and a client that disconnects mid-rollout leaving no object
behind in the object store.

On the session's single-node cluster on 127.0.0.1 (tests/conftest.py), the app deployed for this module and
deleted at its end.
"""

import re
import time

import httpx
import pytest
import torch

from serve_app.http_client import HttpRolloutClient
from tests.http_server import assert_same_batch

pytestmark = pytest.mark.cluster

APP = "flowgrpo-http"
TOKEN = "cluster-http-test-token"
# 128 px: a chunk's transitions (48 kB a sample) live in the object store, not inline with their reference.
OVERRIDES = [f"app_name={APP}", "sampling.height=128", "sampling.width=128", "sampling.num_steps=12",
             "sampling.sde_window_range=[0,4]", "ingress.chunk_size=4", "replica.num_cpus=0.2",
             "replica.autoscaling.max_replicas=1", "weights.transport=object_store"]


@pytest.fixture(scope="module")
def url(ray_cluster, tmp_path_factory):
    from ray import serve

    from serve_app.app import AppArgs, build_app

    token_file = tmp_path_factory.mktemp("token") / "api_token"
    token_file.write_text(f"{TOKEN}\n")
    serve.run(build_app(AppArgs(overrides=[*OVERRIDES, f"ingress.api_token_file={token_file}"])), name=APP,
              route_prefix=f"/{APP}")
    yield f"{ray_cluster.url}/{APP}"
    serve.delete(APP)


def test_the_binary_answer_through_serves_proxy_is_what_the_handle_gives(url):
    from serve_app.client import RolloutClient

    by_handle = RolloutClient(APP).rollout(["a cat", "a dog"], 4, seed=5, return_images=True)
    over_http = HttpRolloutClient(url, TOKEN).rollout(["a cat", "a dog"], 4, seed=5, return_images=True)
    assert_same_batch(over_http, by_handle)
    assert torch.equal(over_http.images, by_handle.images)
    assert over_http.transitions.latents.shape[1:] == (3, 256, 16)


def test_a_version_published_over_http_goes_to_the_object_store_and_is_served(url):
    client = HttpRolloutClient(url, TOKEN)
    g = torch.Generator().manual_seed(3)
    lora = {"proj_out.lora_A.weight": torch.randn(2, 32, generator=g) * 0.3,
            "proj_out.lora_B.weight": torch.randn(16, 2, generator=g) * 0.3}
    version, weights_hash = client.publish(lora, kind="lora", lora={"rank": 2, "alpha": 2.0, "target_modules": ["proj_out"]})
    batch = client.rollout(["a cat"], 2, seed=1, policy_version=version)
    assert (batch.policy_version, batch.header.weights_hash) == (version, weights_hash)
    assert client.versions().latest == version
    assert httpx.get(f"{url}/v1/weights", timeout=30).status_code == 401  # the token file's token guards it
    assert httpx.get(f"{url}/healthz", timeout=30).status_code == 200


def _objects() -> int:
    from ray._private.internal_api import memory_summary

    return int(re.search(r"(\d+) objects", memory_summary(stats_only=True)).group(1))


def _back_to(before: int) -> int:
    """The object count once it is back to `before` (or after a minute, whatever it is then)."""
    deadline = time.monotonic() + 60
    while (now := _objects()) > before and time.monotonic() < deadline:
        time.sleep(0.5)
    return now


BODY = {"prompts": ["a cat", "a dog", "a bird"], "group_size": 8, "seed": 2, "return_trajectory": True,
        "return_images": True}
HEADERS = {"Authorization": f"Bearer {TOKEN}", "Accept": "application/vnd.flowgrpo.trajectory+safetensors"}


def test_a_client_that_disconnects_leaves_no_objects(url):
    client = HttpRolloutClient(url, TOKEN)
    client.rollout(["warm"], 4, seed=0)  # the replica has run once: its state is built
    before = _objects()
    # Gone while the replicas sample: the request is cancelled, its chunks' objects freed.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/rollouts", json=BODY, headers=HEADERS, timeout=httpx.Timeout(60, read=0.5))
    assert _back_to(before) <= before
    # Gone after the first bytes of the answer (a 2 MB body): nothing is kept for it either.
    with httpx.stream("POST", f"{url}/v1/rollouts", json=BODY, headers=HEADERS, timeout=120) as answer:
        assert answer.status_code == 200
        next(answer.iter_raw(1024))
    assert _back_to(before) <= before
    # The service serves the next request as before.
    assert client.rollout(["a cat"], 2, seed=3).transitions.latents.shape[0] == 2
