"""The HTTP API (FastAPI), built per ingress replica over the service that answers it: rollouts as JSON or as
complete trajectories in the binary format, weight versions published and listed, the SGLang-Diffusion
compatible `POST /rollout/generate`, and the bearer token that guards them. docs/http.md is its manual.

The routes only translate: HTTP in, a call of the service (the TokenizerIngress, or in tests a stand-in
over a local app's handle), HTTP out. Every error is ``{error, field, message}`` (serve_app.errors).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from serve_app.config import IngressConfig
from serve_app.errors import (
    InvalidRequestError,
    PolicyVersionError,
    PublishingOffError,
    RequestTooLargeError,
    http_error,
)
from serve_app.api import ErrorResponse, PublishedVersion, RolloutRequest, RolloutResponse, VersionInfo, VersionList
from serve_app.schemas import TrajectoryBatch
from serve_app.serving.ingress import to_response
from serve_app.serving.sglang import SGLANG_MEDIA_TYPE, SglangRolloutRequest, sglang_answer, sglang_request
from serve_app.wire import TRAJECTORY_MEDIA_TYPE, WEIGHTS_MEDIA_TYPE, encode_batch

logger = logging.getLogger("ray.serve")

OPEN_PATHS = ("/healthz",)  # answered without the token (load balancers and probes carry none)

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "The body is not JSON (field: body)."},
    401: {"model": ErrorResponse, "description": "The operator configured a token and the request lacks it."},
    409: {"model": ErrorResponse, "description": "The pinned policy version does not exist."},
    413: {"model": ErrorResponse, "description": "More samples or work than the app's limits (field named)."},
    422: {"model": ErrorResponse, "description": "A field is invalid (field named, with what is accepted)."},
    502: {"model": ErrorResponse, "description": "A reward failed after its retries (reward, prompt and cause named)."},
    503: {"model": ErrorResponse, "description": "Overloaded, or a chunk's replica died on every retry."},
}
_BINARY = {"schema": {"type": "string", "format": "binary"}}


class BinaryResponse(Response):
    """A body sent as the bytearray it was packed into: Starlette would copy anything but bytes, and Serve
    pickles a replica's messages to its proxy, which a memoryview cannot be."""

    def render(self, content: Any) -> bytes:
        return content


class HttpService(Protocol):
    """What the routes call (TokenizerIngress implements it; its handle methods have the same names)."""

    async def rollout(self, request: RolloutRequest) -> TrajectoryBatch: ...

    async def publish_weights(self, body: bytearray) -> PublishedVersion: ...

    async def weight_versions(self) -> VersionList: ...

    async def weight_version(self, version: int) -> VersionInfo: ...


def api_token(ingress: IngressConfig) -> str | None:
    """The bearer token the operator configured (ingress.api_token_file / api_token_env), or None.

    Raises:
        ValueError: the file or variable is named but missing or empty (a deploy that meant to lock the API
            must not come up open).
    """
    if ingress.api_token_file is not None:
        path = Path(ingress.api_token_file).expanduser()
        if not path.is_file():
            raise ValueError(f"ingress.api_token_file {str(path)!r} does not exist")
        token = path.read_text().strip()
        where = f"ingress.api_token_file {str(path)!r}"
    elif ingress.api_token_env is not None:
        token = os.environ.get(ingress.api_token_env, "").strip()
        where = f"the environment variable {ingress.api_token_env} (ingress.api_token_env)"
    else:
        return None
    if not token:
        raise ValueError(f"{where} holds no token")
    return token


class BearerToken:
    """ASGI middleware: every request but OPEN_PATHS carries `Authorization: Bearer <token>`, or gets a 401.
    A plain ASGI layer (not Starlette's BaseHTTPMiddleware), so a client's disconnect still reaches the route."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or _route_path(scope) in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(status_code=401, headers={"WWW-Authenticate": "Bearer"}, content=ErrorResponse(
            error="UnauthorizedError", field="", message="this API needs `Authorization: Bearer <token>` with the "
            "token its operator configured").model_dump())
        await response(scope, receive, send)

    def _authorized(self, scope: dict) -> bool:
        sent = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(sent, self.expected)


def _route_path(scope: dict) -> str:
    """The path under the app's route prefix (Serve passes the prefix as root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def build_http_api(service: HttpService, *, token: str | None, max_upload_bytes: int) -> FastAPI:
    api = FastAPI(title="flowgrpo-serve", description="FlowGRPO rollouts: groups of images with per-step log-probs, "
                  "rewards and advantages; complete trajectories for any trainer; weight versions. docs/http.md.")
    api.add_exception_handler(RequestValidationError, _invalid_body)
    if token is not None:
        api.add_middleware(BearerToken, token=token)

    @api.post("/v1/rollouts", response_model=RolloutResponse, response_model_exclude_none=True, responses={
        200: {"content": {TRAJECTORY_MEDIA_TYPE: _BINARY},
              "description": f"JSON, or with `Accept: {TRAJECTORY_MEDIA_TYPE}` the binary answer (docs/http.md)."},
        406: {"model": ErrorResponse, "description": "return_trajectory without the binary Accept header."},
        **ERROR_RESPONSES})
    async def rollouts(request: RolloutRequest, http: Request):
        binary = TRAJECTORY_MEDIA_TYPE in http.headers.get("accept", "")
        if request.return_trajectory and not binary:
            return _error(406, "not_acceptable", f"return_trajectory answers in the binary format only: send "
                          f"`Accept: {TRAJECTORY_MEDIA_TYPE}`", "return_trajectory")
        try:
            batch = await service.rollout(request)
        except Exception as exc:
            return _error_response(exc)
        if not binary:
            images = await batch.fetch_images_async() if request.return_images else None
            return to_response(batch, images=images)
        transitions = (await batch.fetch_async()).transitions if request.return_trajectory else None
        images = await batch.fetch_images_async() if request.return_images else None
        # Copying the tensors into the answer is the one pass over them here: off the event loop.
        body = await asyncio.to_thread(encode_batch, batch, transitions=transitions, images=images)
        return BinaryResponse(body, media_type=TRAJECTORY_MEDIA_TYPE)

    @api.post("/v1/weights", response_model=PublishedVersion, openapi_extra={"requestBody": {
        "required": True, "content": {WEIGHTS_MEDIA_TYPE: _BINARY, "application/octet-stream": _BINARY}}},
        responses={403: {"model": ErrorResponse, "description": "No token configured: publishing is off."},
                   409: {"model": ErrorResponse, "description": "The content hash is not the one the upload expects."},
                   **{k: v for k, v in ERROR_RESPONSES.items() if k in (401, 413, 422, 503)}})
    async def publish(http: Request):
        """A weight version (the safetensors layout of docs/http.md), stored as the next version."""
        if token is None:
            return _error_response(PublishingOffError(
                "publishing over HTTP is off: the operator configures a bearer token (ingress.api_token_file or "
                "ingress.api_token_env) to turn it on"))
        try:
            body = await _read_body(http, max_upload_bytes)
            return await service.publish_weights(body)
        except ClientDisconnect:
            logger.warning("a weight upload ended before its body did; nothing was stored")
            return _error(400, "incomplete_body", "the upload ended before its body did; nothing was stored", "body")
        except Exception as exc:
            return _error_response(exc)

    @api.get("/v1/weights", response_model=VersionList, responses={401: ERROR_RESPONSES[401]})
    async def versions():
        return await service.weight_versions()

    @api.get("/v1/weights/{version}", response_model=VersionInfo, responses={
        404: {"model": ErrorResponse, "description": "The store holds no such version."}, 401: ERROR_RESPONSES[401]})
    async def version(version: int):
        try:
            return await service.weight_version(version)
        except PolicyVersionError as exc:
            return _error(404, "PolicyVersionError", str(exc))
        except Exception as exc:
            return _error_response(exc)

    @api.post("/rollout/generate", responses={
        200: {"content": {SGLANG_MEDIA_TYPE: _BINARY},
              "description": "SGLang-Diffusion's answer: a msgpack list, one dict per sample (docs/http.md)."},
        **ERROR_RESPONSES})
    async def sglang_generate(request: SglangRolloutRequest):
        """SGLang-Diffusion's rollout endpoint, for trainers written against it; a field this service cannot
        honour is a 422 naming it."""
        try:
            ours = sglang_request(request)
            batch = await service.rollout(ours)
            await batch.fetch_async(images=True)
            body = await asyncio.to_thread(sglang_answer, request, batch)
        except Exception as exc:
            return _error_response(exc)
        return Response(content=body, media_type=SGLANG_MEDIA_TYPE)

    @api.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    return api


async def _read_body(http: Request, limit: int) -> bytearray:
    """The request body, refused (413) as soon as it passes `limit` bytes rather than after it was all read."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestTooLargeError(f"the body is {declared} bytes, more than weights.max_upload_bytes = {limit}", "body")
    body = bytearray()
    async for part in http.stream():
        body += part
        if len(body) > limit:
            raise RequestTooLargeError(f"the body passes weights.max_upload_bytes = {limit}", "body")
    return body


async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    # FastAPI's errors have pydantic's shape, with "body" in front of the field path; a body that is
    # not JSON reports a character offset there, which means nothing to the caller.
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return _error(400, "malformed_json", f"the body is not valid JSON: {first['msg']}", "body")
    error = InvalidRequestError.from_errors([{**first, "loc": tuple(p for p in first["loc"] if p != "body")}])
    return _error(422, "invalid_request", error.message, error.field)


def _error(status: int, kind: str, message: str, field: str = "") -> JSONResponse:
    return JSONResponse(status_code=status, content=ErrorResponse(error=kind, field=field, message=message).model_dump())


def _error_response(exc: Exception) -> JSONResponse:
    status, body = http_error(exc)
    if status >= 500:
        logger.error("request failed with %d", status, exc_info=exc)
    return JSONResponse(status_code=status, content=body)
