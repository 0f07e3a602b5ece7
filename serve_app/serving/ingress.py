"""The ingress's logic: validate a rollout request, merge its sampling with the app's, decode and resize its
input images, pin its policy version, tokenize it, give every sample its seed, and cut the work into chunks for the replicas
(:class:`RolloutPlanner`); and the JSON answer of the HTTP API (:func:`to_response`).

Everything a request can get wrong is decided here, before any replica sees it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

import torch
from pydantic import ValidationError

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError, RequestTooLargeError
from serve_app.flowgrpo.seeding import RequestSeeds, fresh_request_seed
from serve_app.policies.base import ImageGeometry, TextProcessor
from serve_app.media import ImageTooLargeError, decode_image_base64, mp4_base64, png_base64
from serve_app.rewards import TOTAL_KEY
from serve_app.api import RolloutRequest, RolloutResponse, SampleOut
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import RolloutChunk, TrajectoryBatch
from serve_app.weights import VersionStore, missing_version


@dataclass(frozen=True)
class RolloutPlan:
    """What the aggregator needs to check and assemble the answer."""

    request_id: str
    prompts: list[str]
    group_size: int
    policy_version: int
    chunks: list[RolloutChunk]
    input_images: list[list[torch.Tensor]] = field(default_factory=list)  # each prompt's, as the model sees them


class RolloutPlanner:
    """Plans requests against the app's limits, sampling defaults and model.

    ``geometry`` says which image sizes (and video frame counts) the model takes and what a sample costs;
    ``max_work`` bounds samples x steps x latent tokens (every latent frame's; x2 with CFG) per request. ``store`` is where the trainer
    publishes weight versions: "latest" is resolved there once per request, and a pinned version must
    exist there. Without a store only version 0 exists.
    """

    def __init__(
        self,
        text_processor: TextProcessor,
        limits: IngressConfig,
        default_sampling: SamplingParams,
        geometry: ImageGeometry,
        *,
        max_work: int,
        store: VersionStore | None = None,
    ) -> None:
        self.text_processor = text_processor
        self.limits = limits
        self.default_sampling = default_sampling
        self.geometry = geometry
        self.max_work = max_work
        self.store = store

    def sampling_for(self, request: RolloutRequest) -> SamplingParams:
        """The app's sampling with the fields the request set, validated once on the merged values."""
        try:
            sampling = self.default_sampling.merged(request.sampling)
        except ValidationError as exc:
            raise InvalidRequestError.from_validation(exc, prefix=("sampling",)) from None
        _check_text(sampling.negative_prompt, "sampling.negative_prompt")
        return sampling

    def policy_version_for(self, request: RolloutRequest) -> int:
        """The concrete version every chunk of the request runs at: the pinned one, which must exist,
        or the newest published now (so a version published mid-request cannot split it)."""
        kept = [0, *self.store.versions()] if self.store is not None else [0]
        if request.policy_version is None:
            return kept[-1]
        if request.policy_version not in kept:
            raise missing_version(request.policy_version, kept[1:])
        return request.policy_version

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
            _check_text(prompt, f"prompts[{i}]")
        if request.group_size > limits.max_group_size:
            raise InvalidRequestError(f"must be between 1 and {limits.max_group_size}; got {request.group_size}", "group_size")
        total = len(request.prompts) * request.group_size
        if total > limits.max_samples:
            raise RequestTooLargeError(
                f"prompts x group_size = {total} samples exceeds the limit of {limits.max_samples}", "group_size"
            )

    def prompt_images(self, request: RolloutRequest, sampling: SamplingParams
                      ) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """(each prompt's input images, decoded, checked and resized to the size the family conditions on
        (uint8 [3, h, w]; empty lists for a text-to-image family), the text encoder's own copies of them): the
        copies are resized from the images as sent, for a family that keeps them (``geometry.condition_image_area``);
        empty lists otherwise. Raises InvalidRequestError (422) or RequestTooLargeError (413) naming the image,
        e.g. ``images[0][0]``."""
        geometry = self.geometry
        if request.images is None:
            if geometry.input_images[0] > 0:
                geometry.check_input_image_count(0, "images")
            return [[] for _ in request.prompts], [[] for _ in request.prompts]
        if len(request.images) != len(request.prompts):
            raise InvalidRequestError(f"needs one list of input images per prompt: {len(request.prompts)} prompts, "
                                      f"{len(request.images)} lists", "images")
        resized, condition = [], []
        for i, row in enumerate(request.images):
            geometry.check_input_image_count(len(row), f"images[{i}]")
            fields = [f"images[{i}][{j}]" for j in range(len(row))]
            sent = [self._input_image(image, field) for image, field in zip(row, fields)]
            prompt_resized, prompt_condition = geometry.conditioning_images(
                sent, fields, output_size=(sampling.height, sampling.width))
            resized.append(prompt_resized)
            condition.append(prompt_condition)
        return resized, condition

    def _input_image(self, image: str | torch.Tensor, field: str) -> torch.Tensor:
        """One input image as sent -> uint8 [3, H, W], within the configured limits."""
        max_side = self.limits.max_input_image_side
        if isinstance(image, str):
            try:
                return decode_image_base64(image, max_side=max_side, max_bytes=self.limits.max_input_image_bytes)
            except ImageTooLargeError as exc:
                raise RequestTooLargeError(f"{exc} (ingress.max_input_image_side / max_input_image_bytes)", field) from None
            except ValueError as exc:
                raise InvalidRequestError(str(exc), field) from None
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3 or min(image.shape[1:]) < 1:
            raise InvalidRequestError(f"must be a uint8 tensor [3, H, W]; got {image.dtype} {list(image.shape)}", field)
        if max(image.shape[1:]) > max_side:
            raise RequestTooLargeError(f"is {image.shape[1]}x{image.shape[2]} px; each side must be at most {max_side} "
                                       "px (ingress.max_input_image_side)", field)
        return image.cpu()

    def check_work(self, request: RolloutRequest, sampling: SamplingParams,
                   images: list[list[torch.Tensor]] | None = None) -> None:
        """The model takes the size (and frame count), and the request's work fits the budget (413 otherwise).

        Work counts every latent token a step runs on, so a video costs its latent frames x its pixels'
        tokens: a video request cannot pass for an image-sized one; and an input image's latent tokens,
        which every step of every sample of its prompt runs on too.
        """
        self.geometry.check(sampling.height, sampling.width, sampling.num_frames)
        self.geometry.check_guidance(sampling.guidance_scale_2)
        latent_frames = self.geometry.latent_frames(sampling.num_frames)
        if latent_frames > self.limits.chunk_size:
            raise RequestTooLargeError(
                f"one sample of {sampling.num_frames} frames is {latent_frames} latent frames, more than a replica call "
                f"takes (ingress.chunk_size = {self.limits.chunk_size} latent frames); ask for fewer frames",
                "sampling.num_frames",
            )
        samples = len(request.prompts) * request.group_size
        passes = 2 if sampling.guidance_scale > 1.0 else 1
        tokens = self.geometry.tokens(sampling.height, sampling.width, sampling.num_frames)
        input_tokens = sum(self.geometry.input_tokens(*image.shape[1:]) for row in images or [] for image in row)
        work = (samples * tokens + request.group_size * input_tokens) * sampling.num_steps * passes
        if work > self.max_work:
            frames = (f" ({latent_frames} latent frames of {sampling.num_frames})"
                      if self.geometry.temporal_factor is not None else "")
            inputs = (f" (+ {input_tokens} input image tokens x {request.group_size} samples a prompt)"
                      if input_tokens else "")
            raise RequestTooLargeError(
                f"{samples} samples x {sampling.num_steps} steps x {tokens} latent tokens{frames}{inputs}"
                f"{' x 2 (true CFG)' if passes == 2 else ''} = {work} exceeds the model's budget of "
                f"{self.max_work} (model.max_request_work); ask for fewer samples, steps, frames or pixels",
                "sampling",
            )

    def samples_per_chunk(self, sampling: SamplingParams) -> int:
        """Samples per replica call: ``ingress.chunk_size`` counts latent frames (an image is one), so a
        replica sized for chunks of images gets as many frames from a video request - fewer samples
        per chunk, never a larger forward batch (check_work refuses a sample larger than a chunk)."""
        return max(1, self.limits.chunk_size // self.geometry.latent_frames(sampling.num_frames))

    def plan(self, request: RolloutRequest) -> RolloutPlan:
        # 1. Check the request, merge its sampling, check its size and work, pin its version.
        self.validate(request)
        sampling = self.sampling_for(request)
        images, condition_images = self.prompt_images(request, sampling)
        self.check_work(request, sampling, images)
        policy_version = self.policy_version_for(request)
        request_seed = request.seed if request.seed is not None else sampling.seed
        if request_seed is None:
            request_seed = fresh_request_seed()
        sampling = sampling.model_copy(update={"seed": request_seed})
        # 2. Tokenize each prompt once (and the negative prompt when CFG is on); a prompt's input images go
        # with its tokens, so each chunk carries them once per prompt it samples.
        prompt_tokens = [replace(tokens, images=row, condition_images=condition)
                         for tokens, row, condition in zip(self.text_processor.tokenize(request.prompts), images,
                                                           condition_images)]
        negative = (
            self.text_processor.tokenize([sampling.negative_prompt])[0] if sampling.guidance_scale > 1.0 else None
        )
        # 3. Samples in AABB order (a group is contiguous), cut into chunks of chunk_size latent frames.
        drawn = RequestSeeds.of(request_seed, len(request.prompts), request.group_size, sampling)
        prompt_index, sample_index, seeds, group_seeds = drawn.prompt_index, drawn.sample_index, drawn.seeds, drawn.group_seeds
        per_chunk = self.samples_per_chunk(sampling)
        chunks = []
        for start in range(0, len(seeds), per_chunk):
            part = slice(start, start + per_chunk)
            distinct, slot = torch.unique(prompt_index[part], return_inverse=True)
            chunks.append(
                RolloutChunk(
                    sampling=sampling,
                    prompts=[prompt_tokens[int(p)] for p in distinct],
                    negative_prompt=negative,
                    prompt_slot=slot,
                    prompt_index=prompt_index[part].clone(),
                    sample_index=sample_index[part].clone(),
                    seeds=seeds[part].clone(),
                    window_start=drawn.window_start,
                    policy_version=policy_version,
                    group_seeds=None if group_seeds is None else group_seeds[part].clone(),
                )
            )
        return RolloutPlan(uuid.uuid4().hex[:12], list(request.prompts), request.group_size, policy_version, chunks,
                           images)


def _check_text(text: str, field: str) -> None:
    """Text the tokenizer can take: encodable as UTF-8 (JSON can carry lone surrogates, which are not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(f"is not valid Unicode text ({exc.reason} at character {exc.start})", field) from None


def to_response(batch: TrajectoryBatch, *, images: torch.Tensor | None) -> RolloutResponse:
    """JSON for people and other languages (trainers take the tensors by handle). With `images` (the
    batch's, fetched by the caller when the request asks for them), each sample's image as a PNG, or its
    video ([F, 3, H, W] frames) as an H.264 MP4."""
    header = batch.header
    total = batch.rewards[TOTAL_KEY]
    videos = images is not None and images.ndim == 5
    pngs = png_base64(images) if images is not None and not videos else None
    samples = [
        SampleOut(
            prompt_index=int(header.prompt_index[i]),
            sample_index=int(header.sample_index[i]),
            seed=int(header.seeds[i]),
            reward=float(total[i]),
            advantage=float(batch.advantages[i]),
            log_probs=header.log_probs[i].tolist(),
            image_png_base64=None if pngs is None else pngs[i],
            video_mp4_base64=mp4_base64(images[i]) if videos else None,
        )
        for i in range(len(batch))
    ]
    return RolloutResponse(
        policy_version=batch.policy_version, request_id=batch.request_id, samples=samples, metrics=batch.metrics,
        dropped_groups=batch.dropped_groups,
    )
