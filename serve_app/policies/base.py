"""The contract every model family fulfils, and the parts they share (CFG batching, schedule).

A policy wraps diffusers components loaded with ``from_pretrained(local_dir, local_files_only=True)``.
The sampler and the trainer only talk to this interface, so the step math never learns which
family it runs.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import math
import threading
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from serve_app.errors import InvalidRequestError
from serve_app.flowgrpo.cfg import combine_cfg
from serve_app.imports import import_object
from serve_app.media import resize_image
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens


_SCHEDULES_KEPT = 64  # sigma schedules a policy keeps, one per (steps, height, width, frames)

# The pipeline component every family denoises with; Wan2.2-A14B adds a second expert (`transformer_2`).
PRIMARY_EXPERT = "transformer"


class TextProcessor(abc.ABC):
    """The CPU side of a family: chat template and tokenization, used by the ingress. Its module imports no
    diffusers (the family's row names it: serve_app.families), so an ingress loads no pipeline code.

    Fast tokenizers keep padding/truncation settings in a Rust object that every call with
    `truncation=`/`padding=` rewrites; one thread rewriting it while another encodes raised
    "RuntimeError: Already borrowed" (tokenizers 0.22). One lock serializes the calls, for the whole
    process because processors over the same folder share one backend (serve_app.models.tokenizer_cache):
    encoding a request's prompts takes about a millisecond, while a per-thread copy of a 150k-token
    tokenizer costs about a second for every new thread of a pool.
    """

    _lock = threading.Lock()

    def __init__(self, tokenizers: dict[str, Any]) -> None:
        self._tokenizers = tokenizers

    @classmethod
    @abc.abstractmethod
    def load(cls, local_dir: str | Path) -> TextProcessor:
        """The tokenizers of a pipeline directory, without any weights (the ingress's loader)."""

    def _tokenizer(self, name: str) -> Any:
        return self._tokenizers[name]

    @abc.abstractmethod
    def format(self, prompt: str) -> str:
        """The family's chat / prompt template applied to a user prompt."""

    def tokenize(self, prompts: Sequence[str]) -> list[PromptTokens]:
        """Template + token ids, one entry per prompt, unpadded where the family allows. Thread-safe."""
        with self._lock:
            return self._encode(prompts)

    @abc.abstractmethod
    def _encode(self, prompts: Sequence[str]) -> list[PromptTokens]: ...


@dataclass(frozen=True)
class ImageGeometry:
    """The image (or video) sizes a model takes and what one sample costs it (what the ingress checks
    before any replica sees a request; replicas report it, see DiffusionReplica.geometry).

    Image families have no ``temporal_factor`` and take one frame; a video family takes
    ``num_frames = k * temporal_factor + 1`` frames (its VAE's causal temporal compression), at most
    ``max_frames``.
    """

    family: str
    spatial_multiple: int  # height and width are multiples of this (VAE factor x patch size)
    max_side: int  # the largest height or width the position embedding covers
    temporal_factor: int | None = None  # video families: frames per latent frame after the first
    max_frames: int = 1
    temporal_patch: int = 1  # latent frames per transformer token
    input_images: tuple[int, int] = (0, 0)  # (fewest, most) input images a prompt takes; (0, 0): text only
    input_image_area: int = 0  # pixels an input image is resized to, its aspect ratio kept
    input_image_multiple: int = 32  # ... each side rounded to a multiple of this (Qwen-Image-Edit's rounding)
    # (width, height) px sizes at input_image_area: an input image takes the one nearest the aspect ratio of its
    # sides floored to input_image_multiple, that size's sides floored to it too (FLUX.1 Kontext's preferred
    # resolutions); empty: the area rule above.
    input_image_resolutions: tuple[tuple[int, int], ...] = ()
    # Pixels of the vision-language encoder's own copy of each input image, resized from the image as sent by
    # the area rule (Qwen-Image-Edit-Plus: 384 x 384, beside 1024 x 1024 for the VAE); 0: no separate copy.
    condition_image_area: int = 0
    # How an input image joins a sample: as latent tokens of its own beside the sample's (editing), or, resized to
    # the sample's height x width (image-to-video), along the channels of its first frame (Wan) or as its first
    # latent frame, given in place of noise (LTX-2).
    input_image_joins: Literal["tokens", "channels", "first_frame"] = "tokens"
    condition_image_as_sent: bool = False  # an image encoder gets each input image as sent (Wan2.1-I2V's CLIP)
    experts: int = 1  # denoisers, each with its own CFG scale (Wan2.2-A14B: 2, the second at guidance_scale_2)

    def check_guidance(self, guidance_scale_2: float | None) -> None:
        """Raise InvalidRequestError unless the model has a second expert for a second guidance scale."""
        if guidance_scale_2 is not None and self.experts < 2:
            raise InvalidRequestError(
                f"only two-expert checkpoints (Wan2.2-T2V-A14B) take a second guidance scale; this {self.family} "
                "model has one transformer: leave it unset", "sampling.guidance_scale_2")

    def check(self, height: int, width: int, num_frames: int = 1) -> None:
        """Raise InvalidRequestError naming the field when the model cannot take height x width x num_frames."""
        for field, value in (("sampling.height", height), ("sampling.width", width)):
            if value % self.spatial_multiple:
                raise InvalidRequestError(
                    f"must be a multiple of {self.spatial_multiple} (VAE factor x patch size) for {self.family}; "
                    f"got {height}x{width}",
                    field,
                )
            if value > self.max_side:
                raise InvalidRequestError(
                    f"at most {self.max_side} px for {self.family} (its position embedding's extent); got {value}",
                    field,
                )
        if self.temporal_factor is None:
            if num_frames != 1:
                raise InvalidRequestError(f"{self.family} generates images: must be 1; got {num_frames}",
                                          "sampling.num_frames")
            return
        if (num_frames - 1) % self.temporal_factor:
            raise InvalidRequestError(
                f"num_frames - 1 must be a multiple of {self.temporal_factor} (the VAE's temporal factor) for "
                f"{self.family}; got {num_frames}",
                "sampling.num_frames",
            )
        if self.latent_frames(num_frames) % self.temporal_patch:
            raise InvalidRequestError(
                f"its {self.latent_frames(num_frames)} latent frames must be a multiple of {self.temporal_patch} (the "
                f"transformer's temporal patch) for {self.family}; got {num_frames}",
                "sampling.num_frames",
            )
        if num_frames > self.max_frames:
            raise InvalidRequestError(
                f"at most {self.max_frames} frames for {self.family} (its position embedding's extent); got {num_frames}",
                "sampling.num_frames",
            )

    def check_input_image_count(self, count: int, field: str) -> None:
        """Raise InvalidRequestError naming `field` unless a prompt may take `count` input images."""
        fewest, most = self.input_images
        if fewest <= count <= most:
            return
        if most == 0:
            raise InvalidRequestError(f"{self.family} takes no input images (it is a text-to-image family); got {count}",
                                      field)
        takes = str(fewest) if fewest == most else f"{fewest} to {most}"
        raise InvalidRequestError(f"{self.family} takes {takes} input image(s) per prompt; got {count}", field)

    def with_input_resolutions(self, resolutions: tuple[tuple[int, int], ...], *, multiple: int) -> ImageGeometry:
        """This geometry with input images resized to the nearest of `resolutions` ((width, height) px), the
        image's sides and the chosen size's floored to `multiple`."""
        return dataclasses.replace(self, input_image_resolutions=resolutions, input_image_multiple=multiple)

    def input_image_size(self, height: int, width: int, field: str = "images") -> tuple[int, int]:
        """The (height, width) an input image of height x width is resized to before the model sees it: the
        area `input_image_area` at the image's aspect ratio, each side rounded to `input_image_multiple`
        (as QwenImageEditPipeline's calculate_dimensions does), or with `input_image_resolutions` the one
        nearest the aspect ratio of the image's sides floored to `input_image_multiple`, its own sides floored
        too (as FluxKontextPipeline's _auto_resize does). Raises InvalidRequestError naming `field` for an
        aspect ratio so extreme that a side rounds to 0 or beyond the position embedding, or, with
        resolutions, for an image less than `input_image_multiple` px tall."""
        if self.input_image_resolutions:
            size = self._nearest_resolution(height, width, field)
        else:
            size = self._at_area(self.input_image_area, width / height)
        if min(size) == 0 or max(size) > self.max_side or size[0] % self.spatial_multiple or size[1] % self.spatial_multiple:
            raise InvalidRequestError(
                f"an input image of {height}x{width} resizes to {size[0]}x{size[1]} at {self.family}'s input area of "
                f"{self.input_image_area} px, which the model cannot take (sides from {self.spatial_multiple} to "
                f"{self.max_side}); use a less extreme aspect ratio",
                field,
            )
        return size

    def _nearest_resolution(self, height: int, width: int, field: str) -> tuple[int, int]:
        m = self.input_image_multiple
        # Kontext's pipeline takes the ratio of the sides its image processor floors to the multiple, not of the
        # sides as sent: for sides that are not multiples the two ratios can be nearest different sizes.
        floored_height, floored_width = height // m * m, width // m * m
        if floored_height == 0:
            # The stock pipeline divides by zero on such an image. A width under the multiple is no error there:
            # its ratio 0 takes the tallest size, and so it does here.
            raise InvalidRequestError(
                f"an input image of {height}x{width} is less than {m} px tall; {self.family} takes the aspect ratio "
                f"of its sides floored to multiples of {m}, as its pipeline does, so a height must be at least {m} px",
                field,
            )
        ratio = floored_width / floored_height
        _, chosen_width, chosen_height = min((abs(ratio - w / h), w, h) for w, h in self.input_image_resolutions)
        return chosen_height // m * m, chosen_width // m * m

    def _at_area(self, area: int, ratio: float) -> tuple[int, int]:
        scaled_width = math.sqrt(area * ratio)
        scaled_height = scaled_width / ratio
        m = self.input_image_multiple
        return round(scaled_height / m) * m, round(scaled_width / m) * m  # round half to even, as the pipeline

    def resize_input_image(self, image: torch.Tensor, field: str = "images") -> torch.Tensor:
        """uint8 [3, H, W] -> uint8 [3, h, w] at :meth:`input_image_size` (Lanczos, as the pipeline resizes)."""
        height, width = self.input_image_size(int(image.shape[-2]), int(image.shape[-1]), field)
        return resize_image(image, height, width)

    def condition_image_size(self, height: int, width: int, field: str = "images") -> tuple[int, int]:
        """The (height, width) of the encoder's copy of an input image of height x width, for a family that has
        one (:attr:`condition_image_area`): that area at the image's aspect ratio, each side rounded to
        `input_image_multiple` (as QwenImageEditPlusPipeline's calculate_dimensions does, from the image as sent).
        InvalidRequestError naming `field` if a side rounds to 0."""
        size = self._at_area(self.condition_image_area, width / height)
        if min(size) == 0:
            raise InvalidRequestError(
                f"an input image of {height}x{width} resizes to {size[0]}x{size[1]} at {self.family}'s encoder input "
                f"area of {self.condition_image_area} px; use a less extreme aspect ratio",
                field,
            )
        return size

    def resize_condition_image(self, image: torch.Tensor, field: str = "images") -> torch.Tensor:
        """uint8 [3, H, W] as sent -> the encoder's copy at :meth:`condition_image_size` (Lanczos)."""
        height, width = self.condition_image_size(int(image.shape[-2]), int(image.shape[-1]), field)
        return resize_image(image, height, width)

    def conditioning_images(self, images: Sequence[torch.Tensor], fields: Sequence[str] | None = None, *,
                            output_size: tuple[int, int] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A prompt's input images as sent -> (each at :meth:`input_image_size`, or, for a family whose images join
        the first frame (image-to-video), at `output_size` (the sample's (height, width), Lanczos, as the image-to-video
        pipeline resizes); each encoder copy at `condition_image_area`, or as sent; no copies for a family without
        them). `fields` name the images in errors."""
        fields = list(fields) if fields is not None else ["images"] * len(images)
        if self.input_image_joins != "tokens":
            if output_size is None:
                raise ValueError(f"{self.family}'s input images are resized to the sample's size: give output_size")
            resized = [resize_image(image, *output_size) for image in images]
        else:
            resized = [self.resize_input_image(image, field) for image, field in zip(images, fields)]
        if self.condition_image_as_sent:
            return resized, [image.clone() for image in images]
        if not self.condition_image_area:
            return resized, []
        return resized, [self.resize_condition_image(image, field) for image, field in zip(images, fields)]

    def input_tokens(self, height: int, width: int) -> int:
        """Latent tokens an input image already at its conditioning size adds to every forward (none when it
        joins the first frame: its tokens are the video's own)."""
        if self.input_image_joins != "tokens":
            return 0
        return (height // self.spatial_multiple) * (width // self.spatial_multiple)

    @property
    def min_frames(self) -> int:
        """The fewest frames a sample may have: one frame for an image family, one token's latent frames
        for a video family."""
        return 1 if self.temporal_factor is None else (self.temporal_patch - 1) * self.temporal_factor + 1

    def latent_frames(self, num_frames: int = 1) -> int:
        """Latent frames of a num_frames video (1 for an image)."""
        return 1 if self.temporal_factor is None else (num_frames - 1) // self.temporal_factor + 1

    def tokens(self, height: int, width: int, num_frames: int = 1) -> int:
        """Latent tokens of one height x width sample of num_frames frames."""
        per_frame = (height // self.spatial_multiple) * (width // self.spatial_multiple)
        return per_frame * self.latent_frames(num_frames) // self.temporal_patch


@dataclass(frozen=True)
class PolicySettings:
    """What the model config sets on a policy (configs' model.*), given at construction; None keeps the family's
    own. A setting a family has no use for is ignored (its config refuses it: serve_app.config.ModelConfig)."""

    distilled_guidance: float | None = None  # the guidance embedding's input (families with one: Flux.1)
    input_image_area: int | None = None  # pixels an input image is resized to (image-conditioned families)
    condition_image_area: int | None = None  # pixels of the encoder's own copy (Qwen-Image-Edit-Plus)


class DiffusionPolicy(abc.ABC):
    """A flow-matching text-to-image (or -video) model: encode prompts, predict velocity (with true CFG),
    decode. Latents are whatever shape the family has ([B, tokens, C] packed, [B, C, H, W], or
    [B, C, F, H, W] for video); the sampler only adds the batch dim."""

    family: ClassVar[str]  # its row of serve_app.families.FAMILIES
    pipeline_class: ClassVar[type]
    cfg_renormalize: ClassVar[bool]
    input_images: ClassVar[tuple[int, int]] = (0, 0)  # (fewest, most) input images per prompt; text only: none
    input_image_area: int = 0  # image-conditioned families: pixels an input image is resized to
    condition_image_area: int = 0  # ... and the area of the encoder's own copy, for a family that has one

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype,
                 settings: PolicySettings | None = None) -> None:
        self.pipeline = pipeline
        self.device = device
        self.dtype = dtype
        self.settings = settings if settings is not None else PolicySettings()
        if self.settings.input_image_area is not None:
            self.input_image_area = self.settings.input_image_area
        if self.settings.condition_image_area is not None:
            self.condition_image_area = self.settings.condition_image_area
        self.compiled = False  # whether compile_transformer compiled the transformer's forward
        self._text_processor: TextProcessor | None = None
        # (num_steps, height, width) -> sigmas; held by the policy, so freeing a policy frees its pipeline.
        self._schedules: dict[tuple[int, int, int], torch.Tensor] = {}

    @classmethod
    def from_pretrained(
        cls,
        local_dir: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        components: Mapping[str, str] | None = None,
        settings: PolicySettings | None = None,
    ) -> DiffusionPolicy:
        """Load a pipeline directory; ``components`` maps a component folder to the
        ``"package.module:Class"`` whose ``from_pretrained`` loads it (classes outside diffusers and
        transformers, which diffusers will not import for a checkpoint); ``settings``: the model config's
        settings of the policy (PolicySettings)."""
        own = {
            name: import_object(path, what=f"pipeline component {name!r}").from_pretrained(
                str(Path(local_dir) / name), local_files_only=True
            )
            for name, path in (components or {}).items()
        }
        # Imported here: transformers is for loading; what imports this module's types alone (the aggregator, the
        # weight store) does without it.
        from serve_app.models.tokenizer_cache import pipeline_tokenizers

        own = {**pipeline_tokenizers(local_dir), **own}
        pipeline = cls.pipeline_class.from_pretrained(str(local_dir), local_files_only=True, dtype=dtype, **own)
        return cls.from_pipeline(pipeline, device=device, dtype=dtype, settings=settings)

    @classmethod
    def from_pipeline(cls, pipeline: Any, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, settings: PolicySettings | None = None) -> DiffusionPolicy:
        """A policy over a pipeline already in memory (loaded, or built from configs in code) whose
        weights are in `dtype`: moved to `device`, its progress bar off, its encoders and VAE frozen."""
        pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for module in cls._frozen_modules(pipeline):
            module.requires_grad_(False)
        return cls(pipeline, device=torch.device(device), dtype=dtype, settings=settings)

    @staticmethod
    @abc.abstractmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        """Text encoders and VAE: never trained here."""

    def text_processor(self) -> TextProcessor:
        """The tokenizer side over this pipeline's own tokenizer(s), one per policy."""
        if self._text_processor is None:
            self._text_processor = self._make_text_processor()
        return self._text_processor

    @abc.abstractmethod
    def _make_text_processor(self) -> TextProcessor: ...

    @property
    def transformer(self) -> torch.nn.Module:
        """The denoiser (with several experts, the primary one): what RL trains and weight sync replaces."""
        return self.pipeline.transformer

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """Every denoiser by its pipeline component name, the primary ``transformer`` first: what RL may
        train and weight sync may replace (Wan2.2-A14B: ``transformer`` and ``transformer_2``)."""
        return {PRIMARY_EXPERT: self.transformer}

    @property
    def probe_sigmas(self) -> tuple[float, ...]:
        """Sigmas at which a health probe runs the model: one step of each expert (here: sigma 1)."""
        return (1.0,)

    def compile_transformer(self, *, backend: str = "inductor") -> None:
        """Compile every expert's forward with torch.compile, in place (``nn.Module.compile``: the
        module, its parameter names and its weight versions stay as they are; a LoRA version added later
        recompiles once). For sampling only: the trainer's replay stays eager (``model.compile``)."""
        for expert in self.experts.values():
            expert.compile(backend=backend)
        self.compiled = True

    # -- geometry and schedule -------------------------------------------------------------

    @property
    @abc.abstractmethod
    def spatial_multiple(self) -> int:
        """Height and width must be multiples of this (VAE factor x patch size)."""

    @property
    @abc.abstractmethod
    def max_tokens_per_axis(self) -> int:
        """Image tokens along one axis the transformer's position embedding covers."""

    @property
    def temporal_factor(self) -> int | None:
        """Video families: the VAE's temporal compression; None for image families (one frame)."""
        return None

    @property
    def max_frames(self) -> int:
        """The most frames a sample may have (1 for image families)."""
        return 1

    @property
    def temporal_patch(self) -> int:
        """Latent frames per transformer token (1 for image families)."""
        return 1

    @property
    def geometry(self) -> ImageGeometry:
        return ImageGeometry(self.family, self.spatial_multiple, self.max_tokens_per_axis * self.spatial_multiple,
                             self.temporal_factor, self.max_frames, self.temporal_patch,
                             input_images=self.input_images, input_image_area=self.input_image_area,
                             condition_image_area=self.condition_image_area, experts=len(self.experts))

    def check_size(self, height: int, width: int, num_frames: int = 1) -> None:
        self.geometry.check(height, width, num_frames)

    @abc.abstractmethod
    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Shape of one sample's latent (without the batch dim); image families take num_frames 1 only."""

    @property
    def schedule_source(self) -> Any:
        """The scheduler whose sigmas the sampler steps through: the pipeline's own, unless the family
        samples with another (Wan: a flow-matching Euler scheduler at the checkout's flow_shift)."""
        return self.pipeline.scheduler

    def sigma_schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> torch.Tensor:
        """[N+1] float32 sigmas from 1 towards 0, ending at 0 - the scheduler's own schedule (for a sample of
        height x width x num_frames: a dynamically shifted schedule depends on the sample's tokens)."""
        key = (num_steps, height, width, num_frames)
        if key not in self._schedules:
            if len(self._schedules) >= _SCHEDULES_KEPT:
                del self._schedules[next(iter(self._schedules))]  # the oldest
            self._schedules[key] = self._schedule(num_steps, height, width, num_frames)
        return self._schedules[key].clone()

    def _schedule(self, num_steps: int, height: int, width: int, num_frames: int) -> torch.Tensor:
        # The scheduler keeps state; a private copy per call keeps concurrent requests apart.
        scheduler = copy.deepcopy(self.schedule_source)
        self._set_timesteps(scheduler, num_steps, height, width, num_frames)
        sigmas = torch.as_tensor(np.asarray(scheduler.sigmas.cpu(), dtype=np.float32))
        if sigmas.shape != (num_steps + 1,) or float(sigmas[-1]) != 0.0:
            raise ValueError(f"scheduler gave an unexpected schedule of shape {tuple(sigmas.shape)} for {num_steps} steps")
        return sigmas

    @abc.abstractmethod
    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None: ...

    # -- model calls -------------------------------------------------------------------------

    @abc.abstractmethod
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """Run the text encoder(s) once per prompt."""

    def encode_prompts_for(self, prompts: Sequence[PromptTokens], params: SamplingParams) -> PromptEmbeds:
        """The conditioning of `prompts` for samples of `params`: :meth:`encode_prompts`, unless what a family
        conditions on depends on the samples' size too (image-to-video: the first frame's latents span the video)."""
        return self.encode_prompts(prompts)

    @abc.abstractmethod
    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        """Raw transformer output for latents [B, ...] at sigmas [B] with per-sample conditioning."""

    def velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        cond: PromptEmbeds,
        *,
        negative: PromptEmbeds | None,
        guidance_scale: float,
        height: int,
        width: int,
    ) -> torch.Tensor:
        """Velocity in float32 [B, ...]; with a negative, true CFG at `guidance_scale` (one forward of 2B rows).

        Whether CFG runs is the caller's choice, once per request (a negative when sampling.guidance_scale > 1,
        as the stock pipelines decide); the scale of a step may then be any value (Wan2.2's guidance_scale_2)."""
        if negative is None:
            return self.predict(latents, sigma, cond, height=height, width=width).float()
        batch = latents.shape[0]
        # A negative with input images comes one row per sample (Conditioning.negative_rows); a text one is shared.
        rows = negative if negative.has_images else negative.select(torch.zeros(batch, dtype=torch.long))
        both = PromptEmbeds.cat([cond, rows])
        out = self.predict(torch.cat([latents, latents]), torch.cat([sigma, sigma]), both, height=height, width=width)
        return combine_cfg(out[:batch], out[batch:], guidance_scale, renormalize=self.cfg_renormalize)

    def guidance_scale_at(self, sigma: torch.Tensor, params: SamplingParams) -> float:
        """The true-CFG scale of the step at `sigma`: sampling.guidance_scale (Wan2.2-A14B's low-noise
        expert takes sampling.guidance_scale_2).

        Raises:
            InvalidRequestError: sampling.guidance_scale_2 is set for a model with one expert.
        """
        self.geometry.check_guidance(params.guidance_scale_2)
        return params.guidance_scale

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] (videos: [B, F, 3, H, W]) float in [0, 1]. `cond`: the samples' conditioning rows,
        which a family whose samples do not hold all they show needs (LTX-2 image-to-video: the given first
        frame); the others ignore it."""

    @abc.abstractmethod
    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        """The family's stock diffusers ``__call__`` for len(latents) samples of `prompt` from the initial
        `latents` [B, ...] (our latent layout), with `params`' size, frames, steps and true CFG (its
        negative prompt): images [B, 3, H, W] (videos [B, F, 3, H, W]) in [0, 1]. What our sampler at
        noise 0 must reproduce (the engine contract's invariant 2), and what benchmarks time it against."""


class PackedLatentPolicy(DiffusionPolicy):
    """A family whose transformer takes latents packed 2x2 into tokens (Qwen-Image, Flux): one sample's
    latent is [tokens, channels], with the transformer's `in_channels` already x4 for the packing."""

    @property
    def _vae_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor)

    @property
    def spatial_multiple(self) -> int:
        return self._vae_factor * 2  # 2x2 latent packing

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        channels = self.pipeline.transformer.config.in_channels
        return ((height // self.spatial_multiple) * (width // self.spatial_multiple), channels)


def rows_of(prompts: Sequence[str], ids: Mapping[str, torch.Tensor]) -> list[PromptTokens]:
    """One PromptTokens per prompt from padded batches of token ids [len(prompts), length] per slot."""
    return [PromptTokens(text=p, token_ids={slot: t[row].to(torch.long) for slot, t in ids.items()})
            for row, p in enumerate(prompts)]


def stack_padded(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[tokens_i, C] tensors -> [len(rows), max tokens_i, C], zero-padded: each prompt's input image latents."""
    out = rows[0].new_zeros(len(rows), max(len(x) for x in rows), rows[0].shape[-1])
    for row, x in enumerate(rows):
        out[row, : len(x)] = x
    return out


def per_input_image_shapes(
    cond: PromptEmbeds, run: Callable[[torch.Tensor | None, tuple[tuple[int, ...], ...]], torch.Tensor]
) -> torch.Tensor:
    """A forward of an image-conditioned family, per set of input image shapes: rows whose input images
    differ in size have sequences of different lengths, so each set runs as ``run(rows, shapes)`` (rows
    None when the whole batch shares it); the outputs return in row order."""
    if cond.image_shapes is None:
        raise ValueError("the prompt embeddings carry no input images")
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for row, shapes in enumerate(cond.image_shapes.tolist()):
        groups.setdefault(tuple(tuple(s) for s in shapes if s[0] > 0), []).append(row)
    if len(groups) == 1:
        return run(None, next(iter(groups)))
    device = cond.image_shapes.device
    outputs, order = [], []
    for shapes, rows in groups.items():
        outputs.append(run(torch.tensor(rows, device=device), shapes))
        order.extend(rows)
    return torch.cat(outputs)[torch.argsort(torch.tensor(order, device=device))]


_STOCK_GLOBALS_LOCK = threading.Lock()


@contextlib.contextmanager
def stock_globals(module: types.ModuleType, **values: Any) -> Iterator[None]:
    """`module`'s globals set to `values` while the block runs, then restored; no values: nothing changes.

    A stock pipeline reads its input areas (its resolution list, its area constants) from module globals when
    called, so a ``stock_call`` at a checkpoint's other area replaces just those and runs the stock code
    otherwise as it is. The module is shared by the process, so one such block runs at a time."""
    if not values:
        yield
        return
    with _STOCK_GLOBALS_LOCK:
        saved = {name: getattr(module, name) for name in values}
        for name, value in values.items():
            setattr(module, name, value)
        try:
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
