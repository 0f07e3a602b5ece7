"""The HTTP API (serve_app.serving.http_api) served on loopback in this process, over an app in Serve's
local testing mode: real HTTP, the routes the ingress serves, no cluster. The service it calls is the
ingress itself, reached by its handle (the methods the routes call are handle methods)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from serve_app.serving.http_api import build_http_api


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_http(handle, *, token: str | None = None, max_upload_bytes: int = 2**30) -> Iterator[str]:
    """The API over `handle` on 127.0.0.1 while the block runs; yields its URL."""
    api = build_http_api(HandleService(handle), token=token, max_upload_bytes=max_upload_bytes)
    port = free_port()
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
