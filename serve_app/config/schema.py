"""Typed settings of the rollout service: a tree of pydantic models with ``RolloutConfig`` at the root.

Every setting has one home here, and the YAML files under ``configs/`` only choose values::

    cfg = load_config("diffusion_rollout", ["sampling.num_steps=4", "model=tiny_sd3"])

(composition: :mod:`serve_app.config.loader`). The Serve options of each deployment (resources,
autoscaling, request limits, health checks) are part of it too: ``build_app`` computes them from
here, and a deployment that finds Serve running it with other options fails (``serve_app.serving.options``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serve_app.config.loader import load_config as _load_config
from serve_app.families import FamilyName, families_that
from serve_app.flowgrpo.advantages import StdMode
from serve_app.imports import is_import_path
from serve_app.retry import RetryPolicy, refuse_renamed_keys
from serve_app.rewards import RewardSpec, declared_input, registered_rewards
from serve_app.config.sampling import SamplingParams


class Section(BaseModel):
    """A config section: unknown keys are errors, named with their path."""

    model_config = ConfigDict(extra="forbid")


# Families whose pipelines sample videos [B, F, 3, H, W]; the others sample images [B, 3, H, W].
VIDEO_FAMILIES = families_that(lambda row: row.produces == "videos")
# Families whose requests carry input images (a request's `images`, one list per prompt).
IMAGE_CONDITIONED_FAMILIES = families_that(lambda row: row.input_images)
# ... of those, the ones whose input images are resized to an area of their own (a video family's first frame is
# resized to the video's size).
INPUT_AREA_FAMILIES = families_that(lambda row: row.input_images and row.produces == "images")


class ModelConfig(Section):
    """Which diffusion model the replicas load."""

    family: FamilyName = Field(  # type: ignore[valid-type]
        "qwen_image", description="Model family (selects the policy adapter): a row of serve_app.families.FAMILIES."
    )
    path: str | None = Field(
        None, description="Local diffusers pipeline directory; None uses the embedded checkpoint `embedded`."
    )
    embedded: str = Field(
        "tiny-qwen-image",
        description="Embedded checkpoint used when path is None: a name of serve_app.models.EMBEDDED_MODELS "
        "(random-weight miniatures built on first use) or a 'package.module:attr' path to an EmbeddedModel.",
    )
    components: dict[str, str] = Field(
        default_factory=dict,
        description="Pipeline components of your own classes, {component folder: 'package.module:Class'}; "
        "Class.from_pretrained loads the folder (diffusers imports no module a checkpoint names).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and compute dtype.")
    distilled_guidance: float | None = Field(
        None, ge=0, allow_inf_nan=False,
        description="The `guidance` input of guidance-distilled transformers (Flux.1-dev, FLUX.2-dev: the stock "
        "pipeline's guidance_scale), one value for the replicas and the trainer alike; None: the stock default "
        "(Flux.1 3.5, FLUX.2 4.0). Ignored by models without a guidance embedding. True CFG is sampling.guidance_scale.",
    )
    input_image_area: int | None = Field(
        None, ge=1,
        description="Image-conditioned families (qwen_image_edit[_plus], flux_kontext): the pixels each input image is "
        "resized to, its aspect ratio kept and each side rounded to a multiple of 32 (flux_kontext: of Kontext's "
        "preferred resolutions scaled to this area in whole pixels, the one nearest the aspect ratio of the image's "
        "sides floored to the VAE factor x 2, its sides floored to that multiple too); None keeps the pipeline's own "
        "(1024 x 1024). Text-to-image families take none.",
    )
    condition_image_area: int | None = Field(
        None, ge=1,
        description="qwen_image_edit_plus: the pixels of the vision-language encoder's own copy of each input image "
        "(resized from the image as sent, the same rule as input_image_area); None keeps the pipeline's 384 x 384.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks cuda when the replica has a GPU.")
    compile: bool = Field(
        False,
        description="Compile the transformer's forward with torch.compile on the sampling replicas (the trainer's "
        "replay stays eager). The first rollout of each new shape pays the compilation (minutes for a large model); "
        "rollouts then agree with eager ones to rounding, which the trainer's ratio check sees.",
    )
    max_request_work: int = Field(
        2**22,
        ge=1,
        description="Most work one request may ask of the replicas: samples x steps x latent tokens (all latent "
        "frames of a video; x2 with true CFG); above: HTTP 413. Size it to what the replicas do in a request's acceptable time.",
    )

    @model_validator(mode="after")
    def _check_input_image_area(self) -> ModelConfig:
        if self.input_image_area is not None and self.family not in INPUT_AREA_FAMILIES:
            takes = ("resizes its input image to the video's size" if self.family in IMAGE_CONDITIONED_FAMILIES
                     else "takes no input images")
            raise ValueError(f"input_image_area is for image-conditioned image families "
                             f"({', '.join(INPUT_AREA_FAMILIES)}); {self.family!r} {takes}")
        copies = families_that(lambda row: row.encoder_image_copy)
        if self.condition_image_area is not None and self.family not in copies:
            raise ValueError(f"condition_image_area is for {', '.join(copies)}; {self.family!r} keeps no encoder copy "
                             "of its input images")
        return self


class IngressConfig(Section):
    """The HTTP/handle entry point: request limits and how requests are cut into chunks."""

    max_prompts: int = Field(64, ge=1, description="Most prompts (groups) in one request.")
    max_prompt_chars: int = Field(2000, ge=1, description="Longest accepted prompt, in characters.")
    max_input_image_side: int = Field(
        4096, ge=1, description="Longest side of an input image (image-conditioned families), in pixels, as sent.")
    max_input_image_bytes: int = Field(
        16 * 2**20, ge=1, description="Largest encoded input image over HTTP (the PNG's bytes, before base64).")
    max_group_size: int = Field(64, ge=1, description="Most samples per prompt.")
    max_samples: int = Field(1024, ge=1, description="Most prompts * group_size in one request; above: HTTP 413.")
    chunk_size: int = Field(
        8, ge=1, description="Samples per replica call; requests fan out in chunks of this size. It counts latent "
        "frames: a video of F' latent frames takes F' places, so video chunks hold fewer samples, and a video "
        "longer than a chunk is refused (413): Wan2.1's 81 frames are 21 latent frames.",
    )
    chunk_retry: RetryPolicy = Field(
        default_factory=lambda: RetryPolicy(attempts=3, backoff_s=0.0),
        description="Calls of a chunk whose replica died, the first included (its seeds make a re-run exact); "
        "after the last, HTTP 503.",
    )
    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved per ingress replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests one ingress replica handles at once.")
    max_queued_requests: int = Field(128, ge=-1, description="Requests queued before HTTP 503; -1 = unbounded.")
    api_token_file: str | None = Field(
        None,
        description="A file holding the HTTP API's bearer token (clients send `Authorization: Bearer <token>`). With "
        "a token, every endpoint but /healthz requires it and POST /v1/weights is on; without one, publishing over "
        "HTTP is off. The token lives in the file or the environment, never in a config.",
    )
    api_token_env: str | None = Field(
        None, description="The name of an environment variable of the ingress's process holding the bearer token "
        "(instead of api_token_file).",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        return refuse_renamed_keys(data, {"chunk_retries": "chunk_retry: {attempts: chunk_retries + 1}"})

    @model_validator(mode="after")
    def _one_token_source(self) -> IngressConfig:
        if self.api_token_file is not None and self.api_token_env is not None:
            raise ValueError("set api_token_file or api_token_env, not both")
        return self


class AutoscalingConfig(Section):
    """Ray Serve autoscaling of the sampling replicas (field names as in Ray Serve's AutoscalingConfig)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(2, ge=1, description="Most replicas autoscaling may start.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; None = min_replicas.")
    target_ongoing_requests: float = Field(2, gt=0, description="Ongoing chunk calls per replica autoscaling aims for.")
    upscale_delay_s: float = Field(5, ge=0, description="Seconds demand must stay high before scaling up.")
    downscale_delay_s: float = Field(60, ge=0, description="Seconds demand must stay low before scaling down.")
    look_back_period_s: float = Field(15, gt=0, description="Window over which ongoing requests are averaged.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= initial_replicas <= max_replicas; got {self.min_replicas}, "
                f"{self.initial_replicas}, {self.max_replicas}"
            )
        return self


class ReplicaConfig(Section):
    """The sampling replicas: backend, batching, resources and where weight versions come from."""

    backend: Literal["diffusers", "vllm_omni"] = Field("diffusers", description="Sampling backend.")
    max_batch_size: int = Field(4, ge=1, description="Chunks fused into one forward batch (@serve.batch).")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="How long a batch waits to fill before running.")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs reserved per replica (fractions share a GPU).")
    max_ongoing_requests: int = Field(8, ge=1, description="Chunk calls a replica takes at once; >= max_batch_size.")
    max_queued_requests: int = Field(-1, ge=-1, description="Chunk calls queued per deployment handle; -1 = unbounded.")
    health_check_period_s: float = Field(10, gt=0, description="Seconds between Serve's health checks of a replica.")
    health_check_timeout_s: float = Field(
        30, gt=0, description="A health check slower than this marks the replica unhealthy (Serve replaces it)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each replica needs, {name: amount}: replicas start only on nodes that "
        "offer them (e.g. `ray start --resources '{\"rollout_slot\": 1}'`), which places them on chosen nodes.",
    )
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig, description="Replica autoscaling.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per replica; None keeps Ray's default (OMP_NUM_THREADS = int(num_cpus), at least 1).",
    )
    weights_dir: str | None = Field(
        None, description="Where the trainer publishes weight versions; None = a folder under FLOWGRPO_HOME."
    )

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, backend: str) -> str:
        if backend == "vllm_omni":
            raise ValueError(
                "the vllm_omni backend is not implemented yet (vllm-omni exposes no per-step log-probs, needs a GPU "
                "and the optional extra `pip install 'flowgrpo-serve[vllm_omni]'`); use diffusers, which runs on "
                "CPU and GPU"
            )
        return backend

    @field_validator("resources")
    @classmethod
    def _check_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"{name!r} is one of Ray's own resources; set it with replica.num_cpus / num_gpus, "
                                 "not replica.resources")
            # Ray's rule for a quantity one task asks for: a fraction of one unit, or whole units.
            if not (0 < amount <= 1 or (amount > 1 and float(amount).is_integer())):
                raise ValueError(f"resource {name!r} amount must be in (0, 1] or a whole number; got {amount}")
        return resources

    @model_validator(mode="after")
    def _check_batching(self) -> ReplicaConfig:
        # With fewer ongoing calls than the batch size, a batch could never fill.
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size ({self.max_batch_size})"
            )
        return self


class AdvantageConfig(Section):
    """Group-relative advantages (serve_app.flowgrpo.advantages.group_advantages)."""

    std_mode: StdMode = Field("group", description="Divide by each group's std ('group') or the batch's ('global').")
    eps: float = Field(1e-4, gt=0, description="Added to the std so a tied group gives zeros, not NaNs.")
    clip: float | None = Field(5.0, gt=0, description="Clamp advantages to +-clip; None = no clipping.")


class AggregatorConfig(Section):
    """The deployment that gathers chunks into whole groups and scores them."""

    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved for the aggregator.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests the aggregator assembles at once.")
    reward_threads: int = Field(2, ge=1, description="Threads running in-process rewards concurrently.")
    score_while_sampling: bool = Field(
        True,
        description="Score each chunk as it arrives, while others still sample (groupwise rewards when their group "
        "is whole); false scores everything after the last chunk (for comparison: benchmarks/bench_rewards.py).",
    )
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage computation.")


class RewardConfig(Section):
    """The reward: a weighted sum of registered rewards (or 'module:attr' import paths)."""

    components: list[RewardSpec] = Field(min_length=1, description="Reward components, summed with their weights.")

    @field_validator("components")
    @classmethod
    def _check_names(cls, components: list[RewardSpec]) -> list[RewardSpec]:
        known = registered_rewards()
        for spec in components:
            # Import paths are resolved where the reward is built; registered names can be checked now.
            if not is_import_path(spec.name) and spec.name not in known:
                raise ValueError(
                    f"unknown reward {spec.name!r}; registered: {', '.join(known)} (or a 'package.module:attr' path)"
                )
        return components


class WeightsConfig(Section):
    """How published weight versions travel from the trainer to the replicas."""

    transport: Literal["filesystem", "object_store"] = Field(
        "filesystem",
        description="filesystem: a folder every node sees (replica.weights_dir); object_store: Ray's object store "
        "with a named registry actor, no shared filesystem needed.",
    )
    keep_versions: int | None = Field(
        16, ge=1, description="Versions kept; a request pinned to an older one gets HTTP 409. None keeps all."
    )
    max_upload_bytes: int = Field(
        2**30, ge=1, description="Largest body POST /v1/weights takes (the ingress holds an upload in memory while "
        "it checks it); above: HTTP 413.",
    )


class ValidationConfig(Section):
    """Evaluation sampling (SamplingParams.for_validation)."""

    num_steps: int = Field(20, ge=1, description="Denoising steps for evaluation.")
    seed: int = Field(1234, ge=0, description="Fixed seed, so evaluations of different versions are comparable.")
    guidance_scale: float | None = Field(
        None, ge=0.0, le=100.0, allow_inf_nan=False,
        description="True CFG scale for evaluation; None evaluates at sampling.guidance_scale (the rollouts').",
    )


class RolloutConfig(Section):
    """Everything the rollout application needs; trainer configs subclass it and add sections."""

    app_name: str = Field("flowgrpo", min_length=1, description="Ray Serve application name.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The diffusion model.")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Default sampling of a request.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Evaluation sampling.")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="Ingress deployment.")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig, description="Sampling replicas.")
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig, description="Aggregator deployment.")
    reward: RewardConfig = Field(description="The reward.")
    weights: WeightsConfig = Field(default_factory=WeightsConfig, description="Weight versions' transport.")

    @model_validator(mode="after")
    def _check_rewards_take_the_samples(self) -> RolloutConfig:
        """A reward must take what the family samples, or every request fails at scoring (a 502) after a
        deploy that looked fine."""
        produces = "videos" if self.model.family in VIDEO_FAMILIES else "images"
        for i, spec in enumerate(self.reward.components):
            try:
                takes = declared_input(spec.name)
            except ValueError:
                continue  # a reward only its RewardServer's runtime_env can import: it checks its input itself
            if takes not in ("any", produces):
                fix = (f"score each frame with {{name: frames, args: {{reward: {spec.name}, reduce: mean, ...}}}}, "
                       "or choose a video reward config (e.g. reward=video_brightness)" if produces == "videos"
                       else "choose an image reward, or a video model family (model.family=wan)")
                raise ValueError(
                    f"reward.components[{i}] {spec.name!r} scores {takes}, but model family {self.model.family!r} "
                    f"samples {produces}: {fix}"
                )
        return self


R = TypeVar("R", bound=RolloutConfig)


def load_config(
    name: str = "diffusion_rollout",
    overrides: Sequence[str] = (),
    *,
    config_dir: str | Path | None = None,
    schema: type[R] = RolloutConfig,  # type: ignore[assignment]
) -> R:
    """Compose ``configs/<name>.yaml`` with Hydra overrides and validate it (ConfigError names the culprit)."""
    return _load_config(name, overrides, schema=schema, config_dir=config_dir)
