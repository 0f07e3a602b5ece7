"""RolloutClient's retry policy without a cluster: a rollout lost with a replica (or its node) is sent
again, the same request, a bounded number of times; an error that is the request's own never is.

A scripted handle stands in for the ingress's DeploymentHandle: each call pops the next outcome (an
exception to raise or a value to return) and records the request it was sent.
"""

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.exceptions import ReplicaUnavailableError as ServeReplicaUnavailableError

from serve_app.client import RolloutClient, lost_with_a_replica
from serve_app.errors import InvalidRequestError, PolicyVersionError, ReplicaUnavailableError
from serve_app.retry import RetryPolicy


class _Batch(str):
    """A batch as the handle answers it, its tensors still where they were made: `fetch` brings them, or
    raises `lost` (their node died after the rollout returned)."""

    def __new__(cls, name: str, lost: BaseException | None = None):
        batch = super().__new__(cls, name)
        batch.lost = lost
        batch.fetched = False
        return batch

    def fetch(self):
        if self.lost is not None:
            raise self.lost
        self.fetched = True
        return self

    async def fetch_async(self):
        return self.fetch()


class _Response:
    def __init__(self, outcome):
        self.outcome = _Batch(outcome) if type(outcome) is str else outcome

    def result(self, timeout_s=None):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def __await__(self):
        return self._resolve().__await__()

    async def _resolve(self):
        return self.result()


class _ScriptedHandle:
    def __init__(self, *outcomes):
        self.outcomes = list(outcomes)
        self.requests = []
        self.rollout = self  # handle.rollout.remote(request)

    def remote(self, request):
        self.requests.append(request)
        return _Response(self.outcomes.pop(0))


def _remote(cause: Exception) -> Exception:
    """What the caller of a remote call sees when the callee raised `cause`."""
    return RayTaskError("rollout", "Traceback (remote)", cause).as_instanceof_cause()


LOST = [
    pytest.param(ActorDiedError(), id="actor-died"),
    pytest.param(ActorUnavailableError("its node is gone", None), id="actor-unavailable"),
    pytest.param(ServeReplicaUnavailableError("DiffusionReplica#abc"), id="serve-replica-unavailable"),
    pytest.param(_remote(ReplicaUnavailableError("the replica running a chunk died 1 times")), id="ingress-503"),
    pytest.param(_remote(ActorDiedError()), id="aggregator-died-under-the-ingress"),
]
NOT_LOST = [
    pytest.param(_remote(InvalidRequestError("must be a multiple of 16", "sampling.height")), id="invalid-422"),
    pytest.param(_remote(PolicyVersionError("policy version 9 does not exist")), id="version-409"),
    pytest.param(BackPressureError(num_queued_requests=9, max_queued_requests=8), id="overloaded"),
    pytest.param(TimeoutError("no answer in 5 s"), id="timeout"),
    pytest.param(_remote(RuntimeError("a bug")), id="internal"),
]


def no_wait(attempts: int) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, backoff_s=0.0, max_backoff_s=0.0)


@pytest.mark.parametrize("error", LOST)
def test_a_lost_rollout_is_sent_again_once_with_the_same_request(error):
    handle = _ScriptedHandle(error, "the batch")
    client = RolloutClient(handle=handle, retry=no_wait(2))
    assert lost_with_a_replica(error)
    assert client.rollout(["a red circle", "two cats"], 4, sampling={"num_steps": 4}, policy_version=3, seed=11) == "the batch"
    first, second = handle.requests
    # The very same request: same prompts, seed and pinned version, so a seeded rollout comes back identical.
    assert second == first and (first.seed, first.policy_version, first.group_size) == (11, 3, 4)
    assert client.lost_rollouts == 1


@pytest.mark.parametrize("error", NOT_LOST)
def test_an_error_of_the_request_or_the_load_is_never_retried(error):
    handle = _ScriptedHandle(error, "a batch that must not be asked for")
    client = RolloutClient(handle=handle, retry=no_wait(2))
    assert not lost_with_a_replica(error)
    with pytest.raises(type(error)):
        client.rollout(["a red circle"], 2, seed=1)
    assert len(handle.requests) == 1 and client.lost_rollouts == 0


def test_retries_are_bounded_and_the_last_loss_is_raised():
    first, second = ActorDiedError(), _remote(ReplicaUnavailableError("died again"))
    handle = _ScriptedHandle(first, second, "a third attempt that must not happen")
    client = RolloutClient(handle=handle, retry=no_wait(2))  # two attempts, as by default
    with pytest.raises(ReplicaUnavailableError) as info:
        client.rollout(["a"], 2, seed=5)
    assert info.value is second and len(handle.requests) == 2 and client.lost_rollouts == 1


def test_one_attempt_sends_once_and_more_attempts_send_more():
    handle = _ScriptedHandle(ActorDiedError())
    with pytest.raises(ActorDiedError):
        RolloutClient(handle=handle, retry=no_wait(1)).rollout(["a"], 2, seed=5)
    assert len(handle.requests) == 1
    handle = _ScriptedHandle(ActorDiedError(), ActorDiedError(), "third time")
    client = RolloutClient(handle=handle, retry=no_wait(3))
    assert client.rollout(["a"], 2, seed=5) == "third time"
    assert len(handle.requests) == 3 and client.lost_rollouts == 2
    with pytest.raises(ValueError, match="attempts"):
        RolloutClient(handle=handle, retry=RetryPolicy(attempts=0))


def test_the_async_rollout_follows_the_same_policy():
    handle = _ScriptedHandle(ActorUnavailableError("node gone", None), "the batch")
    client = RolloutClient(handle=handle, retry=no_wait(2))
    assert asyncio.run(client.rollout_async(["a"], 2, policy_version=1, seed=7)) == "the batch"
    assert handle.requests[0] == handle.requests[1] and client.lost_rollouts == 1
    handle = _ScriptedHandle(_remote(PolicyVersionError("policy version 1 does not exist")), "never")
    with pytest.raises(PolicyVersionError):
        asyncio.run(RolloutClient(handle=handle, retry=no_wait(2)).rollout_async(["a"], 2, policy_version=1))
    assert len(handle.requests) == 1


def test_a_batch_whose_tensors_were_lost_with_their_node_is_asked_for_again():
    from ray.exceptions import ObjectLostError

    lost = ObjectLostError("6e1f", "owner", "lost with node 10.0.0.7")
    handle = _ScriptedHandle(_Batch("the first batch", lost=lost), "the batch")
    client = RolloutClient(handle=handle, retry=no_wait(2))
    batch = client.rollout(["a"], 2, seed=5, policy_version=1)
    assert batch == "the batch" and batch.fetched and client.lost_rollouts == 1
    assert handle.requests[0] == handle.requests[1]
    # Without fetching (an evaluation's images only), the batch comes back as it is.
    unfetched = RolloutClient(handle=_ScriptedHandle("a batch"), retry=no_wait(1)).rollout(["a"], 2, fetch=False)
    assert not unfetched.fetched
