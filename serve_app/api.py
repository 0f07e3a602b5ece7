"""The HTTP and handle API's request and answer types: what a client sends (RolloutRequest), the JSON answers
(RolloutResponse, PublishedVersion, VersionInfo, VersionList) and every error's body (ErrorResponse).
The binary answers are serve_app.wire's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
)

from serve_app.config.sampling import SamplingOverrides, SamplingParams


def _input_image(value: Any) -> Any:
    """An input image as sent: kept as it is, decoded and checked by the ingress (which names the field)."""
    if isinstance(value, (str, torch.Tensor)):
        return value
    raise ValueError(f"an input image is a base64 PNG (HTTP) or a uint8 tensor [3, H, W] (handle); got "
                     f"{type(value).__name__}")


# Base64 PNG over HTTP, a uint8 tensor [3, H, W] by handle; the OpenAPI shows the HTTP form.
InputImage = Annotated[
    Any,
    PlainValidator(_input_image),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png",
                    "description": "A PNG, base64 (standard alphabet); by handle a uint8 tensor [3, H, W]."}),
]


class RolloutRequest(BaseModel):
    """A rollout request as the ingress receives it (HTTP JSON or handle)."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[StrictStr] = Field(..., min_length=1, description="Prompts; each becomes one group.")
    images: list[list[InputImage]] | None = Field(
        None,
        description="Input images of image-conditioned families (qwen_image_edit: exactly one per prompt), one list "
        "per prompt in prompt order: base64 PNGs over HTTP, uint8 tensors [3, H, W] by handle (where a prompt's "
        "single image may stand without its list). Every sample of a prompt's group is conditioned on them; "
        "text-to-image families take none.",
    )
    group_size: StrictInt = Field(..., ge=1, description="Samples per prompt.")
    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides, description="Sampling settings to change; the app's config fills the rest."
    )
    seed: StrictInt | None = Field(None, ge=0, lt=2**63, description="Overrides sampling.seed when given.")
    policy_version: StrictInt | None = Field(None, ge=0, description="Pin to a weights version; None = the latest.")
    return_images: StrictBool = Field(
        False, description="HTTP only: include each sample's image (JSON: a PNG, base64, or for videos an H.264 MP4; "
        "binary answer: the uint8 tensor)."
    )
    return_trajectory: StrictBool = Field(
        False, description="HTTP only: answer with each sample's whole trajectory (window latents, schedule, "
        "conditioning) in the binary format (Accept: application/vnd.flowgrpo.trajectory+safetensors; docs/http.md).",
    )

    @classmethod
    def of(cls, prompts: Sequence[str], group_size: int, sampling: SamplingParams | BaseModel | dict | None = None,
           policy_version: int | None = None, seed: int | None = None, *, images: Sequence[Any] | None = None,
           **flags: bool) -> RolloutRequest:
        """A request from a client's arguments. Full SamplingParams travel whole (the trainer replays exactly
        what it asked for); overrides and dicts carry only the fields they set, and the app's configured
        sampling fills the rest. `flags`: return_images, return_trajectory."""
        fields: dict[str, Any] = {"prompts": list(prompts), "group_size": group_size, "policy_version": policy_version,
                                  "seed": seed, "images": None if images is None else list(images), **flags}
        if isinstance(sampling, SamplingParams):
            fields["sampling"] = sampling.model_dump()
        elif isinstance(sampling, BaseModel):  # SamplingOverrides
            fields["sampling"] = sampling.model_dump(exclude_unset=True)
        elif sampling is not None:
            fields["sampling"] = sampling
        return cls.model_validate(fields)

    @field_validator("images", mode="before")
    @classmethod
    def _lists_per_prompt(cls, images: Any) -> Any:
        """A prompt's single image may come without its list (by handle: a tensor per prompt)."""
        if isinstance(images, (list, tuple)):
            return [list(row) if isinstance(row, (list, tuple)) else [row] for row in images]
        return images


class SampleOut(BaseModel):
    prompt_index: int
    sample_index: int
    seed: int
    reward: float
    advantage: float
    log_probs: list[float]
    image_png_base64: str | None = None
    video_mp4_base64: str | None = None


class RolloutResponse(BaseModel):
    """The JSON answer (for people and scripts); a trainer asks for the binary one, which carries the
    trajectories (serve_app.wire.trajectory)."""

    policy_version: int
    request_id: str
    samples: list[SampleOut]
    metrics: dict[str, float]
    dropped_groups: dict[int, str] = Field(
        default_factory=dict, description="Prompt index -> why, for groups a reward failed on (on_error: drop_group)."
    )


class PublishedVersion(BaseModel):
    """The answer to a weight upload: the version it is stored as and its content hash."""

    policy_version: int = Field(description="The new version; requests pinned to it sample with these weights.")
    weights_hash: str = Field(description="sha256 of the version's content (serve_app.wire.content_hash).")


class VersionInfo(BaseModel):
    """One stored weight version."""

    policy_version: int
    weights_hash: str = Field(description="sha256 of the version's content; 'base' for version 0.")
    kind: Literal["base", "lora", "full"] = Field(description="base: version 0, the checkpoint itself.")
    tensors: int = Field(description="Tensors the version holds.")
    bytes: int = Field(description="Bytes of those tensors.")
    lora: dict[str, Any] | None = Field(None, description="The LoRA spec (rank, alpha, target_modules) of a LoRA version.")


class VersionList(BaseModel):
    """The versions a store keeps, oldest first (version 0, the base checkpoint, always exists)."""

    latest: int = Field(description="The version an unpinned rollout request runs at.")
    versions: list[VersionInfo]


class ErrorResponse(BaseModel):
    """Every error answer of the HTTP API."""

    error: str = Field(description="The kind: invalid_request, malformed_json, overloaded, PolicyVersionError, ...")
    field: str = Field(description="The request field at fault (dotted, e.g. sampling.height; 'body'), or ''.")
    message: str = Field(description="What was wrong and what is accepted.")
