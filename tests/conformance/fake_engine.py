"""A deliberately imperfect engine: the diffusers engine with its velocities rounded to bf16 during
rollout only (relative error up to 2^-8, what a bf16 kernel's output cast does), while the trainer
replays in fp32. The conformance suite must flag it (its replay ratio is not 1)."""

from __future__ import annotations

from typing import Any

import torch

from serve_app.serving.engine import DiffusersEngine
from serve_app.policies.base import DiffusionPolicy
from serve_app.weights import VersionStore


class Bf16RoundedVelocity:
    """A view of a policy whose `velocity` is rounded to bfloat16; everything else is the policy's own
    (same modules, so weight versions loaded through it are the policy's)."""

    def __init__(self, policy: DiffusionPolicy) -> None:
        self._policy = policy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._policy, name)

    def velocity(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Rounding is elementwise and deterministic, so a sample stays independent of its batch.
        return self._policy.velocity(*args, **kwargs).to(torch.bfloat16).float()


def fake_bf16_engine(policy: DiffusionPolicy, store: VersionStore | None = None) -> DiffusersEngine:
    return DiffusersEngine(Bf16RoundedVelocity(policy), store)  # type: ignore[arg-type]
