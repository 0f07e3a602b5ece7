"""The one retry policy: how many calls, how long between them, and which failures earn another call."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config import IngressConfig
from serve_app.retry import RetryPolicy
from serve_app.rewards import RewardSpec


class Flaky:
    """Fails with the given errors in turn, then answers."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "answer"


NO_WAIT = {"backoff_s": 0.0, "max_backoff_s": 0.0}


def test_waits_double_with_jitter_and_stop_at_the_cap():
    policy = RetryPolicy(attempts=9, backoff_s=1.0, max_backoff_s=4.0)
    for failed, (lo, hi) in enumerate([(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (2.0, 4.0)], start=1):
        waits = [policy.wait_s(failed) for _ in range(200)]
        assert lo <= min(waits) and max(waits) <= hi
        assert max(waits) - min(waits) > 0.25 * (hi - lo)  # jittered, not fixed
    # A wait the failure asks for (Retry-After) stretches the wait, never past the cap.
    assert policy.wait_s(1, asked_s=3.0) >= 3.0 and policy.wait_s(1, asked_s=60.0) <= 4.0


def test_only_retryable_failures_are_retried_and_within_the_attempts():
    policy = RetryPolicy(attempts=3, **NO_WAIT)
    heard = []
    flaky = Flaky(ConnectionError("1"), ConnectionError("2"))
    assert policy.call(flaky, retryable=lambda e: isinstance(e, ConnectionError),
                       on_retry=lambda e, n: heard.append((str(e), n))) == "answer"
    assert flaky.calls == 3 and heard == [("1", 1), ("2", 2)]
    # One failure too many: the last one is raised, after exactly `attempts` calls.
    flaky = Flaky(ConnectionError("1"), ConnectionError("2"), ConnectionError("3"))
    with pytest.raises(ConnectionError, match="3"):
        policy.call(flaky, retryable=lambda e: True)
    assert flaky.calls == 3
    # A failure the caller does not call retryable is raised at once.
    flaky = Flaky(ValueError("bad request"))
    with pytest.raises(ValueError):
        policy.call(flaky, retryable=lambda e: isinstance(e, ConnectionError))
    assert flaky.calls == 1


def test_the_async_call_follows_the_same_rules():
    policy = RetryPolicy(attempts=2, **NO_WAIT)
    flaky = Flaky(TimeoutError())

    async def call() -> str:
        return flaky()

    assert asyncio.run(policy.call_async(call, retryable=lambda e: True)) == "answer" and flaky.calls == 2
    flaky = Flaky(TimeoutError(), TimeoutError())
    with pytest.raises(TimeoutError):
        asyncio.run(policy.call_async(call, retryable=lambda e: True))
    assert flaky.calls == 2


def test_a_policy_that_cannot_be_is_refused():
    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match=r"backoff_s \(2.0\) must be <= max_backoff_s \(1.0\)"):
        RetryPolicy(backoff_s=2.0, max_backoff_s=1.0)


@pytest.mark.parametrize(("model", "data", "message"), [
    (IngressConfig, {"chunk_retries": 0}, "chunk_retries is renamed: chunk_retry: {attempts: chunk_retries + 1}"),
    (RewardSpec, {"name": "brightness", "retries": 1}, "retries is renamed: retry: {attempts: retries + 1}"),
    (RewardSpec, {"name": "brightness", "retry_backoff_s": 0.1}, "retry_backoff_s is renamed: retry: {backoff_s"),
])
def test_the_keys_of_the_former_retry_settings_name_their_replacement(model, data, message):
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("+", r"\+")):
        model.model_validate(data)
