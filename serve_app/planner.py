"""The ingress's logic: validate a rollout request, tokenize it, give every sample its seed, and cut
the work into chunks for the replicas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch
from pydantic import ValidationError

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError, RequestTooLargeError
from serve_app.flowgrpo.seeding import derive_sample_seed, draw_window_start, fresh_request_seed
from serve_app.policies.base import TextProcessor
from serve_app.schemas import RolloutChunk, RolloutRequest, SamplingParams


@dataclass(frozen=True)
class RolloutPlan:
    """What the aggregator needs to check and assemble the answer."""

    request_id: str
    prompts: list[str]
    group_size: int
    request_seed: int
    chunks: list[RolloutChunk]


class RolloutPlanner:
    def __init__(self, text_processor: TextProcessor, limits: IngressConfig, default_sampling: SamplingParams) -> None:
        self.text_processor = text_processor
        self.limits = limits
        self.default_sampling = default_sampling

    def sampling_for(self, request: RolloutRequest) -> SamplingParams:
        """The config's sampling defaults, overridden by the fields the request set."""
        merged = {**self.default_sampling.model_dump(), **request.sampling.model_dump(exclude_unset=True)}
        try:
            return SamplingParams.model_validate(merged)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise InvalidRequestError(first["msg"], ".".join(["sampling", *map(str, first["loc"])])) from None

    def validate(self, request: RolloutRequest) -> None:
        """Bounds from the config; raises InvalidRequestError / RequestTooLargeError naming the field."""
        limits = self.limits
        if len(request.prompts) > limits.max_prompts:
            raise RequestTooLargeError(f"at most {limits.max_prompts} prompts per request; got {len(request.prompts)}", "prompts")
        for i, prompt in enumerate(request.prompts):
            if not isinstance(prompt, str) or not prompt.strip():
                raise InvalidRequestError("must be a non-empty string", f"prompts[{i}]")
            if len(prompt) > limits.max_prompt_chars:
                raise InvalidRequestError(
                    f"at most {limits.max_prompt_chars} characters; got {len(prompt)}", f"prompts[{i}]"
                )
        if request.group_size > limits.max_group_size:
            raise InvalidRequestError(f"must be between 1 and {limits.max_group_size}; got {request.group_size}", "group_size")
        total = len(request.prompts) * request.group_size
        if total > limits.max_samples:
            raise RequestTooLargeError(
                f"prompts x group_size = {total} samples exceeds the limit of {limits.max_samples}", "group_size"
            )

    def plan(self, request: RolloutRequest) -> RolloutPlan:
        self.validate(request)
        sampling = self.sampling_for(request)
        request_seed = request.seed if request.seed is not None else sampling.seed
        if request_seed is None:
            request_seed = fresh_request_seed()
        sampling = sampling.model_copy(update={"seed": request_seed})
        prompt_tokens = self.text_processor.tokenize(request.prompts)
        negative = (
            self.text_processor.tokenize([sampling.negative_prompt])[0] if sampling.guidance_scale > 1.0 else None
        )
        window_start = (
            None if sampling.sde_window_size is None else draw_window_start(request_seed, sampling.sde_window_range)
        )
        request_id = uuid.uuid4().hex[:12]

        # Samples in AABB order (a group is contiguous), then cut into chunks of chunk_size.
        prompt_index = torch.arange(len(request.prompts)).repeat_interleave(request.group_size)
        sample_index = torch.arange(request.group_size).repeat(len(request.prompts))
        seeds = torch.tensor(
            [derive_sample_seed(request_seed, int(p), int(s)) for p, s in zip(prompt_index, sample_index)],
            dtype=torch.long,
        )
        chunks = []
        for start in range(0, len(seeds), self.limits.chunk_size):
            part = slice(start, start + self.limits.chunk_size)
            distinct, slot = torch.unique(prompt_index[part], return_inverse=True)
            chunks.append(
                RolloutChunk(
                    request_id=request_id,
                    sampling=sampling,
                    prompts=[prompt_tokens[int(p)] for p in distinct],
                    negative_prompt=negative,
                    prompt_slot=slot,
                    prompt_index=prompt_index[part].clone(),
                    sample_index=sample_index[part].clone(),
                    seeds=seeds[part].clone(),
                    window_start=window_start,
                    policy_version=request.policy_version,
                )
            )
        return RolloutPlan(request_id, list(request.prompts), request.group_size, request_seed, chunks)
