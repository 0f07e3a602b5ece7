"""The HTTP API (serve_app.serving.http_api) served on loopback in this process, over an app in Serve's
local testing mode: real HTTP, the routes the ingress serves, no cluster. The service it calls is the
ingress itself, reached by its handle (the methods the routes call are handle methods). And the comparison
of a batch that came over HTTP with one a handle caller got."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch
import uvicorn

from serve_app.serving.http_api import build_http_api
from serve_app.local_ray import free_loopback_port


class HandleService:
    """HttpService over an ingress handle: each call is the handle call of the same name."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def rollout(self, request):
        return await self.handle.rollout.remote(request)

    async def publish_weights(self, body):
        return await self.handle.publish_weights.remote(body)

    async def weight_versions(self):
        return await self.handle.weight_versions.remote()

    async def weight_version(self, version):
        return await self.handle.weight_version.remote(version)


@contextlib.contextmanager
def serve_http(handle, *, token: str | None = None, max_upload_bytes: int = 2**30) -> Iterator[str]:
    """The API over `handle` on 127.0.0.1 while the block runs; yields its URL."""
    api = build_http_api(HandleService(handle), token=token, max_upload_bytes=max_upload_bytes)
    port = free_loopback_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, name="http-api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the HTTP API did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def assert_same_trajectory(got, want) -> None:
    for name in ("latents", "log_probs", "sigmas", "step_indices", "seeds", "embed_row", "prompt_index", "sample_index"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("prompt_embeds", "negative_embeds"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            for part in ("embeds", "mask", "pooled", "image_latents", "image_shapes"):
                x, y = getattr(a, part), getattr(b, part)
                assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and torch.equal(x, y))), part
    assert got.sampling == want.sampling
    assert (got.policy_version, got.weights_hash) == (want.policy_version, want.weights_hash)


def assert_same_batch(got, want) -> None:
    assert_same_trajectory(got.transitions, want.transitions)
    assert got.rewards.keys() == want.rewards.keys()
    assert all(torch.equal(got.rewards[k], want.rewards[k]) for k in want.rewards)
    assert torch.equal(got.advantages, want.advantages)
    assert (got.prompts, got.group_size, got.policy_version, got.dropped_groups) == \
        (want.prompts, want.group_size, want.policy_version, want.dropped_groups)
    assert got.metrics.keys() == want.metrics.keys()
    untimed = [k for k in want.metrics if not k.endswith("seconds")]
    assert {k: got.metrics[k] for k in untimed} == {k: want.metrics[k] for k in untimed}
