"""RolloutClient: how a trainer asks the deployed app for rollouts, by DeploymentHandle."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from serve_app.errors import AppNotDeployedError, ReplicaUnavailableError
from serve_app.retry import RetryPolicy
from serve_app.api import RolloutRequest
from serve_app.config.sampling import SamplingOverrides, SamplingParams
from serve_app.schemas import TrajectoryBatch

Sampling = SamplingParams | SamplingOverrides | dict

logger = logging.getLogger(__name__)

# Serve takes about a second to notice a dead replica and route around it.
DEFAULT_RETRY = RetryPolicy(attempts=2, backoff_s=1.0, max_backoff_s=1.0)

DEPLOY_HINT = (
    "start it with `serve deploy serve_config.yaml` (after `ray start --head`, with RAY_AUTH_MODE=token, "
    "RAY_AUTH_TOKEN and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set as in the README) or `serve run serve_config.yaml`"
)


def lost_with_a_replica(exc: BaseException) -> bool:
    """Whether a rollout failed because a process serving it died (an actor, a replica, their node),
    not because of the request: the one kind of failure that sending the same request again can cure.

    Ray re-raises a remote error as a RayTaskError that is also an instance of its cause's type where it
    can build one, so both the error and its `cause` are looked at.
    """
    from ray.exceptions import ObjectLostError, RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError as ServeReplicaUnavailableError

    # RayActorError covers ActorDiedError and ActorUnavailableError (the actor's node is gone or
    # unreachable); Serve's own ReplicaUnavailableError is its router's word for the same; ours (HTTP 503)
    # is the ingress's, after its chunk re-runs were used up; ObjectLostError is a sampled chunk's tensors
    # lost with the node that held them. A 4xx-type error (InvalidRequestError, PolicyVersionError) is the
    # request's fault and is never among them.
    lost = (RayActorError, ServeReplicaUnavailableError, ReplicaUnavailableError, ObjectLostError)
    return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)


class RolloutClient:
    """Finds the app's ingress handle by app name and sends RolloutRequests.

    `rollout` blocks (call it from a training loop); `rollout_async` is for asyncio code. Both
    return a TrajectoryBatch of tensors; errors arrive as the service's typed exceptions.

    A rollout lost with a process that served it (a replica or its node died, see
    :func:`lost_with_a_replica`) is sent again, the same request, as `retry` allows (by default twice in
    all, a second or so apart, for Serve to notice the death). A seeded request pinned to a version comes
    back identical (a sample's noise depends only on its seed); an unseeded one gets fresh seeds, an
    unpinned one the version that is newest when it is re-planned, stamped as such. `timeout_s` bounds
    each attempt. Nothing else is retried.
    """

    def __init__(self, app_name: str = "flowgrpo", *, handle: Any | None = None,
                 retry: RetryPolicy = DEFAULT_RETRY) -> None:
        self.app_name = app_name
        self._handle = handle
        self.retry = retry
        self.lost_rollouts = 0  # attempts lost with a replica and sent again, over this client's life

    @property
    def handle(self) -> Any:
        if self._handle is None:
            from ray import serve

            try:
                self._handle = serve.get_app_handle(self.app_name)
            except Exception as exc:  # Serve raises RayServeException / ValueError depending on state
                raise AppNotDeployedError(
                    f"rollout app {self.app_name!r} is not deployed on this Ray cluster ({exc}); {DEPLOY_HINT}"
                ) from None
        return self._handle

    def rollout(
        self,
        prompts: Sequence[str],
        group_size: int,
        sampling: Sampling | None = None,
        policy_version: int | None = None,
        seed: int | None = None,
        *,
        images: Sequence[Any] | None = None,
        timeout_s: float | None = None,
        fetch: bool = True,
        return_images: bool = False,
    ) -> TrajectoryBatch:
        """The batch of one request. With `fetch` (the trainer's case) its transitions are fetched into
        this process before it returns, inside the retry: a batch whose tensors were lost with their node is
        asked for again; `return_images` fetches the images the same way. Without, nothing heavy is fetched
        until used (an evaluation reads images only).
        `images`: an image-conditioned family's input images, per prompt a uint8 tensor [3, H, W] or a list."""
        request = RolloutRequest.of(prompts, group_size, sampling, policy_version, seed, images=images)

        def attempt() -> TrajectoryBatch:
            batch = self.handle.rollout.remote(request).result(timeout_s=timeout_s)
            if fetch:
                batch.fetch()
            if return_images:
                _ = batch.images
            return batch

        return self.retry.call(attempt, retryable=lost_with_a_replica, on_retry=self._lost)

    async def rollout_async(
        self,
        prompts: Sequence[str],
        group_size: int,
        sampling: Sampling | None = None,
        policy_version: int | None = None,
        seed: int | None = None,
        fetch: bool = True,
        *,
        images: Sequence[Any] | None = None,
        return_images: bool = False,
    ) -> TrajectoryBatch:
        """:meth:`rollout` for asyncio code."""
        request = RolloutRequest.of(prompts, group_size, sampling, policy_version, seed, images=images)

        async def attempt() -> TrajectoryBatch:
            batch = await self.handle.rollout.remote(request)
            if fetch:
                await batch.fetch_async()
            if return_images:
                await batch.fetch_images_async()
            return batch

        return await self.retry.call_async(attempt, retryable=lost_with_a_replica, on_retry=self._lost)

    def _lost(self, exc: BaseException, failed_calls: int) -> None:
        self.lost_rollouts += 1
        logger.warning("rollout lost with a replica (attempt %d of %d), sending the same request again: %s",
                       failed_calls, self.retry.attempts, type(exc).__name__)
