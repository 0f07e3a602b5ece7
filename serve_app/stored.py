"""Values that travel by reference: in one process a value is itself; on a Ray cluster it is an
ObjectRef, resolved only where the value is used. The rollout's heavy tensors go from the replica that
made them to the process that uses them with one serialization; the processes between pass references.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# A value, or a Ray ObjectRef of one, or NotSent (annotations name the value's type in comments).
Stored = Any


class NotSentError(LookupError):
    """A value was used that its sender left out (an HTTP answer asked without it)."""


@dataclass(frozen=True)
class NotSent:
    """Stands for a value its sender left out; resolving it raises NotSentError with `message`."""

    message: str


def is_reference(value: Any) -> bool:
    """Whether `value` is a Ray ObjectRef (without importing Ray where none is in use)."""
    return type(value).__module__.startswith("ray") and type(value).__name__ == "ObjectRef"


def resolve(value: Stored) -> Any:
    """The value itself: fetched (and deserialized here) when it is a reference.

    Raises:
        NotSentError: `value` is NotSent.
    """
    if isinstance(value, NotSent):
        raise NotSentError(value.message)
    if is_reference(value):
        import ray

        return ray.get(value)
    return value


async def resolve_async(value: Stored) -> Any:
    """:func:`resolve` without blocking the event loop (inside a deployment)."""
    if isinstance(value, NotSent):
        raise NotSentError(value.message)
    if is_reference(value):
        return await value
    return value
