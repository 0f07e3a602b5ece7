"""HttpRolloutClient: a trainer's way to the service over HTTP alone, from any cluster or none.

It gives what RolloutClient gives by handle - a TrajectoryBatch of tensors, the service's typed errors - and
publishes weight versions. It needs torch, pydantic and the standard library; it imports neither Ray nor
the serving code (tests/test_http_client.py runs it with Ray unimportable).

    client = HttpRolloutClient("http://127.0.0.1:8000", token=os.environ["FLOWGRPO_API_TOKEN"])
    batch = client.rollout(["a red circle"], group_size=8, seed=0)      # one round trip, binary answer
    batch.transitions.latents                                           # [8, K+1, ...] the window's latents
    version, weights_hash = client.publish(adapter_state, kind="lora", lora={"rank": 8, "alpha": 16.0,
                                                                           "target_modules": ["to_q", "to_v"]})
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from serve_app.errors import RolloutError, error_from_http
from serve_app.media import png_base64
from serve_app.retry import RetryPolicy
from serve_app.api import PublishedVersion, RolloutRequest, VersionInfo, VersionList
from serve_app.config.sampling import SamplingOverrides, SamplingParams
from serve_app.schemas import TrajectoryBatch
from serve_app.wire import TRAJECTORY_MEDIA_TYPE, WEIGHTS_MEDIA_TYPE, content_hash, decode_batch, encode_weights
from serve_app.wire.weights import Kind, lora_fields

logger = logging.getLogger(__name__)

# A connection lost, or a 503 (overloaded, or a chunk's replica died on every re-run): worth another call.
DEFAULT_RETRY = RetryPolicy(attempts=3, backoff_s=1.0, max_backoff_s=4.0)
Sampling = SamplingParams | SamplingOverrides | dict


class ConnectionLostError(ConnectionError):
    """The connection to the service broke before its answer was whole (the one failure of the transport
    itself that another call can cure)."""


def retryable(exc: BaseException) -> bool:
    """A lost connection or a 503; never a request's own error (4xx) or a timeout (the call may still run)."""
    return isinstance(exc, ConnectionLostError) or (isinstance(exc, RolloutError)
                                                    and getattr(exc, "http_status", None) == 503)


class HttpRolloutClient:
    """The service at `url` (http or https, with or without a route prefix), with the bearer token its
    operator configured. Thread-safe: each thread keeps its own keep-alive connection.

    Each call is sent again after a lost connection or a 503, as `retry` allows; nothing else is retried. A
    seeded rollout pinned to a version comes back identical when sent again. `timeout_s` bounds each wait
    on the socket (connecting, and each read of the answer).
    """

    def __init__(self, url: str, token: str | None = None, *, retry: RetryPolicy = DEFAULT_RETRY,
                 timeout_s: float | None = 600.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port][/prefix]; got {url!r}")
        self.url = url.rstrip("/")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self._token = token
        self.retry = retry
        self.timeout_s = timeout_s
        self._local = threading.local()
        self.lost_calls = 0  # calls lost (connection or 503) and sent again, over this client's life

    # -- rollouts ----------------------------------------------------------------------------

    def rollout(self, prompts: Sequence[str], group_size: int, sampling: Sampling | None = None,
                policy_version: int | None = None, seed: int | None = None, *,
                images: Sequence[torch.Tensor | Sequence[torch.Tensor]] | None = None, timeout_s: float | None = None,
                fetch: bool = True, return_images: bool = False) -> TrajectoryBatch:
        """The batch of one request, in one round trip: with `fetch` its transitions (what a trainer
        replays), with `return_images` its images; what was not asked for raises NotSentError when used.
        `images`: an image-conditioned family's input images, per prompt a uint8 tensor [3, H, W] or a list."""
        request = RolloutRequest.of(prompts, group_size, sampling, policy_version, seed,
                                    images=None if images is None else _png_rows(images),
                                    return_images=return_images, return_trajectory=fetch)
        body = json.dumps(request.model_dump(mode="json", exclude_unset=True)).encode()
        headers = {"Content-Type": "application/json", "Accept": TRAJECTORY_MEDIA_TYPE}
        answer = self._call("POST", "/v1/rollouts", body, headers, timeout_s=timeout_s)
        return decode_batch(answer)

    # -- weight versions ------------------------------------------------------------------------

    def publish(self, tensors: Mapping[str, torch.Tensor], *, kind: Kind = "lora", lora: Any = None,
                timeout_s: float | None = None) -> tuple[int, str]:
        """Publish `tensors` as the next version (`lora`: the adapter's rank, alpha and target_modules, a
        mapping or serve_app.weights.LoraSpec); returns (version, content hash). The hash is computed here
        too and sent: weights changed on the way are refused (409), never stored."""
        spec = lora_fields(lora) if kind == "lora" else None
        on_cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        body = encode_weights(on_cpu, kind=kind, lora=spec, expected_hash=content_hash(on_cpu, spec))
        answer = self._call("POST", "/v1/weights", body, {"Content-Type": WEIGHTS_MEDIA_TYPE}, timeout_s=timeout_s)
        published = PublishedVersion.model_validate_json(bytes(answer))
        return published.policy_version, published.weights_hash

    def versions(self) -> VersionList:
        return VersionList.model_validate_json(bytes(self._call("GET", "/v1/weights")))

    def version(self, version: int) -> VersionInfo:
        """Raises HttpStatusError (404) for a version the service does not keep."""
        return VersionInfo.model_validate_json(bytes(self._call("GET", f"/v1/weights/{version}")))

    def healthz(self) -> bool:
        return json.loads(bytes(self._call("GET", "/healthz"))) == {"status": "ok"}

    # -- transport ----------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: bytes | bytearray | None = None,
              headers: dict[str, str] | None = None, *, timeout_s: float | None = None) -> bytearray:
        """The answer's body (status 2xx), retried as the class says; an error answer raises its typed error."""
        headers = dict(headers or {})
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        return self.retry.call(lambda: self._once(method, path, body, headers, timeout_s), retryable=retryable,
                               on_retry=self._lost)

    def _once(self, method: str, path: str, body: bytes | bytearray | None, headers: dict[str, str],
              timeout_s: float | None) -> bytearray:
        reused = hasattr(self._local, "connection")
        try:
            status, reason, answer, retry_after = self._exchange(method, path, body, headers, timeout_s)
        except http.client.RemoteDisconnected:
            if not reused:
                raise ConnectionLostError(f"{self.url} closed the connection before answering") from None
            # A keep-alive connection the server had closed while idle: the request never arrived there.
            status, reason, answer, retry_after = self._exchange(method, path, body, headers, timeout_s)
        if status >= 400:
            error = error_from_http(status, _json_or_text(answer))
            if retry_after is not None:
                error.retry_after_s = retry_after  # type: ignore[attr-defined]  (RetryPolicy honours it)
            raise error
        return answer

    def _exchange(self, method: str, path: str, body: bytes | bytearray | None, headers: dict[str, str],
                  timeout_s: float | None) -> tuple[int, str, bytearray, float | None]:
        connection = self._connection(timeout_s)
        try:
            connection.request(method, self._prefix + path, body=body, headers=headers)
            response = connection.getresponse()
            answer = _read(response)
        except http.client.RemoteDisconnected:
            self._drop()
            raise
        except TimeoutError:
            self._drop()
            raise
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            self._drop()
            raise ConnectionLostError(f"the connection to {self.url} broke: {type(exc).__name__}: {exc}") from None
        if response.will_close:
            self._drop()
        retry_after = response.getheader("retry-after")
        return response.status, response.reason, answer, float(retry_after) if _number(retry_after) else None

    def _connection(self, timeout_s: float | None) -> http.client.HTTPConnection:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            connection = self._local.connection = kind(self._host, self._port, timeout=timeout)
        connection.timeout = timeout
        if connection.sock is not None:
            connection.sock.settimeout(timeout)
        return connection

    def _drop(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            del self._local.connection

    def _lost(self, exc: BaseException, failed_calls: int) -> None:
        self.lost_calls += 1
        logger.warning("call to %s lost (attempt %d of %d), sending it again: %s", self.url, failed_calls,
                       self.retry.attempts, exc)

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        self._drop()


def _read(response: http.client.HTTPResponse) -> bytearray:
    """The whole body into one writable buffer, read in place when its length is known (the binary answer is
    then decoded without a copy)."""
    length = response.getheader("content-length")
    if length is None or not length.isdigit():
        return bytearray(response.read())
    buffer = bytearray(int(length))
    view, done = memoryview(buffer), 0
    while done < len(buffer):
        got = response.readinto(view[done:])
        if not got:
            raise http.client.IncompleteRead(bytes(view[:done]), len(buffer) - done)
        done += got
    return buffer


def _json_or_text(answer: bytearray) -> Any:
    try:
        return json.loads(bytes(answer))
    except ValueError:
        return bytes(answer[:500]).decode("utf-8", "replace")


def _number(value: str | None) -> bool:
    try:
        return value is not None and float(value) >= 0
    except ValueError:
        return False


def _png_rows(images: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> list[list[str]]:
    """Input images per prompt (a tensor, or a list of them) as the base64 PNGs the JSON body carries."""
    rows = [[row] if isinstance(row, torch.Tensor) else list(row) for row in images]
    return [[png_base64(image.unsqueeze(0))[0] for image in row] for row in rows]
