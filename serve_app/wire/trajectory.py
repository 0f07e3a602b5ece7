"""A rollout's answer as one container (serve_app.wire.container): what a TrajectoryBatch gives a handle
caller, for a trainer in any language or cluster. docs/http.md lists the layout; this module is it.

Tensors, B samples in batch order (group g at rows g*G .. g*G+G-1, dropped groups left out), K SDE steps:

    prompt_index, sample_index, seeds      [B] int64
    log_probs                              [B, K] float32
    advantages                             [B] float32
    rewards.<key>                          [B] float32, one per reward key ("total": the weighted sum)
    metrics                                [M] float64, named by the document's metric_names
  with the trajectory (return_trajectory):
    latents                                [B, K+1, ...] the window's latents, in the dtype they were sampled
                                           (sampling.record final: [B, 2, ...], after the first step and final)
    sigmas [N+1] float32, step_indices [K] int64, embed_row [B] int64 (a sample's prompt_embeds row)
    prompt_embeds.embeds [P, L, D], .mask [P, L] bool, and where the family has them .pooled [P, D'],
    .image_latents [P, T, C], .image_shapes [P, N, 3] int64 (input-image conditioning), .image_embeds [P, L', D'']
    (an image encoder's states: Wan2.1 image-to-video)
    negative_embeds.* the same fields: one row shared by every sample, or one per prompt row with input images
  with the images (return_images):
    images                                 [B, 3, H, W] uint8, or [B, F, 3, H, W] for a video family

The metadata document: format, request_id, policy_version and weights_hash (every sample's: a request runs
at one version), prompts, group_size, reward_keys, metric_names, dropped_groups ({prompt index: why}),
sampling (the request's merged SamplingParams), has_trajectory, has_images.
"""

from __future__ import annotations

from typing import Any

import torch

from serve_app.config.sampling import SamplingParams
from serve_app.schemas import ChunkHeader, PromptEmbeds, Trajectory, TrajectoryBatch
from serve_app.wire.container import WireFormatError, pack, unpack

TRAJECTORY_MEDIA_TYPE = "application/vnd.flowgrpo.trajectory+safetensors"
FORMAT = "flowgrpo.trajectory/1"

_EMBED_FIELDS = ("embeds", "mask", "pooled", "image_latents", "image_shapes", "image_embeds")


def encode_batch(batch: TrajectoryBatch, *, transitions: Trajectory | None = None,
                 images: torch.Tensor | None = None) -> bytearray:
    """The container of `batch`: its header, rewards and advantages, with `transitions` (the batch's, fetched)
    and `images` when given."""
    header = batch.header
    metric_names = sorted(batch.metrics)
    tensors: dict[str, torch.Tensor] = {
        "prompt_index": header.prompt_index, "sample_index": header.sample_index, "seeds": header.seeds,
        "log_probs": header.log_probs, "advantages": batch.advantages,
        "metrics": torch.tensor([float(batch.metrics[k]) for k in metric_names], dtype=torch.float64),
        **{f"rewards.{key}": value for key, value in batch.rewards.items()},
    }
    if transitions is not None:
        tensors.update(latents=transitions.latents, sigmas=transitions.sigmas, step_indices=transitions.step_indices,
                       embed_row=transitions.embed_row)
        tensors.update(_embed_tensors("prompt_embeds", transitions.prompt_embeds))
        if transitions.negative_embeds is not None:
            tensors.update(_embed_tensors("negative_embeds", transitions.negative_embeds))
    if images is not None:
        tensors["images"] = images
    sampling = transitions.sampling if transitions is not None else None
    metadata = {
        "format": FORMAT, "request_id": batch.request_id, "policy_version": header.policy_version,
        "weights_hash": header.weights_hash, "prompts": batch.prompts, "group_size": batch.group_size,
        "reward_keys": list(batch.rewards), "metric_names": metric_names,
        "dropped_groups": {str(k): v for k, v in batch.dropped_groups.items()},
        "sampling": None if sampling is None else sampling.model_dump(mode="json"),
        "has_trajectory": transitions is not None, "has_images": images is not None,
    }
    return pack(tensors, metadata)


def decode_batch(buffer: bytes | bytearray | memoryview) -> TrajectoryBatch:
    """The TrajectoryBatch a container holds; its tensors view `buffer` (no copy). What the answer left out
    (trajectories, images) raises NotSentError when used.

    Raises:
        WireFormatError: not a trajectory container of this format.
    """
    tensors, meta = unpack(buffer)
    if meta.get("format") != FORMAT:
        raise WireFormatError(f"not a {FORMAT} container (format {meta.get('format')!r})")
    try:
        header = ChunkHeader(tensors["prompt_index"], tensors["sample_index"], tensors["seeds"], tensors["log_probs"],
                             int(meta["policy_version"]), str(meta["weights_hash"]))
        rewards = {key: tensors[f"rewards.{key}"] for key in meta["reward_keys"]}
        metrics = dict(zip(meta["metric_names"], tensors["metrics"].tolist()))
        transitions = _transitions(tensors, meta, header) if meta["has_trajectory"] else None
        return TrajectoryBatch.received(
            header, meta["prompts"], int(meta["group_size"]), rewards, tensors["advantages"], metrics,
            str(meta["request_id"]), transitions=transitions, images=tensors["images"] if meta["has_images"] else None,
            dropped_groups={int(k): v for k, v in meta["dropped_groups"].items()},
        )
    except KeyError as exc:
        raise WireFormatError(f"the container lacks {exc.args[0]!r}") from None


def _embed_tensors(prefix: str, embeds: PromptEmbeds) -> dict[str, torch.Tensor]:
    found = {name: getattr(embeds, name) for name in _EMBED_FIELDS}
    return {f"{prefix}.{name}": tensor for name, tensor in found.items() if tensor is not None}


def _embeds(prefix: str, tensors: dict[str, torch.Tensor]) -> PromptEmbeds | None:
    if f"{prefix}.embeds" not in tensors:
        return None
    return PromptEmbeds(**{name: tensors.get(f"{prefix}.{name}") for name in _EMBED_FIELDS})


def _transitions(tensors: dict[str, torch.Tensor], meta: dict[str, Any], header: ChunkHeader) -> Trajectory:
    prompt_embeds = _embeds("prompt_embeds", tensors)
    if prompt_embeds is None:
        raise KeyError("prompt_embeds.embeds")
    return Trajectory(
        latents=tensors["latents"], log_probs=header.log_probs, sigmas=tensors["sigmas"],
        step_indices=tensors["step_indices"], images=None, seeds=header.seeds, prompt_embeds=prompt_embeds,
        embed_row=tensors["embed_row"], negative_embeds=_embeds("negative_embeds", tensors),
        sampling=SamplingParams.model_validate(meta["sampling"]), prompt_index=header.prompt_index,
        sample_index=header.sample_index, policy_version=header.policy_version, weights_hash=header.weights_hash,
    )
