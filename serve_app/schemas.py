"""Request, chunk and trajectory types: the contracts between the ingress, the replicas, the
aggregator and the trainer, in one place.

Settings and requests are pydantic models (validated at the edge, JSON-friendly); everything that
carries tensors is a dataclass of tensors, so nothing numeric turns into Python lists between
deployments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictFloat,
    StrictInt,
    PlainValidator,
    StrictStr,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)

from serve_app.stored import NotSent, Stored, resolve, resolve_async

# What a trajectory sampled with version 0 (the base checkpoint, no published tensors) is stamped with.
BASE_HASH = "base"

# Schema-level caps on image sides and video frames, far above any model's; each model's own limit is tighter.
MAX_IMAGE_SIDE = 16384
MAX_FRAMES = 4097

# ---------------------------------------------------------------------------------------------
# Settings


class SamplingParams(BaseModel):
    """How to sample one rollout request (all samples of a request share these)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict types (no "7" or true for 7) and finite, bounded floats: a value a request gets wrong is a
    # 422 here, never an overflow or a NaN tensor in a replica. The model's own size limits and the
    # work budget are checked by the planner, which knows the model.
    height: StrictInt = Field(
        32, ge=1, le=MAX_IMAGE_SIDE, description="Image height in pixels; a multiple of the model's spatial factor."
    )
    width: StrictInt = Field(
        32, ge=1, le=MAX_IMAGE_SIDE, description="Image width in pixels; a multiple of the model's spatial factor."
    )
    num_frames: StrictInt = Field(
        1, ge=1, le=MAX_FRAMES,
        description="Frames per sample: 1 for image families; for video families (wan) num_frames - 1 is a "
        "multiple of the VAE's temporal factor (4 for Wan2.1: 5, 9, ..., 81).",
    )
    num_steps: StrictInt = Field(10, ge=1, le=1000, description="Denoising steps (sigma schedule length - 1).")
    guidance_scale: StrictFloat = Field(
        4.0, ge=0.0, le=100.0, allow_inf_nan=False, description="True CFG scale; > 1 runs the negative prompt too."
    )
    guidance_scale_2: StrictFloat | None = Field(
        None, ge=0.0, le=100.0, allow_inf_nan=False,
        description="Two-expert models only (Wan2.2-T2V-A14B): the true CFG scale of the low-noise expert's steps; "
        "None uses guidance_scale. CFG runs when guidance_scale > 1.",
    )
    negative_prompt: str = Field(" ", max_length=2000, description="Negative prompt for true CFG.")
    noise_level: StrictFloat = Field(
        1.2, ge=0.0, le=10.0, allow_inf_nan=False, description="The `a` of Flow-GRPO (CPS: at most 1); 0 samples the ODE."
    )
    sde_type: Literal["sde", "cps", "ode"] = Field("sde", description="Stochastic step used inside the window.")
    sde_window_size: StrictInt | None = Field(
        2, ge=1, description="Stochastic (trained) steps per trajectory; None makes every step but the last stochastic."
    )
    sde_window_range: tuple[StrictInt, StrictInt] = Field(
        (0, 5), description="Half-open range [lo, hi) the window's first step is drawn from (Flow-GRPO-Fast)."
    )
    seed: StrictInt | None = Field(None, ge=0, lt=2**63, description="Request seed; per-sample seeds derive from it.")
    group_noise: Literal["independent", "shared"] = Field(
        "independent",
        description="shared: a prompt's samples start from one initial noise, so the deterministic steps before "
        "the SDE window run once per prompt and the group branches at the window (each sample's own step noise).",
    )

    @model_validator(mode="after")
    def _check_window(self) -> SamplingParams:
        if self.sde_type == "cps" and self.noise_level > 1.0:
            raise ValueError(f"sde_type 'cps' takes noise_level in [0, 1] (std = sigma_next sin(a pi / 2)); got {self.noise_level}")
        lo, hi = self.sde_window_range
        if not 0 <= lo < hi:
            raise ValueError(f"sde_window_range must satisfy 0 <= lo < hi; got {self.sde_window_range}")
        if self.sde_window_size is not None:
            last_start = hi - 1
            # The last step is always deterministic, so the window must end before it.
            if last_start + self.sde_window_size > self.num_steps - 1:
                raise ValueError(
                    f"SDE window outside the steps: a window of {self.sde_window_size} starting as late as step "
                    f"{last_start} (sde_window_range={self.sde_window_range}) needs num_steps >= "
                    f"{last_start + self.sde_window_size + 1}; got num_steps={self.num_steps}"
                )
        return self

    def merged(self, overrides: SamplingOverrides) -> SamplingParams:
        """These settings with the fields ``overrides`` sets; validated once, on the merged values.

        Raises:
            pydantic.ValidationError: the merged settings are invalid (the message names the values).
        """
        return SamplingParams.model_validate({**self.model_dump(), **overrides.model_dump(exclude_unset=True)})

    def for_validation(self, *, num_steps: int | None = None, seed: int | None = None,
                       guidance_scale: float | None = None) -> SamplingParams:
        """Evaluation settings: the ODE (noise 0), usually with more steps and a fixed seed; every sample
        from its own noise (with shared group noise an ODE group would be one image, repeated)."""
        return self.model_copy(
            update={
                "guidance_scale": self.guidance_scale if guidance_scale is None else float(guidance_scale),
                "noise_level": 0.0,
                "sde_type": "ode",
                "sde_window_size": None,
                "sde_window_range": (0, 1),
                "group_noise": "independent",
                "num_steps": num_steps or self.num_steps,
                "seed": self.seed if seed is None else seed,
            }
        )


def _optional(annotation: Any, metadata: list[Any]) -> Any:
    """``annotation | None``, keeping a Strict() marker (pydantic moves it into the field's metadata)."""
    strict = [m for m in metadata if isinstance(m, Strict)]
    return Annotated[annotation | None, *strict] if strict else annotation | None


# A request's `sampling`: every field of SamplingParams, optional, with its type (strictness
# included) but no bound of its own. The app's defaults are merged in and the result validated once
# (SamplingParams.merged), so a check that involves several fields sees the values that will run.
SamplingOverrides = create_model(
    "SamplingOverrides",
    __config__=ConfigDict(extra="forbid", frozen=True),
    __doc__="Sampling settings a request changes; the app's configured sampling fills the rest.",
    **{
        name: (_optional(field.annotation, field.metadata), Field(None, description=field.description))
        for name, field in SamplingParams.model_fields.items()
    },
)


# ---------------------------------------------------------------------------------------------
# Tensors between deployments


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
    """

    embeds: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    image_shapes: torch.Tensor | None = None

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
        )

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """Stack several prompt sets, padding to the longest one."""
        length = max(p.embeds.shape[1] for p in parts)
        pooled = [p.pooled for p in parts]
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
        )

    def to(self, device: torch.device | str) -> PromptEmbeds:
        """Every tensor on `device`."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PromptEmbeds(self.embeds.to(device), self.mask.to(device), move(self.pooled),
                            move(self.image_latents), move(self.image_shapes))


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

    latents:          [B, K+1, *latent_shape] the latents entering each stochastic step and the last one's output.
    log_probs:        [B, K] float32 log-probs of each stochastic transition.
    sigmas:           [N+1] float32 the full schedule (N = num_steps).
    step_indices:     [K] long, which steps of the schedule are stochastic (the SDE window).
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


# ---------------------------------------------------------------------------------------------
# The HTTP / handle request


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
