"""A weighted sum of rewards: each component built where its spec places it (this process or its own
RewardServer deployment), retried, checked and reported. Fail closed: an error is never a number."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from typing import Any, Literal, Protocol, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.errors import RewardError
from serve_app.retry import RetryPolicy, always, refuse_renamed_keys

from .registry import RewardFn, build_reward, declares_groupwise, declares_input_images
from .video import check_sample_batch

ArgValue = Union[bool, int, float, str, list, dict]
RuntimeEnvValue = Union[str, list[str], dict[str, str]]
TOTAL_KEY = "total"

# A reward on a RewardServer, seen from the caller: (images, prompts) -> values, awaited.
RemoteReward = Callable[[torch.Tensor, list[str]], Awaitable[Any]]


class RewardServerOptions(BaseModel):
    """Serve options of a reward's own deployment (``placement: deployment``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved per reward replica.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs reserved per reward replica (fractions share a GPU).")
    min_replicas: int = Field(1, ge=1, description="Replicas started (and kept, when autoscaling).")
    max_replicas: int | None = Field(
        None, ge=1, description="Autoscale between min_replicas and this; None runs exactly min_replicas."
    )
    target_ongoing_requests: float = Field(2, gt=0, description="Ongoing calls per replica autoscaling aims for.")
    max_ongoing_requests: int = Field(16, ge=1, description="Calls one replica takes at once; >= max_batch_size.")
    max_batch_size: int = Field(8, ge=1, description="Calls fused into one reward call (@serve.batch).")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="How long a batch waits to fill before it runs.")
    runtime_env: dict[str, RuntimeEnvValue] = Field(
        default_factory=dict,
        description="Ray runtime_env of the reward's replicas (pip, env_vars, ...): a reward whose packages "
        "conflict with the app's runs in its own environment.",
    )

    @model_validator(mode="after")
    def _check(self) -> RewardServerOptions:
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size ({self.max_batch_size})"
            )
        if self.max_replicas is not None and self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})")
        return self


class RewardSpec(BaseModel):
    """One component: a registered name or ``"module:attr"`` path, its weight and factory args, where
    it runs and what a failure does."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(min_length=1)
    weight: float = Field(1.0, allow_inf_nan=False)
    args: dict[str, ArgValue] = Field(default_factory=dict)
    placement: Literal["in_process", "deployment"] = Field(
        "in_process",
        description="in_process: called in the aggregator's threads (light rewards); deployment: its own "
        "RewardServer deployment with `server` options, called by handle with uint8 image tensors.",
    )
    server: RewardServerOptions = Field(
        default_factory=RewardServerOptions, description="The RewardServer's options (placement: deployment)."
    )
    groupwise: bool | None = Field(
        None,
        description="Scores whole groups (ranking, diversity): called once per group when all its samples are in. "
        "None: as the reward declares (register_reward(..., groupwise=True) or a `groupwise` attribute).",
    )
    retry: RetryPolicy = Field(
        default_factory=RetryPolicy, description="Calls after a failure of any kind (the first included) before it "
        "counts; default one call, no retry.",
    )
    timeout_s: float | None = Field(None, gt=0, description="A call slower than this fails (and may be retried).")
    on_error: Literal["fail", "drop_group"] = Field(
        "fail",
        description="After the retries: fail the request with a RewardError (HTTP 502), or drop the group "
        "(reported in TrajectoryBatch.dropped_groups and the metrics).",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed_keys(data, {"retries": "retry: {attempts: retries + 1}",
                                          "retry_backoff_s": "retry: {backoff_s: ...}"})

    @model_validator(mode="after")
    def _check_server(self) -> RewardSpec:
        # Compared with the defaults, not model_fields_set: a dumped config restates every field.
        if self.placement != "deployment" and self.server != RewardServerOptions():
            raise ValueError(f"reward {self.name!r} sets `server` options but placement is {self.placement!r}; "
                             "they apply to placement: deployment only")
        return self


def resolve_groupwise(spec: RewardSpec) -> bool:
    """The spec's ``groupwise``, else what the reward declares.

    Raises:
        ValueError: undeclared in the spec and the reward cannot be looked up in this process (a
            deployment's own runtime_env may hold its module): set ``groupwise`` in the spec.
    """
    if spec.groupwise is not None:
        return spec.groupwise
    try:
        return declares_groupwise(spec.name)
    except ValueError as exc:
        raise ValueError(f"{exc}; a reward whose module only its RewardServer can import needs `groupwise: "
                         "true|false` in its spec") from exc


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


def reward_keys(specs: Sequence[RewardSpec]) -> tuple[str, ...]:
    """The report key of each component: the spec name, an import path's attribute ("pkg.mod:sharpness"
    -> "sharpness"); repeats become name_1, name_2, ..."""
    return tuple(_unique_keys([s.name.rpartition(":")[2] for s in specs]))


class RewardObserver(Protocol):
    """Told about every reward call attempt: the deployments turn this into metrics."""

    def record(self, key: str, outcome: Literal["ok", "retry", "failed"], seconds: float) -> None: ...


class _NoObserver:
    def record(self, key: str, outcome: Literal["ok", "retry", "failed"], seconds: float) -> None:
        pass


def checked_values(name: str, prompt: str | None, raw: object, batch: int) -> torch.Tensor:
    """``raw`` as float32 CPU ``[batch]``, or RewardError (wrong type, shape, or a non-finite value)."""
    try:
        values = torch.as_tensor(raw).detach().to(device="cpu", dtype=torch.float32)
    except Exception as e:
        raise RewardError(name, prompt, f"returned {type(raw).__name__}, not a tensor: {e}") from e
    if values.shape != (batch,):
        raise RewardError(name, prompt, f"returned shape {tuple(values.shape)}, expected ({batch},)")
    bad = (~torch.isfinite(values)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise RewardError(name, prompt, f"returned non-finite value {values[i].item()} at index {i}")
    return values


def _describe(exc: BaseException) -> str:
    # A RayTaskError carries the remote traceback in its text; its typed cause says what went wrong.
    cause = getattr(exc, "cause", None)
    exc = cause if isinstance(cause, BaseException) else exc
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    if isinstance(exc, RewardError):
        return exc.detail
    return f"{type(exc).__name__}: {exc}"


class CompositeReward:
    """Builds every in-process component once, reaches the others through ``servers`` (key -> an
    async call of the component's RewardServer), and scores parts of groups with them.

    Values are float32 CPU tensors ``[B]``, one per component keyed by :func:`reward_keys`;
    :meth:`total` is the weighted sum, reported under ``"total"``.
    """

    def __init__(self, specs: Sequence[RewardSpec | dict], *, servers: Mapping[str, RemoteReward] | None = None) -> None:
        if not specs:
            raise ValueError("CompositeReward needs at least one RewardSpec")
        self.specs: tuple[RewardSpec, ...] = tuple(
            s if isinstance(s, RewardSpec) else RewardSpec.model_validate(s) for s in specs
        )
        self.keys: tuple[str, ...] = reward_keys(self.specs)
        servers = dict(servers or {})
        self._calls: dict[str, RewardFn | RemoteReward] = {}
        self.sees_input_images: dict[str, bool] = {}
        for key, spec in zip(self.keys, self.specs):
            self.sees_input_images[key] = _sees_input_images(spec)
            if spec.placement == "deployment":
                if key not in servers:
                    raise ValueError(f"reward {spec.name!r} is placed on a deployment, but no RewardServer handle "
                                     f"was given for key {key!r} (build the app with serve_app.app.build_graph)")
                self._calls[key] = servers.pop(key)
            else:
                self._calls[key] = build_reward(spec.name, **spec.args)
        if servers:
            raise ValueError(f"RewardServer handles for rewards that are not placed on a deployment: {sorted(servers)}")
        self.groupwise: dict[str, bool] = {k: resolve_groupwise(s) for k, s in zip(self.keys, self.specs)}

    @property
    def needs_input_images(self) -> bool:
        """Whether some component compares samples with their prompts' input images."""
        return any(self.sees_input_images.values())

    @property
    def has_per_sample(self) -> bool:
        return not all(self.groupwise.values())

    @property
    def has_groupwise(self) -> bool:
        return any(self.groupwise.values())

    def total(self, values: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The weighted sum of every component's values."""
        return sum((spec.weight * values[key] for key, spec in zip(self.keys, self.specs)),
                   torch.zeros_like(values[self.keys[0]]))

    def score(self, images: torch.Tensor, prompts: Sequence[str],
              input_images: Sequence[torch.Tensor] = ()) -> dict[str, torch.Tensor]:
        """Score samples in this process through the served path (:meth:`score_part`, each component with its
        retries and timeout): each prompt's samples as one whole group, the per-sample components then the
        groupwise ones. Returns the values per key and ``"total"``. ``input_images``: the prompt's, for the
        components that see them. For callers without an event loop (scripts, evaluations).

        Raises:
            ValueError: malformed ``images``/``prompts``, or a component placed on a deployment.
            RewardError: a component failed after its retries (here a group that fails is an error, whatever its
                ``on_error``: there is no batch to drop it from).
        """
        check_sample_batch(images, prompts)
        for spec in self.specs:
            if spec.placement != "in_process":
                raise ValueError(f"reward {spec.name!r} runs on a deployment; score it with score_part")
        groups: dict[str, list[int]] = {}
        for row, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(row)

        async def each_group() -> dict[str, torch.Tensor]:
            out = {key: torch.zeros(len(prompts), dtype=torch.float32) for key in self.keys}
            for prompt, rows in groups.items():
                index = torch.tensor(rows)
                for whole_group in (False, True):
                    values, failure = await self.score_part(images[index], prompt, whole_group=whole_group,
                                                            input_images=input_images)
                    if failure is not None:
                        raise failure
                    for key, value in values.items():
                        out[key][index] = value.to(torch.float32)
            return out

        out = asyncio.run(each_group())
        out[TOTAL_KEY] = self.total(out)
        return out

    async def score_part(
        self,
        images: torch.Tensor,
        prompt: str,
        *,
        whole_group: bool,
        input_images: Sequence[torch.Tensor] = (),
        executor: Executor | None = None,
        observer: RewardObserver | None = None,
    ) -> tuple[dict[str, torch.Tensor], RewardError | None]:
        """Score samples of one prompt's group with the components that apply: the per-sample ones
        (any part of a group), or the groupwise ones (``whole_group``: all its samples, in order).
        ``input_images``: the prompt's, for the components that see them.

        Components run concurrently, each with its retries and timeout. Returns (values per key,
        None), or ({}, the RewardError) when a component with ``on_error: drop_group`` failed.

        Raises:
            RewardError: a component with ``on_error: fail`` failed after its retries.
        """
        check_sample_batch(images, [prompt] * images.shape[0])
        observer = observer or _NoObserver()
        mine = [(k, s) for k, s in zip(self.keys, self.specs) if self.groupwise[k] == whole_group]
        outcomes = await asyncio.gather(
            *(self._call(key, spec, images, prompt, input_images, executor, observer) for key, spec in mine),
            return_exceptions=True
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        fatal = [e for e, (_, s) in zip(outcomes, mine) if isinstance(e, BaseException) and s.on_error == "fail"]
        if fatal or any(not isinstance(e, RewardError) for e in failures):
            raise (fatal or failures)[0]
        if failures:
            return {}, failures[0]  # type: ignore[return-value]
        return {key: values for (key, _), values in zip(mine, outcomes)}, None  # type: ignore[misc]

    async def _call(self, key: str, spec: RewardSpec, images: torch.Tensor, prompt: str,
                    input_images: Sequence[torch.Tensor], executor: Executor | None,
                    observer: RewardObserver) -> torch.Tensor:
        """One component on one part, with its retry policy; fails closed with a RewardError."""
        prompts = [prompt] * images.shape[0]
        last_call_s = 0.0

        async def attempt() -> torch.Tensor:
            nonlocal last_call_s
            started = time.perf_counter()
            try:
                raw = await asyncio.wait_for(self._invoke(key, images, prompts, input_images, executor), spec.timeout_s)
                return checked_values(spec.name, prompt, raw, images.shape[0])
            finally:
                last_call_s = time.perf_counter() - started

        try:
            values = await spec.retry.call_async(attempt, retryable=always,
                                                 on_retry=lambda exc, failed: observer.record(key, "retry", last_call_s))
        except Exception as exc:
            observer.record(key, "failed", last_call_s)
            detail = _describe(exc)
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                detail = f"timed out after {spec.timeout_s} s"
            attempts = spec.retry.attempts
            raise RewardError(spec.name, prompt, detail + (f" (after {attempts} attempts)" if attempts > 1 else "")
                              ) from exc
        observer.record(key, "ok", last_call_s)
        return values

    def _bound(self, key: str, images: torch.Tensor, input_images: Sequence[torch.Tensor]) -> Callable[..., Any]:
        """The component's call, given the prompt's input images (one list per sample) if it sees them."""
        call = self._calls[key]
        if not self.sees_input_images[key]:
            return call
        return functools.partial(call, input_images=[list(input_images)] * images.shape[0])

    def _invoke(self, key: str, images: torch.Tensor, prompts: list[str], input_images: Sequence[torch.Tensor],
                executor: Executor | None) -> Awaitable[Any]:
        call = self._bound(key, images, input_images)
        if self.specs[self.keys.index(key)].placement == "deployment":
            return call(images, prompts)  # type: ignore[return-value]
        # In-process rewards are plain blocking functions: a thread keeps the event loop serving. A
        # timed-out call keeps its thread until it returns (Python cannot stop a thread).
        return asyncio.get_running_loop().run_in_executor(executor, call, images, prompts)


def _sees_input_images(spec: RewardSpec) -> bool:
    """Whether the component is called with its prompts' input images; such a component runs in process."""
    try:
        sees = declares_input_images(spec.name)
    except ValueError:  # a module only its own RewardServer's runtime_env can import
        return False
    if sees and spec.placement != "in_process":
        raise ValueError(f"reward {spec.name!r} compares samples with their input images, which stay in the app: "
                         "it runs with placement: in_process")
    return sees


def score_fused(fn: RewardFn, calls: Sequence[tuple[torch.Tensor, list[str]]], *, groupwise: bool) -> list[Any]:
    """Score several calls of one reward (a RewardServer's batch): a result or the exception per call.

    Per-sample rewards run once per image size on the calls' images stacked (what batching buys);
    a fused call that fails is re-run call by call, so an error belongs to the call that caused it.
    A groupwise reward is called once per call (each call is one whole group).
    """
    results: list[Any] = [None] * len(calls)

    def single(i: int) -> None:
        images, prompts = calls[i]
        try:
            results[i] = fn(images, prompts)
        except Exception as exc:
            results[i] = exc

    if groupwise:
        for i in range(len(calls)):
            single(i)
        return results
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, (images, _) in enumerate(calls):
        by_shape.setdefault(tuple(images.shape[1:]), []).append(i)
    for members in by_shape.values():
        if len(members) == 1:
            single(members[0])
            continue
        sizes = [calls[i][0].shape[0] for i in members]
        try:
            raw = fn(torch.cat([calls[i][0] for i in members]), [p for i in members for p in calls[i][1]])
            values = torch.as_tensor(raw).detach().cpu()
            if values.shape != (sum(sizes),):
                raise ValueError(f"fused call returned shape {tuple(values.shape)}")
        except Exception:
            for i in members:
                single(i)
            continue
        for i, part in zip(members, values.split(sizes)):
            results[i] = part.clone()
    return results
