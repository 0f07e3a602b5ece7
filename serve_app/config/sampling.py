"""How one rollout request samples (SamplingParams) and what a request may change of it (SamplingOverrides):
the settings every request carries, validated once on the merged values. Pydantic only, so the sampler, the
wire formats and a Ray-free client read it without the rest of the config (Hydra, the reward registry).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictFloat,
    StrictInt,
    create_model,
    field_validator,
    model_validator,
)

# Schema-level caps on image sides and video frames, far above any model's; each model's own limit is tighter.
MAX_IMAGE_SIDE = 16384
MAX_FRAMES = 4097
# The smallest positive noise_level: a step's float32 log-density stops being finite from about 1e-30 (Flow-SDE),
# and long before that the samples are the ODE's up to rounding; 0 samples the ODE itself.
MIN_NOISE_LEVEL = 1e-6

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
        1.2, ge=0.0, le=10.0, allow_inf_nan=False,
        description="The `a` of Flow-GRPO (CPS: at most 1); 0 samples the ODE, and a positive value is at least 1e-6."
    )
    sde_type: Literal["sde", "cps", "dance", "ode"] = Field(
        "sde", description="Stochastic step used inside the window: sde (Flow-SDE), cps (coefficients-preserving), "
        "dance (DanceGRPO's step) or ode.")
    ode_solver: Literal["euler", "dpm2m"] = Field(
        "euler", description="Solver of the deterministic steps outside the window: euler, or dpm2m "
        "(DPM-Solver++(2M), second order: the same quality in fewer steps).")
    sde_window_size: StrictInt | None = Field(
        2, ge=1, description="Stochastic (trained) steps per trajectory; None makes every step but the last stochastic."
    )
    sde_window_range: tuple[StrictInt, StrictInt] = Field(
        (0, 5), description="Half-open range [lo, hi) the window's first step is drawn from (Flow-GRPO-Fast)."
    )
    record: Literal["window", "final"] = Field(
        "window",
        description="What the trajectory keeps: window (the latents entering each SDE step and after the last, "
        "with their log-probs: what a ratio-based trainer replays) or final (the latents after the first step and "
        "the final ones, no log-probs: what a forward-process trainer such as DiffusionNFT trains on and checks its "
        "velocity by). With final and noise_level 0 every step is the ode_solver's.",
    )
    seed: StrictInt | None = Field(None, ge=0, lt=2**63, description="Request seed; per-sample seeds derive from it.")
    group_noise: Literal["independent", "shared"] = Field(
        "independent",
        description="shared: a prompt's samples start from one initial noise, so the deterministic steps before "
        "the SDE window run once per prompt and the group branches at the window (each sample's own step noise).",
    )

    @field_validator("noise_level")
    @classmethod
    def _check_noise_level(cls, value: float) -> float:
        if 0.0 < value < MIN_NOISE_LEVEL:
            raise ValueError(f"must be 0 (the ODE) or at least {MIN_NOISE_LEVEL:g}: a smaller step noise has a "
                             f"variance float32 cannot hold in its log-density; got {value!r}")
        return value

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
                "ode_solver": "euler",
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
