"""Typed errors that cross the handle boundary (Ray re-raises them as subclasses of these) and map to
HTTP status codes at the ingress."""

from __future__ import annotations


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


class RequestTooLargeError(InvalidRequestError):
    """More samples than one request may ask for."""

    http_status = 413


class PolicyVersionError(RolloutError):
    """A request pinned to a weights version that does not exist (or is no longer kept)."""

    http_status = 409


class GroupIncompleteError(RolloutError):
    """The aggregator found a group with missing or duplicated samples."""


class AppNotDeployedError(RolloutError):
    """The rollout app is not running on the Ray cluster this process is connected to."""
