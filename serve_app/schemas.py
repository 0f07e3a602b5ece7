"""The tensor contracts between the ingress, the replicas, the aggregator and the trainer: everything that
carries tensors is a dataclass of tensors, so nothing numeric turns into Python lists between deployments.

The request and answer types live in serve_app.api, the sampling settings in serve_app.config.sampling; their
names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from serve_app.config.sampling import (
    MAX_FRAMES,
    MAX_IMAGE_SIDE,
    SamplingOverrides,
    SamplingParams,
)
from serve_app.stored import NotSent, Stored, resolve, resolve_async

# What a trajectory sampled with version 0 (the base checkpoint, no published tensors) is stamped with.
BASE_HASH = "base"


@dataclass
class PromptEmbeds:
    """Conditioning, once per distinct prompt.

    embeds: [P, L, D] padded to the longest prompt in this set (not to a global maximum).
    mask:   [P, L] bool, True on real tokens.
    pooled: [P, D'] pooled projection for families that use one (SD3), else None.
    image_latents: [P, T, C] the latents of each prompt's input images, joined along the tokens and
        zero-padded to the longest row in this set (image-conditioned families), else None.
    image_shapes: [P, N, 3] long, the (frames, rows, columns) of tokens each of a prompt's N input images
        takes in image_latents (a row's real tokens: the sum of their products), with image_latents.
    image_embeds: [P, L', D''] an image encoder's states of each prompt's input image, which the transformer
        takes beside the text (Wan2.1 image-to-video's CLIP), else None.
    """

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    image_shapes: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.image_latents is None) != (self.image_shapes is None):
            raise ValueError("image_latents and image_shapes come together")

    def __len__(self) -> int:
        return self.embeds.shape[0]

    @property
    def has_images(self) -> bool:
        """Whether the conditioning includes input images (then a negative prompt is encoded with each
        prompt's images: one negative row per prompt)."""
        return self.image_latents is not None

    def select(self, index: torch.Tensor) -> PromptEmbeds:
        """Rows for each sample ([B] long index into P), trimmed to the longest selected prompt (and image)."""
        mask = self.mask[index]
        length = max(int(mask.sum(dim=1).max()), 1)
        image_latents = image_shapes = None
        if self.image_latents is not None and self.image_shapes is not None:
            image_shapes = self.image_shapes[index]
            tokens = max(int(image_shapes.prod(dim=-1).sum(dim=-1).max()), 1)
            image_latents = self.image_latents[index, :tokens]
        return PromptEmbeds(
            self.embeds[index, :length],
            mask[:, :length],
            None if self.pooled is None else self.pooled[index],
            image_latents,
            image_shapes,
            None if self.image_embeds is None else self.image_embeds[index],
        )

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """Stack several prompt sets, padding to the longest one."""
        length = max(p.embeds.shape[1] for p in parts)
        pooled = [p.pooled for p in parts]
        image_embeds = [p.image_embeds for p in parts]
        if len({p.has_images for p in parts}) > 1:
            raise ValueError("cannot concatenate prompt embeddings with input images and without")
        image_latents = image_shapes = None
        if parts[0].has_images:
            tokens = max(p.image_latents.shape[1] for p in parts)  # type: ignore[union-attr]
            images = max(p.image_shapes.shape[1] for p in parts)  # type: ignore[union-attr]
            image_latents = torch.cat([_pad_tokens(p.image_latents, tokens) for p in parts])  # type: ignore[arg-type]
            image_shapes = torch.cat([_pad_tokens(p.image_shapes, images) for p in parts])  # type: ignore[arg-type]
        return PromptEmbeds(
            torch.cat([_pad_tokens(p.embeds, length) for p in parts]),
            torch.cat([_pad_tokens(p.mask, length) for p in parts]),
            None if any(x is None for x in pooled) else torch.cat(pooled),  # type: ignore[arg-type]
            image_latents,
            image_shapes,
            None if any(x is None for x in image_embeds) else torch.cat(image_embeds),  # type: ignore[arg-type]
        )

    def to(self, device: torch.device | str) -> PromptEmbeds:
        """Every tensor on `device`."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PromptEmbeds(self.embeds.to(device), self.mask.to(device), move(self.pooled),
                            move(self.image_latents), move(self.image_shapes), move(self.image_embeds))


def _pad_tokens(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad dim 1 (tokens) of [P, L] or [P, L, D] to `length`."""
    extra = length - tensor.shape[1]
    if extra == 0:
        return tensor
    pad_shape = (tensor.shape[0], extra, *tensor.shape[2:])
    return torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=1)


@dataclass(frozen=True)
class ImagePrompt:
    """A training or evaluation prompt of an image-conditioned family: its text and its input images as
    sent (uint8 [3, H, W] each). A trainer's `prompt_source` may give these instead of strings."""

    text: str
    images: tuple[torch.Tensor, ...]


def split_image_prompts(prompts: Sequence[str | ImagePrompt]) -> tuple[list[str], list[list[torch.Tensor]] | None]:
    """(texts, each prompt's input images) of strings or ImagePrompts; None for strings. Raises ValueError
    for a mix: a request's prompts all carry images or none do."""
    with_images = [isinstance(p, ImagePrompt) for p in prompts]
    if any(with_images) and not all(with_images):
        raise ValueError("prompts with and without input images")
    texts = [p.text if isinstance(p, ImagePrompt) else p for p in prompts]
    if not any(with_images):
        return texts, None
    return texts, [list(p.images) for p in prompts]  # type: ignore[union-attr]


@dataclass
class PromptTokens:
    """One prompt after the ingress: its text, per tokenizer of the family 1-D token ids, and its input
    images (uint8 [3, h, w] each, already resized to the size the family conditions on; none for a
    text-to-image family). `condition_images`: the text encoder's own copies of `images`, resized from the
    images as sent, for a family that keeps one (Qwen-Image-Edit-Plus); empty otherwise."""

    text: str
    token_ids: dict[str, torch.Tensor]
    images: list[torch.Tensor] = field(default_factory=list)
    condition_images: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RolloutChunk:
    """A replica's unit of work: some samples of one request (they share sampling params and window).

    prompts: the distinct prompts this chunk needs; `prompt_slot` indexes into it.
    prompt_index / sample_index: the sample's place in the request (group = prompt_index).
    seeds: [n] per-sample seeds; a sample's noise depends on its seed only ...
    group_seeds: [n] ... and, with sampling.group_noise = "shared", on its group's seed (None otherwise).
    policy_version: the concrete weights version, resolved once per request by the planner.
    """

    sampling: SamplingParams
    prompts: list[PromptTokens]
    negative_prompt: PromptTokens | None
    prompt_slot: torch.Tensor
    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    seeds: torch.Tensor
    window_start: int | None
    policy_version: int
    group_seeds: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.seeds.shape[0])


@dataclass
class Trajectory:
    """Sampled trajectories of B samples (one chunk, or a whole request once aggregated).

    latents:          [B, K+1, *latent_shape] the latents entering each stochastic step and the last one's output
                      (sampling.record final: no log-probs; latents[:, 0] are the latents after the first step and
                      latents[:, 1] the final ones).
    log_probs:        [B, K] float32 log-probs of each stochastic transition.
    sigmas:           [N+1] float32 the full schedule (N = num_steps).
    step_indices:     [K] long, which steps of the schedule are recorded stochastic steps (the SDE window).
    images:           [B, 3, H, W] uint8 decoded images; [B, F, 3, H, W] for a video family; None in the
                      transitions a trainer replays (images travel apart, to the rewards, and to the trainer
                      only when it asks: TrajectoryBatch.images).
    seeds:            [B] long per-sample seeds.
    prompt_embeds:    conditioning once per distinct prompt (P rows); `embed_row` [B] maps a sample to its row
                      (a function of prompt_index: samples of one prompt share their row).
    prompt_index:     [B] long, the sample's prompt (its group) in the request.
    negative_embeds:  None without CFG; one row shared by all samples, or, when the conditioning has input
                      images (``has_images``), one row per prompt row like prompt_embeds (the negative prompt
                      with that prompt's images).
    sample_index:     [B] long, the sample's index within its group.
    policy_version:   the weights version that produced every sample here (no default: a forgotten
                      stamp must fail, not read as version 0).
    weights_hash:     the content hash of the weights the replica checked it held for that version
                      (serve_app.weights.replica; "base" for version 0).

    Built by the sampler; re-cut with :meth:`take` (rows) and :meth:`cat` (parts), never field by field.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    step_indices: torch.Tensor
    images: torch.Tensor | None
    seeds: torch.Tensor
    prompt_embeds: PromptEmbeds
    embed_row: torch.Tensor
    negative_embeds: PromptEmbeds | None
    sampling: SamplingParams
    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    policy_version: int
    weights_hash: str

    def __len__(self) -> int:
        return int(self.seeds.shape[0])

    def without_images(self) -> Trajectory:
        """The transitions alone: what a trainer replays."""
        return replace(self, images=None)

    def take(self, rows: torch.Tensor | slice) -> Trajectory:
        """The samples at ``rows`` (a [n] long index or a slice), as new tensors.

        Prompt embeddings shrink to the prompts those samples use, one row each in prompt-index
        order; tensors are copies, so the result pickles without its parent's storage. The rows must
        come from one request (samples with one prompt_index share their conditioning): a batch
        fused from several requests is cut back per request, never across.
        """
        index = torch.arange(len(self))[rows] if isinstance(rows, slice) else rows.to(torch.long)
        prompt_index = self.prompt_index[index]
        prompts, slot = torch.unique(prompt_index, return_inverse=True)
        # Any sample of a prompt holds that prompt's embedding row; take the first one's.
        first = torch.stack([index[prompt_index == p][0] for p in prompts]) if len(index) else index
        negative = self.negative_embeds
        return replace(
            self,
            latents=self.latents[index].clone(),
            log_probs=self.log_probs[index].clone(),
            images=None if self.images is None else self.images[index].clone(),
            seeds=self.seeds[index].clone(),
            prompt_embeds=self.prompt_embeds.select(self.embed_row[first]),
            negative_embeds=negative.select(self.embed_row[first]) if negative is not None and negative.has_images
            else negative,
            embed_row=slot,
            prompt_index=prompt_index.clone(),
            sample_index=self.sample_index[index].clone(),
        )

    @staticmethod
    def cat(parts: Sequence[Trajectory]) -> Trajectory:
        """The samples of ``parts`` in order; they must share version, sampling and schedule.

        Raises:
            ValueError: no parts, or parts that were not sampled alike (naming what differs).
        """
        if not parts:
            raise ValueError("Trajectory.cat needs at least one part")
        first = parts[0]
        for name in ("policy_version", "weights_hash", "sampling"):
            values = {repr(getattr(p, name)) for p in parts}
            if len(values) > 1:
                raise ValueError(f"cannot concatenate trajectories with different {name}: {sorted(values)}")
        for p in parts[1:]:
            if not (torch.equal(p.sigmas, first.sigmas) and torch.equal(p.step_indices, first.step_indices)):
                raise ValueError("cannot concatenate trajectories with different schedules or SDE windows")
        if len({p.images is None for p in parts}) > 1:
            raise ValueError("cannot concatenate trajectories with images and trajectories without")
        offsets = torch.tensor([0] + [len(p.prompt_embeds) for p in parts[:-1]]).cumsum(0)
        return replace(
            first,
            latents=torch.cat([p.latents for p in parts]),
            log_probs=torch.cat([p.log_probs for p in parts]),
            images=None if first.images is None else torch.cat([p.images for p in parts]),
            seeds=torch.cat([p.seeds for p in parts]),
            prompt_embeds=PromptEmbeds.cat([p.prompt_embeds for p in parts]),
            negative_embeds=_cat_negatives([p.negative_embeds for p in parts]),
            embed_row=torch.cat([p.embed_row + int(off) for p, off in zip(parts, offsets)]),
            prompt_index=torch.cat([p.prompt_index for p in parts]),
            sample_index=torch.cat([p.sample_index for p in parts]),
        )


def _cat_negatives(parts: list[PromptEmbeds | None]) -> PromptEmbeds | None:
    """The negative conditioning of concatenated trajectories: the shared row (the first part's: every
    part's is the same negative prompt), or the per-prompt rows of image-conditioned parts, in order."""
    first = parts[0]
    if first is None or not first.has_images:
        return first
    return PromptEmbeds.cat([p for p in parts if p is not None])


@dataclass
class ChunkHeader:
    """What the ingress and the aggregator read of a sampled chunk: which samples it holds, their seeds
    and log-probs (the HTTP answer reports them), the version and the weights hash they were sampled
    with. Small: the chunk's tensors travel apart (:class:`SampledChunk`).

    prompt_index, sample_index, seeds: [n] long; log_probs: [n, K] float32.
    """

    prompt_index: torch.Tensor
    sample_index: torch.Tensor
    seeds: torch.Tensor
    log_probs: torch.Tensor
    policy_version: int
    weights_hash: str
    sampled_by: str = ""  # the replica that sampled the chunk (its Serve replica id), for logs and tests

    def __len__(self) -> int:
        return int(self.seeds.shape[0])

    @staticmethod
    def of(trajectory: Trajectory, *, sampled_by: str = "") -> ChunkHeader:
        return ChunkHeader(trajectory.prompt_index, trajectory.sample_index, trajectory.seeds, trajectory.log_probs,
                           trajectory.policy_version, trajectory.weights_hash, sampled_by)

    @staticmethod
    def cat(parts: Sequence[ChunkHeader]) -> ChunkHeader:
        versions = {(p.policy_version, p.weights_hash) for p in parts}
        if len(versions) != 1:
            raise ValueError(f"chunks sampled under different policy versions or weights: {sorted(versions)}")
        return ChunkHeader(*(torch.cat([getattr(p, name) for p in parts])
                             for name in ("prompt_index", "sample_index", "seeds", "log_probs")),
                           parts[0].policy_version, parts[0].weights_hash)


@dataclass
class SampledChunk:
    """One chunk as it travels from the replica that sampled it: the header as a value, and its images
    (uint8 [n, 3, H, W] or [n, F, 3, H, W]) and transitions (a Trajectory without images) each a
    value in one process, or a Ray ObjectRef on a cluster (serve_app.stored), resolved only where used:
    the images by the rewards, the transitions by the trainer."""

    header: ChunkHeader
    images: Stored
    transitions: Stored

    def __len__(self) -> int:
        return len(self.header)

    @staticmethod
    def of(trajectory: Trajectory) -> SampledChunk:
        """A chunk held by value (in one process)."""
        return SampledChunk(ChunkHeader.of(trajectory), trajectory.images, trajectory.without_images())


@dataclass
class BatchLayout:
    """The aggregator's answer for a request: which rows form the batch and what they scored.

    rows: [B] long index into the request's chunks' samples concatenated in chunk order, giving the
        batch's order (prompt_index, sample_index), without the dropped groups.
    rewards: per reward key [B] float32 (the weighted sum under "total"); advantages: [B] float32.
    """

    rows: torch.Tensor
    rewards: dict[str, torch.Tensor]
    advantages: torch.Tensor
    metrics: dict[str, float]
    policy_version: int
    dropped_groups: dict[int, str] = field(default_factory=dict)


@dataclass
class TrajectoryBatch:
    """What a rollout request returns: whole groups, rewards and advantages, as tensors.

    Samples are ordered by (prompt_index, sample_index): group g occupies rows g*G .. g*G+G-1.
    rewards: per reward key [B] float32 (the weighted sum under "total").
    advantages: [B] float32 group-relative advantages.
    metrics: scalar summaries (reward mean/std, tied-group share, dropped groups, timings).
    dropped_groups: {prompt index: why} of the groups a reward with `on_error: drop_group` failed to
        score; they are not in the batch (rows hold the kept groups in order, prompt_index keeps the
        request's numbering) and advantages are computed over the kept groups only.

    The samples' tensors stay where they were made until asked for: :attr:`transitions` (what the
    trainer replays) and :attr:`images` are fetched once each, on first use, in the asking process;
    :attr:`trajectory` is both.
    """

    chunks: list[SampledChunk]
    rows: torch.Tensor
    prompts: list[str]
    group_size: int
    rewards: dict[str, torch.Tensor]
    advantages: torch.Tensor
    metrics: dict[str, float]
    request_id: str
    policy_version: int
    dropped_groups: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @staticmethod
    def of(trajectory: Trajectory, prompts: Sequence[str], group_size: int, rewards: dict[str, torch.Tensor],
           advantages: torch.Tensor, metrics: dict[str, float], request_id: str, *,
           dropped_groups: dict[int, str] | None = None) -> TrajectoryBatch:
        """A batch of one trajectory already in batch order, held by value."""
        return TrajectoryBatch([SampledChunk.of(trajectory)], torch.arange(len(trajectory)), list(prompts), group_size,
                               rewards, advantages, metrics, request_id, trajectory.policy_version,
                               dropped_groups or {})

    @staticmethod
    def received(header: ChunkHeader, prompts: Sequence[str], group_size: int, rewards: dict[str, torch.Tensor],
                 advantages: torch.Tensor, metrics: dict[str, float], request_id: str, *,
                 transitions: Trajectory | None, images: torch.Tensor | None,
                 dropped_groups: dict[int, str] | None = None) -> TrajectoryBatch:
        """A batch that arrived whole and in batch order (an HTTP answer): its transitions and images are
        kept as they came, and the ones the answer left out raise NotSentError when used."""
        chunk = SampledChunk(
            header,
            images if images is not None else NotSent("the answer holds no images: ask with return_images"),
            transitions if transitions is not None
            else NotSent("the answer holds no trajectories: ask with return_trajectory"),
        )
        batch = TrajectoryBatch([chunk], torch.arange(len(header)), list(prompts), group_size, rewards, advantages,
                                metrics, request_id, header.policy_version, dropped_groups or {})
        if transitions is not None:
            batch.__dict__["_transitions"] = transitions
        if images is not None:
            batch.__dict__["_images"] = images
        return batch

    @property
    def header(self) -> ChunkHeader:
        """Ids, seeds and log-probs of the batch's rows (no tensor is fetched)."""
        merged = ChunkHeader.cat([c.header for c in self.chunks])
        return ChunkHeader(merged.prompt_index[self.rows], merged.sample_index[self.rows], merged.seeds[self.rows],
                           merged.log_probs[self.rows], merged.policy_version, merged.weights_hash)

    @property
    def transitions(self) -> Trajectory:
        """The batch's trajectory without images (fetched here once, then kept)."""
        if "_transitions" not in self.__dict__:
            self._keep_transitions([resolve(c.transitions) for c in self.chunks])
        return self.__dict__["_transitions"]

    @property
    def images(self) -> torch.Tensor:
        """uint8 [B, 3, H, W] (videos [B, F, 3, H, W]), fetched here once, then kept."""
        if "_images" not in self.__dict__:
            self._keep_images([resolve(c.images) for c in self.chunks])
        return self.__dict__["_images"]

    @property
    def trajectory(self) -> Trajectory:
        """The transitions with their images."""
        return replace(self.transitions, images=self.images)

    def fetch(self, *, images: bool = False) -> TrajectoryBatch:
        """Fetch the transitions (and the images) now; returns self."""
        _ = self.transitions
        if images:
            _ = self.images
        return self

    async def fetch_async(self, *, images: bool = False) -> TrajectoryBatch:
        """:meth:`fetch` without blocking the event loop."""
        if "_transitions" not in self.__dict__:
            self._keep_transitions([await resolve_async(c.transitions) for c in self.chunks])
        if images:
            await self.fetch_images_async()
        return self

    async def fetch_images_async(self) -> torch.Tensor:
        """:attr:`images` without blocking the event loop (inside a deployment)."""
        if "_images" not in self.__dict__:
            self._keep_images([await resolve_async(c.images) for c in self.chunks])
        return self.__dict__["_images"]

    def _keep_transitions(self, parts: list[Trajectory]) -> None:
        self.__dict__["_transitions"] = Trajectory.cat(parts).take(self.rows)

    def _keep_images(self, parts: list[torch.Tensor]) -> None:
        self.__dict__["_images"] = torch.cat(parts)[self.rows]


@dataclass
class ScoreJob:
    """Samples of one prompt's group to score, cut by the ingress from chunks as they arrive: a chunk's
    part of the group for the per-sample rewards, or (``whole_group``) all G samples in sample order for
    the groupwise rewards, once the group's last sample is in.

    sample_index: [n] long, in the order of the parts' rows concatenated.
    parts: (images of a chunk, stored as it travels; [m] long rows of that chunk) per chunk holding some.
    input_images: the prompt's input images (uint8 [3, h, w]), when a reward compares samples with them.
    """

    prompt_index: int
    prompt: str
    sample_index: torch.Tensor
    parts: list[tuple[Stored, torch.Tensor]]
    whole_group: bool
    input_images: list[torch.Tensor] = field(default_factory=list)

    async def images(self) -> torch.Tensor:
        """uint8 [n, 3, H, W] (videos [n, F, 3, H, W]) of the job's samples, fetched where it is scored."""
        return torch.cat([(await resolve_async(images))[rows] for images, rows in self.parts])


@dataclass
class GroupScores:
    """A ScoreJob's result: [n] float32 values per reward key for ``sample_index``, or, when a reward
    with ``on_error: drop_group`` failed on it, no values and the failure that drops the group."""

    prompt_index: int
    sample_index: torch.Tensor
    values: dict[str, torch.Tensor]
    failed_reward: str | None = None
    failure: str | None = None


# The request and answer types, where callers have imported them from.
from serve_app.api import (  # noqa: E402  (serve_app.api needs nothing of this module)
    ErrorResponse,
    InputImage,
    PublishedVersion,
    RolloutRequest,
    RolloutResponse,
    SampleOut,
    VersionInfo,
    VersionList,
)

__all__ = [
    "BASE_HASH", "MAX_FRAMES", "MAX_IMAGE_SIDE", "BatchLayout", "ChunkHeader", "ErrorResponse", "GroupScores",
    "ImagePrompt", "InputImage", "PromptEmbeds", "PromptTokens", "PublishedVersion", "RolloutChunk", "RolloutRequest",
    "RolloutResponse", "SampleOut", "SampledChunk", "SamplingOverrides", "SamplingParams", "ScoreJob", "Trajectory",
    "TrajectoryBatch", "VersionInfo", "VersionList", "split_image_prompts",
]
