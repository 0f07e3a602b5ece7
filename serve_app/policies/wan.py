"""Wan text-to-video (Wan2.1, and Wan2.2 below): a UMT5 text encoder, a WanTransformer3DModel over 1x2x2
patches of 5-D latents [B, C, F', H', W'], the causal 3-D AutoencoderKLWan.

Mirrors the stock ``WanPipeline.__call__`` (diffusers 0.42):

* Prompts are cleaned (``prompt_clean``: ftfy when installed, HTML unescaping, whitespace), tokenized
  and padded to ``max_sequence_length`` (512, capped by the tokenizer's own limit) with an attention
  mask; the encoder's states past each prompt's tokens are zeroed and the transformer attends to all
  ``max_sequence_length`` positions, zeros included. Here the embeddings travel trimmed to the
  longest prompt (with their mask) and are zero-padded back only in :meth:`WanPolicy.predict`.
* True CFG is ``uncond + w (cond - uncond)`` without renormalisation; the negative prompt is encoded
  like any prompt.
* The transformer gets the scheduler's timesteps (sigma x num_train_timesteps, float32).
* Decoding un-normalises with the VAE's ``latents_mean`` / ``latents_std`` and returns frames
  [B, F, 3, H, W] in [0, 1]; F = (F' - 1) x temporal factor + 1.

The sigma schedule. Our sampler takes Euler / Flow-SDE steps between flow-matching sigmas, so the
schedule must be one a ``FlowMatchEulerDiscreteScheduler`` produces. Stock Wan2.1 checkouts ship a
``UniPCMultistepScheduler`` with ``use_flow_sigmas`` and a ``flow_shift`` (3.0 at 480p, 5.0 at 720p):
a multistep solver our one-step transition cannot replay. The adapter therefore samples such a
checkout with ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` - the same time shift
``sigma' = s sigma / (1 + (s - 1) sigma)`` applied to FlowMatchEuler's own spacing - and leaves the
pipeline's scheduler untouched (``pipeline.scheduler`` is still UniPC for anyone calling the stock
``__call__``). A checkout whose scheduler already is FlowMatchEuler (the embedded tiny Wan) is used
as it is, so the stock call at noise 0 is exactly our ODE.

Wan2.2 runs through the same adapter, detected from the checkout (``model_index.json``):

* Two experts (Wan2.2-T2V-A14B: ``transformer_2`` and ``boundary_ratio``). A step whose timestep
  ``t = sigma x num_train_timesteps`` is at least ``boundary_ratio x num_train_timesteps`` runs the
  high-noise expert ``transformer`` with ``guidance_scale``; a step below it runs the low-noise expert
  ``transformer_2`` with ``sampling.guidance_scale_2`` (None: ``guidance_scale``), as the stock loop does.
  The expert is a function of the step's sigma alone (:func:`expert_at`), so a trajectory needs no record
  of it: ``replay_step`` recomputes a stored step with the expert that sampled it, and an SDE window may
  lie across the boundary (its steps then train different experts).
* Per-token timesteps (Wan2.2-TI2V-5B: ``expand_timesteps``). The transformer gets a timestep per latent
  token, [B, tokens]; in text-to-video every token has the step's timestep (the stock pipeline's mask is
  all ones; only image-to-video zeroes the first latent frame's). Its VAE (48 channels, frames patchified
  2x2 before the spatial factor 8: ``vae_scale_factor_spatial`` 16) needs nothing of its own here: the
  geometry reads the VAE's factors and the transformer's ``in_channels``.

Image-to-video checkouts (an image encoder, ``transformer.config.image_dim``, or a transformer taking
more latent channels than the VAE makes) are refused at load, naming what the adapter cannot feed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

from serve_app.policies.base import PRIMARY_EXPERT, DiffusionPolicy, PolicySettings
from serve_app.policies.single_tokenizer import TOKENIZER_SLOT, SingleTokenizer, WanTextProcessor
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

HIGH_NOISE_EXPERT = PRIMARY_EXPERT  # Wan2.2's `transformer`: timesteps at or above the boundary
LOW_NOISE_EXPERT = "transformer_2"  # Wan2.2's `transformer_2`: timesteps below it


def expert_at(timestep: torch.Tensor, boundary_timestep: float | None) -> str:
    """The expert the stock WanPipeline runs at a step of timestep ``t = sigma x num_train_timesteps``
    (a float32 0-d tensor): the high-noise ``transformer`` when ``t >= boundary_timestep`` (every step of a
    one-transformer checkout, whose boundary is None), else the low-noise ``transformer_2``. Compared as
    the stock loop compares, tensor against Python float (in float32), so a timestep on the boundary goes
    to the same expert."""
    if boundary_timestep is None or bool(timestep.to(torch.float32) >= boundary_timestep):
        return HIGH_NOISE_EXPERT
    return LOW_NOISE_EXPERT


def expert_problems(pipeline: Any) -> list[str]:
    """What in a Wan pipeline's experts and boundary no Wan adapter can run, one line each (empty: none)."""
    problems = []
    experts = {name: getattr(pipeline, name, None) for name in (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT)}
    boundary_ratio = pipeline.config.get("boundary_ratio")
    if experts[HIGH_NOISE_EXPERT] is None:
        problems.append("no `transformer` (the high-noise expert; a checkout with only `transformer_2` is not "
                        "supported)")
    if boundary_ratio is not None and experts[LOW_NOISE_EXPERT] is None:
        problems.append(f"boundary_ratio {boundary_ratio} but no `transformer_2`: the low-noise expert the steps "
                        "below the boundary need is missing")
    if boundary_ratio is None and experts[LOW_NOISE_EXPERT] is not None:
        problems.append("a `transformer_2` but no boundary_ratio in model_index.json: nothing says at which "
                        "timestep the low-noise expert takes over")
    if all(expert is not None for expert in experts.values()):
        high, low = (experts[n].config for n in (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT))
        if tuple(high.patch_size) != tuple(low.patch_size) or high.rope_max_seq_len != low.rope_max_seq_len:
            problems.append("`transformer` and `transformer_2` differ in patch_size or rope_max_seq_len: "
                            "one latent geometry must fit both experts")
    return problems


def present_experts(pipeline: Any) -> dict[str, Any]:
    """The pipeline's experts by component name, those it has."""
    found = {name: getattr(pipeline, name, None) for name in (HIGH_NOISE_EXPERT, LOW_NOISE_EXPERT)}
    return {name: expert for name, expert in found.items() if expert is not None}


def unsupported_parts(pipeline: Any) -> list[str]:
    """What in a WanPipeline this text-to-video adapter cannot run, one line each (empty: it runs it)."""
    problems = expert_problems(pipeline)
    if getattr(pipeline, "image_encoder", None) is not None:
        problems.append("an `image_encoder`: image-to-video conditioning is not supported (text-to-video only)")
    z_dim = pipeline.vae.config.z_dim
    for name, expert in present_experts(pipeline).items():
        config = expert.config
        if config.get("image_dim") is not None:
            problems.append(f"{name}.config.image_dim = {config.image_dim}: the transformer expects image "
                            "embeddings (image-to-video), which this text-to-video adapter does not feed")
        if config.in_channels != z_dim or config.out_channels != z_dim:
            problems.append(f"{name}.config in_channels/out_channels = {config.in_channels}/{config.out_channels}, "
                            f"the VAE's z_dim {z_dim}: the transformer takes conditioning latent channels "
                            "(image-to-video) this adapter does not feed")
    return problems


def flow_match_scheduler(scheduler: Any) -> FlowMatchEulerDiscreteScheduler:
    """The flow-matching scheduler whose sigmas the sampler steps through (see the module docstring).

    Raises:
        ValueError: the checkout's scheduler is neither FlowMatchEuler nor a flow-sigma scheduler with
            a ``flow_shift`` (nothing says which flow-matching schedule it was trained for).
    """
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    config = scheduler.config
    if not config.get("use_flow_sigmas", False) or config.get("flow_shift") is None:
        raise ValueError(
            f"Wan needs a flow-matching schedule: the checkout's {type(scheduler).__name__} has neither "
            "FlowMatchEulerDiscreteScheduler's type nor use_flow_sigmas with a flow_shift"
        )
    if config.get("use_dynamic_shifting", False):
        raise ValueError(f"{type(scheduler).__name__} with use_dynamic_shifting is not supported for Wan")
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=config.get("num_train_timesteps", 1000), shift=float(config["flow_shift"])
    )


class WanPolicy(SingleTokenizer, DiffusionPolicy):
    family = "wan"
    pipeline_class = WanPipeline
    cfg_renormalize = False

    supports = "text-to-video Wan2.1 / Wan2.2"  # what the refusal of a checkout names as supported
    unsupported = staticmethod(unsupported_parts)

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype,
                 settings: PolicySettings | None = None) -> None:
        problems = self.unsupported(pipeline)
        if problems:
            raise ValueError(f"this Wan checkout is not supported ({self.supports} are): " + "; ".join(problems))
        super().__init__(pipeline, device=device, dtype=dtype, settings=settings)
        self._flow_scheduler = flow_match_scheduler(pipeline.scheduler)
        ratio = pipeline.config.get("boundary_ratio")
        # The stock loop's boundary: boundary_ratio x the pipeline scheduler's num_train_timesteps.
        self.boundary_timestep: float | None = (
            None if ratio is None else float(ratio) * pipeline.scheduler.config.num_train_timesteps)
        self.expand_timesteps = bool(pipeline.config.get("expand_timesteps", False))

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.vae]

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        """``transformer``, and Wan2.2-A14B's low-noise ``transformer_2`` when the checkout has one."""
        experts = {HIGH_NOISE_EXPERT: self.pipeline.transformer}
        if self.pipeline.transformer_2 is not None:
            experts[LOW_NOISE_EXPERT] = self.pipeline.transformer_2
        return experts

    @property
    def probe_sigmas(self) -> tuple[float, ...]:
        if self.boundary_timestep is None:
            return super().probe_sigmas
        # Half the boundary's sigma lies below it: a step of the low-noise expert.
        return (1.0, 0.5 * self.boundary_timestep / self._flow_scheduler.config.num_train_timesteps)

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep of sigmas: sigma x num_train_timesteps in float32, as the stock
        scheduler's ``timesteps`` are."""
        return sigma.to(torch.float32) * self._flow_scheduler.config.num_train_timesteps

    def expert_at_sigma(self, sigma: float | torch.Tensor) -> str:
        """The expert that takes a step of this sigma (:func:`expert_at` of its timestep)."""
        return expert_at(self.timestep(torch.as_tensor(sigma).cpu()), self.boundary_timestep)

    def guidance_scale_at(self, sigma: torch.Tensor, params: SamplingParams) -> float:
        if self.boundary_timestep is None:
            return super().guidance_scale_at(sigma, params)
        if self.expert_at_sigma(sigma) == LOW_NOISE_EXPERT and params.guidance_scale_2 is not None:
            return params.guidance_scale_2
        return params.guidance_scale

    text_processor_class = WanTextProcessor

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def _patch_size(self) -> tuple[int, int, int]:
        t, h, w = self.pipeline.transformer.config.patch_size
        return int(t), int(h), int(w)

    @property
    def spatial_multiple(self) -> int:
        return int(self.pipeline.vae_scale_factor_spatial) * self._patch_size[1]

    @property
    def temporal_factor(self) -> int:
        return int(self.pipeline.vae_scale_factor_temporal)

    @property
    def temporal_patch(self) -> int:
        return self._patch_size[0]

    @property
    def max_tokens_per_axis(self) -> int:
        # WanRotaryPosEmbed precomputes rope_max_seq_len positions per axis (time, height, width).
        return int(self.pipeline.transformer.config.rope_max_seq_len)

    @property
    def max_frames(self) -> int:
        latent_frames = self.max_tokens_per_axis * self.temporal_patch
        return (latent_frames - 1) * self.temporal_factor + 1

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        factor = int(self.pipeline.vae_scale_factor_spatial)
        channels = self.pipeline.transformer.config.out_channels  # image-to-video takes more channels in
        return (channels, self.geometry.latent_frames(num_frames), height // factor, width // factor)

    @property
    def schedule_source(self) -> FlowMatchEulerDiscreteScheduler:
        return self._flow_scheduler

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        scheduler.set_timesteps(num_steps, device="cpu")  # a fixed shift: no dependence on the size

    # -- model calls -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        return self.embed_prompts(prompts)

    def embed_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """encode_prompts with autograd on: pretraining trains the text encoder through it."""
        if not prompts or any(TOKENIZER_SLOT not in p.token_ids for p in prompts):
            raise ValueError(f"Wan needs token ids for {TOKENIZER_SLOT!r} (use the family's TextProcessor)")
        length = self.max_sequence_length
        ids = [p.token_ids[TOKENIZER_SLOT][:length] for p in prompts]
        pad_id = self.pipeline.tokenizer.pad_token_id or 0
        input_ids = torch.full((len(ids), length), pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, x in enumerate(ids):  # right padding to the full length, as the stock tokenizer call pads
            input_ids[row, : len(x)] = x
            attention_mask[row, : len(x)] = 1
        encoder = self.pipeline.text_encoder
        hidden = encoder(input_ids.to(self.device), attention_mask.to(self.device)).last_hidden_state.to(encoder.dtype)
        width = max(max(len(x) for x in ids), 1)
        mask = attention_mask[:, :width].bool().to(self.device)
        # States past a prompt's tokens are zeros in the stock pipeline (it keeps u[:seq_len] and pads).
        embeds = torch.where(mask[..., None], hidden[:, :width], torch.zeros((), dtype=hidden.dtype, device=hidden.device))
        return PromptEmbeds(embeds.to(self.dtype), mask)

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        embeds = cond.embeds.to(self.dtype)
        # The transformer attends to every one of the max_sequence_length positions, zeros included.
        padding = self.max_sequence_length - embeds.shape[1]
        if padding < 0:
            raise ValueError(f"prompt embeddings of {embeds.shape[1]} tokens exceed max_sequence_length "
                             f"{self.max_sequence_length}")
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, padding))
        # The stock loop passes the scheduler's timesteps: sigma x num_train_timesteps in float32.
        timestep = self.timestep(sigma.to(latents.device))
        hidden, extra = self._transformer_inputs(latents.to(self.dtype), cond)
        if self.boundary_timestep is None:
            return self._expert_forward(self.pipeline.transformer, hidden, timestep, embeds, extra)
        # Each row runs the expert of its own timestep (in a batch they all share one).
        high = timestep >= self.boundary_timestep
        if bool(high.all()) or not bool(high.any()):
            expert = self.pipeline.transformer if bool(high.all()) else self.pipeline.transformer_2
            return self._expert_forward(expert, hidden, timestep, embeds, extra)
        rows = [high.nonzero()[:, 0], (~high).nonzero()[:, 0]]
        parts = [self._expert_forward(expert, hidden[r], timestep[r], embeds[r], {k: v[r] for k, v in extra.items()})
                 for expert, r in zip((self.pipeline.transformer, self.pipeline.transformer_2), rows)]
        return torch.cat(parts)[torch.argsort(torch.cat(rows))]

    def _transformer_inputs(self, latents: torch.Tensor, cond: PromptEmbeds
                            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the transformer's hidden_states, its other per-row inputs) for latents [B, C, F', H', W'] in the
        policy's dtype: text-to-video feeds the latents alone."""
        return latents, {}

    def _expert_forward(self, expert: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                        embeds: torch.Tensor, extra: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert's output for inputs [B, C_in, F', H', W'] at timesteps [B]; with expand_timesteps the
        transformer gets [B, tokens], every token at its row's timestep (text-to-video: no conditioning frame)."""
        if self.expand_timesteps:
            t, h, w = self._patch_size
            tokens = (latents.shape[2] // t) * (latents.shape[3] // h) * (latents.shape[4] // w)
            timestep = timestep[:, None].expand(-1, tokens)
        return expert(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False,
                      **extra)[0]

    @torch.no_grad()
    def encode_videos(self, videos: torch.Tensor) -> torch.Tensor:
        """Videos [B, F, 3, H, W] in [0, 1] -> normalised latents [B, C, F', H', W']; decode's inverse
        (exactly so for a pixel-space VAE). Uses the VAE posterior's mode."""
        vae = self.pipeline.vae
        pixels = videos.to(self.device, vae.dtype).transpose(1, 2) * 2.0 - 1.0  # the pipeline's [B, 3, F, H, W]
        latents = vae.encode(pixels).latent_dist.mode()
        mean, inv_std = self._latent_statistics(latents)
        return (latents - mean) * inv_std

    def _latent_statistics(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latents_mean and 1 / latents_std, shaped to broadcast over [B, C, F', H', W']."""
        vae = self.pipeline.vae
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        return mean, inv_std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        """Videos [B, F, 3, H, W] float in [0, 1] from latents [B, C, F', H', W']."""
        pipe = self.pipeline
        vae = pipe.vae
        z = latents.to(vae.dtype)
        mean, inv_std = self._latent_statistics(z)
        # Divided by the reciprocal, as the stock pipeline does, so the rounding is the same.
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        cfg = params.guidance_scale > 1
        return self.pipeline(
            prompt=prompt, negative_prompt=params.negative_prompt if cfg else None, guidance_scale=params.guidance_scale,
            guidance_scale_2=params.guidance_scale_2,
            height=params.height, width=params.width, num_frames=params.num_frames, num_inference_steps=params.num_steps,
            max_sequence_length=self.max_sequence_length, latents=latents.clone(), num_videos_per_prompt=len(latents),
            output_type="pt",
        ).frames
