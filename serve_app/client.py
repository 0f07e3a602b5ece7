"""RolloutClient: how a trainer asks the deployed app for rollouts, by DeploymentHandle."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from serve_app.errors import AppNotDeployedError
from serve_app.schemas import RolloutRequest, SamplingOverrides, SamplingParams, TrajectoryBatch

Sampling = SamplingParams | SamplingOverrides | dict

DEPLOY_HINT = (
    "start it with `serve deploy serve_config.yaml` (after `ray start --head`, with RAY_AUTH_MODE=token, "
    "RAY_AUTH_TOKEN and RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 set as in the README) or `serve run serve_config.yaml`"
)


class RolloutClient:
    """Finds the app's ingress handle by app name and sends RolloutRequests.

    `rollout` blocks (call it from a training loop); `rollout_async` is for asyncio code. Both
    return a TrajectoryBatch of tensors; errors arrive as the service's typed exceptions.
    """

    def __init__(self, app_name: str = "flowgrpo", *, handle: Any | None = None) -> None:
        self.app_name = app_name
        self._handle = handle

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

    @staticmethod
    def _request(
        prompts: Sequence[str],
        group_size: int,
        sampling: Sampling | None,
        policy_version: int | None,
        seed: int | None,
    ) -> RolloutRequest:
        """Full SamplingParams travel whole (the trainer replays exactly what it asked for); overrides and
        dicts carry only the fields they set, and the app's configured sampling fills the rest."""
        fields: dict[str, Any] = {"prompts": list(prompts), "group_size": group_size, "policy_version": policy_version, "seed": seed}
        if isinstance(sampling, SamplingParams):
            fields["sampling"] = sampling.model_dump()
        elif isinstance(sampling, SamplingOverrides):
            fields["sampling"] = sampling.model_dump(exclude_unset=True)
        elif sampling is not None:
            fields["sampling"] = sampling
        return RolloutRequest.model_validate(fields)

    def rollout(
        self,
        prompts: Sequence[str],
        group_size: int,
        sampling: Sampling | None = None,
        policy_version: int | None = None,
        seed: int | None = None,
        *,
        timeout_s: float | None = None,
    ) -> TrajectoryBatch:
        request = self._request(prompts, group_size, sampling, policy_version, seed)
        return self.handle.rollout.remote(request).result(timeout_s=timeout_s)

    async def rollout_async(
        self,
        prompts: Sequence[str],
        group_size: int,
        sampling: Sampling | None = None,
        policy_version: int | None = None,
        seed: int | None = None,
    ) -> TrajectoryBatch:
        request = self._request(prompts, group_size, sampling, policy_version, seed)
        return await self.handle.rollout.remote(request)
