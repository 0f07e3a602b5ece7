"""Typed settings of the reference trainer: the rollout config plus a `trainer:` section.

    cfg = load_trainer_config("trainer/flowgrpo", ["trainer.lr=1e-3"])

The trainer composes the same files as the app (``defaults: [/diffusion_rollout, _self_]``), so its
model, sampling and weights directory agree with what the replicas run. It reads the app's sections
only to load the same checkpoint, send the same sampling and find the same weight store; settings of
the deployments (advantages, rewards, resources) take effect where the app is deployed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from serve_app.config import RolloutConfig, Section, load_config
from serve_app.imports import import_object
from serve_app.schemas import ImagePrompt, split_image_prompts
from serve_app.trainer.algorithms import Algorithm, check_algorithm_sampling


class LoraSection(Section):
    """LoRA on the transformer (peft); disabled = full fine-tune of the transformer."""

    enabled: bool = Field(True, description="Train a LoRA adapter; False trains every transformer weight.")
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha (scale = alpha / r).")
    target_modules: list[str] = Field(
        default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"],
        min_length=1,
        description="Module names (suffixes) that get adapters: the attention projections.",
    )
    experts: list[Literal["transformer", "transformer_2"]] | None = Field(
        None,
        min_length=1,
        description="The denoisers that train (LoRA, or all their weights when disabled), by pipeline component: "
        "'transformer' (every family's; Wan2.2-A14B's high-noise expert) and 'transformer_2' (Wan2.2-A14B's "
        "low-noise expert); None: every one the checkpoint has. An expert left out stays at its base weights.",
    )

    @field_validator("experts")
    @classmethod
    def _distinct_experts(cls, experts: list[str] | None) -> list[str] | None:
        if experts is not None and len(set(experts)) != len(experts):
            raise ValueError(f"experts must not repeat a name; got {experts}")
        return experts


class EvaluationSection(Section):
    """What the ODE evaluations every `trainer.eval_every` steps measure (rows of eval.csv)."""

    evaluator: str = Field(
        "serve_app.trainer.evaluation:RewardEvaluator",
        description="'package.module:attr' of an Evaluator factory, called as factory(config, **args): the prompt "
        "splits, the metrics of eval.csv, grids and plots. Default: the mean configured reward.",
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the evaluator.")
    samples_per_prompt: int = Field(4, ge=1, description="Fixed-seed ODE samples per evaluation prompt.")
    grid_samples: int = Field(4, ge=1, description="Samples per prompt shown in the evaluation grids.")


class MismatchSection(Section):
    """The rollout-vs-replay mismatch check and truncated importance sampling (serve_app.trainer.mismatch)."""

    max_abs_log_ratio: float = Field(
        1e-5, gt=0,
        description="Bound on |log pi_behaviour_replay - log pi_rollout| of any checked transition: every step, a "
        "sample of the batch is replayed (no grad) with the weights of the version that sampled it (fp32 engines: "
        "0 to ~1e-7; velocities rounded to bf16 in rollout: 6e-5 to 9e-5 on the tiny models).",
    )
    action: Literal["warn", "stop"] = Field(
        "warn", description="Above the bound: log a warning, or stop training before the step's optimizer step."
    )
    check_groups: Annotated[int, Field(ge=1)] | Literal["all"] = Field(
        1,
        description="Whole groups (prompts) of each rank's batch the check replays every step, drawn with the "
        "step's seed; 'all' replays every row. With tis_cap every row is replayed anyway.",
    )
    tis_cap: float | None = Field(
        None, gt=0,
        description="Truncated importance sampling for an engine known to differ (bf16, other kernels): the check "
        "replays every row, its log-probs become the old log-probs of the clipped ratio, and each transition's "
        "loss is weighted by min(exp(logp_trainer_old - logp_rollout), tis_cap); None = off.",
    )


class DistributedSection(Section):
    """Data-parallel training on Ray Train (serve_app.trainer.distributed); workers 1 trains in this process."""

    workers: int = Field(1, ge=1, description="TorchTrainer workers (ranks); each replays its shard of every rollout.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="ddp: the transformer on every rank, gradients all-reduced; fsdp: its parameters sharded "
        "over the ranks with torch's FSDP2 (fully_shard), for a transformer that does not fit one device.",
    )
    use_gpu: bool = Field(False, description="One GPU per worker and the nccl backend; False: CPU and gloo.")
    cpus_per_worker: float = Field(1.0, gt=0, description="CPUs Ray reserves per worker (fractions allowed).")
    max_failures: int = Field(
        2, ge=0, description="Times Ray Train restarts the worker group after a worker dies; a restarted group resumes "
        "from the last checkpoint (trainer.checkpoint_every), into the run it would have been; ddp only (fsdp runs are "
        "not restarted).",
    )


class MixGRPOSection(Section):
    """MixGRPO's sliding window (trainer.algorithm mix_grpo; serve_app.trainer.algorithms)."""

    shift_interval: int = Field(25, ge=1, description="Rollouts between two moves of the window.")
    stride: int = Field(1, ge=1, description="Steps the window moves later at each move.")
    max_start: int = Field(
        0, ge=0, description="The latest first step of the window; it stays there once reached. "
        "max_start + sampling.sde_window_size must leave the last step deterministic.",
    )


class DiffusionNFTSection(Section):
    """DiffusionNFT's objective (trainer.algorithm diffusion_nft; serve_app.trainer.nft, loss.nft_loss)."""

    beta: float = Field(1.0, gt=0.0, description="Strength of the implicit positive and negative policies "
                        "(v+- = v_old +- beta (v_theta - v_old)).")
    advantage_clip: float = Field(1.0, gt=0.0, description="Advantages map to the optimality probability "
                                  "r = 1/2 + 1/2 clip(A / advantage_clip, -1, 1).")
    draws: int = Field(2, ge=1, description="Forward-process points (t, eps) per sample and pass.")
    t_range: tuple[float, float] = Field((0.0, 1.0), description="The forward times t are uniform in [lo, hi).")
    adaptive_weighting: bool = Field(True, description="Weight each draw's error by its x0-space magnitude "
                                     "(the paper's adaptive weighting); false: the plain velocity error.")
    check_rows: int = Field(2, ge=0, description="Rollouts per batch whose first step the trainer takes again with "
                            "the weights of the version they claim; its velocity must match the sampler's "
                            "(0: no check).")
    max_velocity_error: float = Field(1e-3, gt=0.0, description="The largest |v_trainer - v_sampler| of that first "
                                      "step the check accepts.")
    # The sampling policy (v_old) as a soft-updated average: after update i it becomes d_i old + (1 - d_i) theta,
    # with d_i = 0 for i < sampling_decay_delay, then min((i - delay) x rate, max). Rollouts sample it, the loss
    # contrasts against it, the velocity check takes the first step with it. All 0: the trained weights after every
    # update.
    sampling_decay_delay: int = Field(0, ge=0, description="Updates after which the sampling policy's decay "
                                      "starts to rise (before: it is the trained weights).")
    sampling_decay_rate: float = Field(0.0, ge=0.0, description="How much the sampling policy's decay rises per "
                                       "update after the delay.")
    sampling_decay_max: float = Field(0.0, ge=0.0, lt=1.0, description="The sampling policy's largest decay.")

    @property
    def averages_sampling(self) -> bool:
        """The sampling policy is a soft-updated average of the trained weights (a decay above 0 at some update)."""
        return self.sampling_decay_rate > 0 and self.sampling_decay_max > 0

    @model_validator(mode="after")
    def _check_t_range(self) -> DiffusionNFTSection:
        lo, hi = self.t_range
        if not 0.0 <= lo < hi <= 1.0:
            raise ValueError(f"t_range must satisfy 0 <= lo < hi <= 1; got {self.t_range}")
        return self


class TrainerSection(Section):
    """The FlowGRPO loop: batch shape, optimiser, objective, logging."""

    algorithm: Algorithm = Field(
        "flow_grpo",
        description="What each rollout samples (serve_app.trainer.algorithms): flow_grpo (the configured sampling), "
        "mix_grpo (a sliding SDE window, trainer.mix_grpo), dance_grpo (DanceGRPO's SDE step, sampling.sde_type "
        "dance) or diffusion_nft (ODE rollouts' final latents, trained on their forward process, "
        "trainer.diffusion_nft).",
    )
    grpo_guard: bool = Field(
        False,
        description="GRPO-Guard: clip the normalised ratio (RatioNorm) and weight each window step's loss by "
        "1 / |dt|; needs the Gaussian Flow-SDE step (sampling.sde_type sde).",
    )
    mix_grpo: MixGRPOSection = Field(default_factory=MixGRPOSection, description="MixGRPO's sliding window.")
    diffusion_nft: DiffusionNFTSection = Field(default_factory=DiffusionNFTSection,
                                               description="DiffusionNFT's objective.")
    steps: int = Field(30, ge=1, description="Training steps (one rollout request each).")
    prompts_per_step: int = Field(2, ge=1, description="Prompts (groups) per rollout request.")
    group_size: int = Field(8, ge=2, description="Samples per prompt; advantages are relative within a group.")
    prompts: list[str] = Field(
        default_factory=lambda: ["a photo of a cat"], min_length=1, description="Training prompts, used round-robin."
    )
    prompt_source: str | None = Field(
        None,
        description="'package.module:attr' of a list of prompts (or a function returning one) that replaces `prompts`; "
        "for an image-conditioned family, of ImagePrompts (serve_app.schemas: the text and its input images).",
    )
    shuffle_prompts: bool = Field(False, description="Shuffle the prompts once, with `seed`, before the round-robin.")
    lr: float = Field(3e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(1e-4, ge=0, description="AdamW weight decay.")
    beta: float = Field(0.0, ge=0, description="KL coefficient against the reference (base) policy.")
    clip_range: float = Field(1e-4, gt=0, lt=1, description="PPO clip range e of the ratio.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_size: int = Field(8, ge=1, description="Rows per replayed forward pass.")
    grad_accum: int | None = Field(
        None, ge=1, description="Micro-batches per optimizer step; None = all of a rollout (one step per epoch)."
    )
    inner_epochs: int = Field(1, ge=1, description="Passes over each rollout batch.")
    max_staleness: int = Field(
        0, ge=0,
        description="Rollouts kept in flight while the trainer updates; a batch is used at most this many updates "
        "after the version it was sampled with (older ones are dropped and counted). 0 = strict on-policy. Above 0 "
        "the trainer keeps the trainable tensors of the last max_staleness + 1 versions on the CPU (the adapter; the "
        "whole transformer without LoRA), to replay each batch with its own version's weights (trainer.mismatch).",
    )
    onpolicy_tolerance: float = Field(
        1e-4, gt=0, description="Largest |ratio - 1| accepted before the first optimizer step of a rollout."
    )
    lora: LoraSection = Field(default_factory=LoraSection, description="Adapter settings.")
    mismatch: MismatchSection = Field(default_factory=MismatchSection, description="Rollout-vs-replay mismatch.")
    distributed: DistributedSection = Field(default_factory=DistributedSection, description="Data-parallel workers.")
    eval_every: int = Field(
        0, ge=0, description="Steps between ODE evaluations (before training, every so many steps and at the end); 0 = never."
    )
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection, description="What evaluations measure.")
    ema_decay: float | None = Field(
        None, gt=0, lt=1,
        description="Keep an EMA of the trained weights (diffusers' EMAModel) and evaluate it, published as a "
        "version of its own, instead of the raw weights; None = off.",
    )
    image_every: int = Field(5, ge=0, description="Steps between grids of training images; 0 = never.")
    checkpoint_every: int = Field(10, ge=0, description="Steps between checkpoints; 0 = only at the end.")
    prefetch: bool = Field(False, description="Push each new version to the live replicas ahead of requests.")
    seed: int = Field(0, ge=0, description="Seeds rollout requests (step s uses seed*1_000_003 + s) and torch.")
    torch_threads: int | None = Field(
        None, ge=1,
        description="torch intra-op threads of the trainer process; None keeps torch's default (one per core). "
        "When replicas share the trainer's cores, fewer threads stop the update from preempting the rollout.",
    )
    rollout_timeout_s: float = Field(600.0, gt=0, description="Longest wait for one rollout request.")
    # The prompt source's ImagePrompts (the texts are `prompts`), when it gave prompts with input images.
    _image_prompts: list[ImagePrompt] | None = PrivateAttr(None)

    @property
    def averages_sampling(self) -> bool:
        """DiffusionNFT with a soft-updated sampling policy (diffusion_nft.sampling_decay_*): the versions published
        are an average of the trained weights, not the trained weights."""
        return self.algorithm == "diffusion_nft" and self.diffusion_nft.averages_sampling

    @model_validator(mode="after")
    def _check(self) -> TrainerSection:
        if self.prompt_source is not None:
            source = import_object(self.prompt_source, what="prompt source")
            prompts = list(source() if callable(source) else source)
            try:
                texts, images = split_image_prompts(prompts)
            except ValueError as exc:
                raise ValueError(f"prompt_source {self.prompt_source!r} gave {exc}") from None
            if not prompts or not all(isinstance(t, str) and t.strip() for t in texts):
                raise ValueError(f"prompt_source {self.prompt_source!r} gave no prompts, or not only non-empty strings "
                                 "and ImagePrompts")
            self.prompts = texts
            self._image_prompts = None if images is None else prompts
        if self.prompts_per_step > len(self.prompts):
            raise ValueError(
                f"trainer.prompts_per_step ({self.prompts_per_step}) exceeds the {len(self.prompts)} trainer.prompts"
            )
        workers = self.distributed.workers
        if self.prompts_per_step % workers:
            raise ValueError(
                f"trainer.prompts_per_step ({self.prompts_per_step}) must be a multiple of trainer.distributed.workers "
                f"({workers}): every worker replays the same number of whole groups"
            )
        if workers > 1 and self.distributed.strategy == "fsdp" and self.averages_sampling:
            raise ValueError("trainer.diffusion_nft.sampling_decay_* is not supported with trainer.distributed.strategy "
                             "fsdp (the average of sharded weights is not implemented); use ddp or a decay of 0")
        if workers > 1 and self.distributed.strategy == "fsdp" and self.ema_decay is not None:
            raise ValueError("trainer.ema_decay is not supported with trainer.distributed.strategy fsdp "
                             "(the EMA of sharded weights is not implemented); use ddp or ema_decay null")
        return self

    def training_prompts(self) -> list[str] | list[ImagePrompt]:
        """The prompts in their order: strings, or ImagePrompts when the prompt source gave input images."""
        return list(self.prompts if self._image_prompts is None else self._image_prompts)


class TrainerRunConfig(RolloutConfig):
    """A training run: everything the app uses, plus the trainer."""

    trainer: TrainerSection = Field(default_factory=TrainerSection, description="The FlowGRPO trainer.")

    @model_validator(mode="after")
    def _check_batch(self) -> TrainerRunConfig:
        samples = self.trainer.prompts_per_step * self.trainer.group_size
        if samples > self.ingress.max_samples:
            raise ValueError(
                f"trainer.prompts_per_step * trainer.group_size = {samples} exceeds ingress.max_samples "
                f"({self.ingress.max_samples})"
            )
        check_algorithm_sampling(self.trainer, self.sampling)
        if self.trainer.group_size > self.ingress.max_group_size:
            raise ValueError(
                f"trainer.group_size ({self.trainer.group_size}) exceeds ingress.max_group_size ({self.ingress.max_group_size})"
            )
        return self


def load_trainer_config(name: str = "trainer/flowgrpo", overrides: Sequence[str] = ()) -> TrainerRunConfig:
    """Compose and validate a trainer config; errors name the offending key (ConfigError)."""
    return load_config(name, overrides, schema=TrainerRunConfig)
