"""Typed errors that cross the handle boundary (Ray re-raises them as subclasses of these) and map to
HTTP status codes at the ingress."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


class RolloutError(Exception):
    """Base of the service's own errors."""

    http_status = 500

    def __reduce__(self):  # keep the message when Ray pickles the exception across processes
        return (type(self), self.args)


class InvalidRequestError(RolloutError, ValueError):
    """The request is malformed or out of the configured bounds; `field` names the culprit."""

    http_status = 422

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message, field)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    @classmethod
    def from_validation(cls, exc: ValidationError, *, prefix: Sequence[str] = ()) -> InvalidRequestError:
        """The first error of a pydantic ValidationError, its field prefixed with ``prefix``."""
        return cls.from_errors(exc.errors(), prefix=prefix)

    @classmethod
    def from_errors(cls, errors: Sequence[Mapping[str, Any]], *, prefix: Sequence[str] = ()) -> InvalidRequestError:
        """The first of pydantic-shaped error dicts (``loc``, ``msg``, ``input``), e.g. FastAPI's."""
        field, message = describe_errors(errors, prefix=prefix)[0]
        return cls(message, field)


class RequestTooLargeError(InvalidRequestError):
    """More samples than one request may ask for."""

    http_status = 413


class PolicyVersionError(RolloutError):
    """A request pinned to a weights version that does not exist (or is no longer kept)."""

    http_status = 409


class GroupIncompleteError(RolloutError):
    """The aggregator found a group with missing or duplicated samples."""


class WeightMismatchError(RolloutError):
    """The weights a replica holds are not the ones published under the version it was asked for."""


class NumericalError(RolloutError):
    """A replica computed non-finite values from valid inputs; it returns this instead of NaN tensors."""


class ReplicaUnavailableError(RolloutError):
    """A chunk's replica died on every allowed attempt (ingress.chunk_retry)."""

    http_status = 503


class UnauthorizedError(RolloutError):
    """An HTTP request without the bearer token the operator configured (or with another one)."""

    http_status = 401


class PublishingOffError(RolloutError):
    """A weight upload to an app whose operator configured no API token: publishing over HTTP is off."""

    http_status = 403


class WeightsHashMismatchError(RolloutError):
    """An upload whose content hash is not the one its sender said it expects (nothing is stored)."""

    http_status = 409


class OverloadedError(RolloutError):
    """The service is at capacity (Serve's back-pressure); a later call may pass."""

    http_status = 503


class RewardError(Exception):
    """A reward raised or returned unusable values; names the reward and the prompt it scored."""

    def __init__(self, reward_name: str, prompt: str | None, detail: str) -> None:
        self.reward_name = reward_name
        self.prompt = prompt
        self.detail = detail
        super().__init__(f"reward {reward_name!r} failed on prompt {prompt!r}: {detail}")

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # Ray ships exceptions between processes by pickling; the default reduce would call
        # __init__ with the formatted message only.
        return (type(self), (self.reward_name, self.prompt, self.detail))


class AppNotDeployedError(RolloutError):
    """The rollout app is not running on the Ray cluster this process is connected to."""


def validation_errors(exc: ValidationError, *, prefix: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(dotted field, message) for each error of a pydantic ValidationError (see describe_errors)."""
    return describe_errors(exc.errors(), prefix=prefix)


def describe_errors(errors: Sequence[Mapping[str, Any]], *, prefix: Sequence[str] = ()) -> list[tuple[str, str]]:
    """(dotted field, message) for each pydantic-shaped error: the one translation of pydantic's
    errors for configs, handle requests and HTTP bodies.

    The message ends with the offending value when it is a scalar (a whole section would be too long
    to help); model-level validators report at ``prefix`` and say the values they compared.
    """
    found = []
    for error in errors:
        field = ".".join(str(part) for part in (*prefix, *error["loc"]))
        message = error["msg"].removeprefix("Value error, ")
        value = error.get("input")
        if error["loc"] and (value is None or isinstance(value, (str, int, float, bool))):
            message += f" (got {value!r})"
        found.append((field or "(root)", message))
    return found


def http_error(exc: BaseException) -> tuple[int, dict[str, str]]:
    """(HTTP status, JSON body {error, field, message}) for an exception raised serving a request.

    Ray re-raises a remote exception as RayTaskError(<cause>), whose text carries the remote
    traceback (actor ids, paths, ANSI colours): the body is built from the typed cause alone; what
    is not one of the service's own errors becomes a bare 500 (the trace belongs in the log).
    """
    from ray.exceptions import RayTaskError
    from ray.serve.exceptions import BackPressureError

    cause = exc.cause if isinstance(exc, RayTaskError) and exc.cause is not None else exc
    if isinstance(cause, (BackPressureError, OverloadedError)):
        return 503, _body("overloaded", "the rollout replicas are at capacity, retry later")
    if isinstance(cause, InvalidRequestError):
        return cause.http_status, _body("invalid_request", cause.message, cause.field)
    if isinstance(cause, RolloutError):
        return cause.http_status, _body(type(cause).__name__, str(cause))
    if isinstance(cause, RewardError):
        # Fail closed: a reward that failed after its retries fails the request, naming reward, prompt and
        # cause. 502: an upstream the service depends on (a reward model or server) answered badly.
        return 502, _body("reward_failed", str(cause))
    return 500, _body("internal", "the service failed to serve this request; the server log has the trace")


def _body(kind: str, message: str, field: str = "") -> dict[str, str]:
    return {"error": kind, "field": field, "message": message}


# The error kinds of an HTTP answer that are one of the service's own types, by the body's "error".
_KINDS: dict[str, type[RolloutError]] = {cls.__name__: cls for cls in (
    PolicyVersionError, GroupIncompleteError, WeightMismatchError, NumericalError, ReplicaUnavailableError,
    UnauthorizedError, PublishingOffError, WeightsHashMismatchError,
)}


class HttpStatusError(RolloutError):
    """An HTTP answer with an error status that is none of the service's typed errors (a proxy's, a 500)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.http_status = status
        self.message = message

    def __str__(self) -> str:
        return f"HTTP {self.http_status}: {self.message}"


def error_from_http(status: int, body: Any) -> RolloutError:
    """The typed error an HTTP error answer stands for (the inverse of :func:`http_error`): a client over
    HTTP catches the same exceptions as one by handle. `body`: the parsed JSON, or anything else."""
    if isinstance(body, Mapping) and isinstance(body.get("message"), str):
        kind, message, field = body.get("error"), body["message"], str(body.get("field") or "")
        if kind == "invalid_request":
            return (RequestTooLargeError if status == 413 else InvalidRequestError)(message, field)
        if kind == "overloaded":
            return OverloadedError(message)
        if kind in _KINDS:
            return _KINDS[kind](message)
        return HttpStatusError(status, message)
    return HttpStatusError(status, str(body)[:500])
