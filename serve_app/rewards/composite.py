"""A weighted sum of rewards, with each component reported and checked."""

from __future__ import annotations

from typing import Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from .registry import RewardFn, build_reward, check_image_batch

ArgValue = Union[bool, int, float, str, list]
TOTAL_KEY = "total"


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


class RewardSpec(BaseModel):
    """One component: a registered name or ``"module:attr"`` path, its weight and factory args."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    weight: float = Field(1.0, allow_inf_nan=False)
    args: dict[str, ArgValue] = Field(default_factory=dict)


def _unique_keys(names: Sequence[str]) -> list[str]:
    # Suffixes must not collide with names given verbatim elsewhere in the list, nor with "total".
    taken = set(names) | {TOTAL_KEY}
    seen: set[str] = set()
    keys: list[str] = []
    for name in names:
        if name not in seen and name != TOTAL_KEY:
            key = name
        else:
            k = 1
            while f"{name}_{k}" in taken:
                k += 1
            key = f"{name}_{k}"
            taken.add(key)
        seen.add(name)
        keys.append(key)
    return keys


class CompositeReward:
    """Builds every component once, then scores batches with all of them.

    ``score`` returns float32 CPU tensors ``[B]``: one per component, keyed by its spec name (the
    attribute of an import path; repeats become ``name_1``, ``name_2``, ...), and ``"total"``, the
    weighted sum.
    """

    def __init__(self, specs: Sequence[RewardSpec | dict]) -> None:
        if not specs:
            raise ValueError("CompositeReward needs at least one RewardSpec")
        self.specs: tuple[RewardSpec, ...] = tuple(
            s if isinstance(s, RewardSpec) else RewardSpec.model_validate(s) for s in specs
        )
        # An import path reports under its attribute name: "pkg.mod:sharpness" -> "sharpness".
        self.keys: tuple[str, ...] = tuple(_unique_keys([s.name.rpartition(":")[2] for s in self.specs]))
        self._fns: tuple[RewardFn, ...] = tuple(build_reward(s.name, **s.args) for s in self.specs)

    def score(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Score a batch; callers pass one prompt group per call so errors name its prompt.

        Raises:
            ValueError: malformed ``images``/``prompts``.
            RewardError: a component raised, or returned a non-[B] or non-finite result.
        """
        check_image_batch(images, prompts)
        batch = images.shape[0]
        prompt = prompts[0] if len(prompts) else None
        out: dict[str, torch.Tensor] = {}
        total = torch.zeros(batch, dtype=torch.float32)
        for key, spec, fn in zip(self.keys, self.specs, self._fns):
            try:
                raw = fn(images, prompts)
            except Exception as e:
                raise RewardError(spec.name, prompt, f"{type(e).__name__}: {e}") from e
            values = self._checked(spec.name, prompt, raw, batch)
            out[key] = values
            total += spec.weight * values
        out[TOTAL_KEY] = total
        return out

    @staticmethod
    def _checked(key: str, prompt: str | None, raw: object, batch: int) -> torch.Tensor:
        try:
            values = torch.as_tensor(raw).detach().to(device="cpu", dtype=torch.float32)
        except Exception as e:
            raise RewardError(key, prompt, f"returned {type(raw).__name__}, not a tensor: {e}") from e
        if values.shape != (batch,):
            raise RewardError(key, prompt, f"returned shape {tuple(values.shape)}, expected ({batch},)")
        bad = (~torch.isfinite(values)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise RewardError(key, prompt, f"returned non-finite value {values[i].item()} at index {i}")
        return values
