"""One retry policy for every call that may be made again: the trainer's rollout request lost with a
replica, the ingress's chunk whose replica died, a reward call, and a remote reward's HTTP POST.

The policy says how often and how long to wait; the caller says which failures are worth another call
(``retryable``), since only it knows which errors a second call can cure.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

T = TypeVar("T")
OnRetry = Callable[[BaseException, int], None]


class RetryPolicy(BaseModel):
    """Up to ``attempts`` calls in all. Before call k + 1 it waits ``backoff_s * 2**(k - 1)`` seconds,
    capped at ``max_backoff_s``, of which half is fixed and half drawn at random, so callers that
    failed together do not come back in lockstep; a wait the failure itself asks for (an HTTP
    ``Retry-After``, carried as ``retry_after_s``) stretches it, up to the cap."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attempts: int = Field(1, ge=1, description="Calls in all, the first one included; 1 = no retry.")
    backoff_s: float = Field(0.2, ge=0, allow_inf_nan=False,
                             description="Seconds before the second call; doubles before each further one.")
    max_backoff_s: float = Field(8.0, ge=0, allow_inf_nan=False, description="The longest wait between calls, seconds.")

    @model_validator(mode="after")
    def _check(self) -> RetryPolicy:
        if self.backoff_s > self.max_backoff_s:
            raise ValueError(f"backoff_s ({self.backoff_s}) must be <= max_backoff_s ({self.max_backoff_s})")
        return self

    def wait_s(self, failed_calls: int, *, asked_s: float | None = None) -> float:
        """Seconds to wait after `failed_calls` calls failed, before the next one."""
        base = min(self.max_backoff_s, self.backoff_s * 2 ** (failed_calls - 1))
        wait = base / 2 + random.uniform(0, base / 2)
        if asked_s is not None:
            wait = max(wait, min(asked_s, self.max_backoff_s))
        return wait

    def _next_wait(self, exc: BaseException, failed_calls: int, retryable: Callable[[BaseException], bool],
                   on_retry: OnRetry | None) -> float | None:
        """The wait before another call, or None when `exc` ends the calls (the caller re-raises it)."""
        if failed_calls >= self.attempts or not retryable(exc):
            return None
        if on_retry is not None:
            on_retry(exc, failed_calls)
        return self.wait_s(failed_calls, asked_s=getattr(exc, "retry_after_s", None))

    def call(self, fn: Callable[[], T], *, retryable: Callable[[BaseException], bool],
             on_retry: OnRetry | None = None) -> T:
        """``fn()``, called again after a failure that `retryable` accepts while attempts remain; the last
        failure (or the first that is not retryable) is raised. ``on_retry(exc, failed_calls)`` hears of
        each failure that is retried."""
        for failed_calls in itertools.count(1):
            try:
                return fn()
            except Exception as exc:
                wait = self._next_wait(exc, failed_calls, retryable, on_retry)
                if wait is None:
                    raise
            time.sleep(wait)
        raise AssertionError("unreachable")

    async def call_async(self, fn: Callable[[], Awaitable[T]], *, retryable: Callable[[BaseException], bool],
                         on_retry: OnRetry | None = None) -> T:
        """:meth:`call` for a coroutine function; waits without blocking the event loop."""
        for failed_calls in itertools.count(1):
            try:
                return await fn()
            except Exception as exc:
                wait = self._next_wait(exc, failed_calls, retryable, on_retry)
                if wait is None:
                    raise
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")


def always(_: BaseException) -> bool:
    """Every failure is worth another call (rewards: a model or server that failed once may not again)."""
    return True


def refuse_renamed_keys(data: Any, renamed: Mapping[str, str]) -> Any:
    """Raise ValueError naming the replacement when `data` (a section's raw mapping) holds a key of the
    release before RetryPolicy; `renamed` maps each old key to what to write instead."""
    if isinstance(data, Mapping):
        found = [key for key in renamed if key in data]
        if found:
            raise ValueError("; ".join(f"{key} is renamed: {renamed[key]}" for key in found))
    return data
