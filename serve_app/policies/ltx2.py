"""LTX-2 text-to-video: a Gemma 3 text encoder whose every layer's states feed two text connectors, an
LTX2VideoTransformer3DModel that denoises video and audio latents together (each attends to the other), the
LTX-2 video VAE; the audio VAE and vocoder turn the audio latents into sound.

Mirrors the stock ``LTX2Pipeline.__call__`` (diffusers 0.42) with plain true CFG:

* Prompts are stripped, tokenized and padded on the LEFT to ``max_sequence_length`` (1024, capped by the
  tokenizer's own limit); the encoder's hidden states of every layer are stacked and the connectors turn them
  into a video and an audio text sequence, the padding replaced by learned registers (so every position
  conditions the transformer). Both sequences travel in ``PromptEmbeds.embeds``, joined along the features.
* The state a sample moves through is the video AND the audio latents: the transformer predicts a velocity for
  both, and the stock loop steps both with the same sigma. A sample's latent here is the two packed sequences
  flattened and joined, ``[video tokens x video features + audio frames x audio features]``; the SDE perturbs
  all of it, so the log-probability of a step covers the video and the audio latents together (the policy RL
  trains is the joint one). Rewards see the video; the audio latents are in the trajectory, and the rollout does
  not decode them to sound.
* True CFG is one scale for both modalities (the stock ``audio_guidance_scale`` set to ``guidance_scale``), with
  no spatio-temporal guidance, no modality-isolation guidance and no guidance rescale: ``stock_call`` turns the
  stock defaults for those (LTX-2.3's recommended values) off. The stock loop combines in x0 space
  (``x0 = x - sigma v``, then back to a velocity): the same velocity up to float rounding.
* The schedule is ``linspace(1, 1/N, N)`` shifted by mu = calculate_shift(video tokens) (so it depends on the
  frame count too); the transformer gets ``t = sigma x 1000`` as both its timestep and its sigma, and rotary
  coordinates at the stock frame rate (24 fps), which also sets the audio's length.
* The video decodes as the stock pipeline decodes it (un-normalised with the VAE's latents_mean / latents_std /
  scaling_factor; a timestep-conditioned VAE at decode timestep 0).

Refused at load: connectors without learned registers (their text mask would be left-padded) and transformer
patch sizes other than 1 (the stock pipeline packs LTX-2's latents one token per latent pixel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from diffusers import LTX2Pipeline
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

from serve_app.config.sampling import MAX_IMAGE_SIDE, SamplingParams
from serve_app.policies.base import DiffusionPolicy, PolicySettings
from serve_app.policies.single_tokenizer import LTX2TextProcessor, SingleTokenizer, padded_ids
from serve_app.schemas import PromptEmbeds, PromptTokens

FRAME_RATE = 24.0  # the stock `frame_rate`: rotary time coordinates and the audio's length follow it
MAX_SECONDS = 20.0  # the stock `max_seconds`: the longest clip the pipeline plans for
USE_CROSS_TIMESTEP = True  # the stock default: cross-modal attention modulated by the other modality's sigma


def unsupported_parts(pipeline: Any) -> list[str]:
    """What in an LTX2Pipeline this adapter cannot run, one line each (empty: it runs it)."""
    problems = []
    for name in ("video_connector", "audio_connector"):
        if getattr(pipeline.connectors, name).learnable_registers is None:
            problems.append(f"connectors.{name} has no learnable registers: its text mask would keep the left "
                            "padding, which the prompt embeddings' right-trimmed layout cannot carry")
    config = pipeline.transformer.config
    if config.patch_size != 1 or config.patch_size_t != 1:
        problems.append(f"transformer patch_size {config.patch_size} / patch_size_t {config.patch_size_t}: the "
                        "stock pipeline samples LTX-2 latents one token per latent pixel (1 / 1)")
    return problems


class JointLatents(NamedTuple):
    """One batch's flat latents split into what the transformer takes."""

    video: torch.Tensor  # [B, sampled frames x rows x columns, video features], packed as the stock pipeline packs
    audio: torch.Tensor  # [B, audio frames, audio features]
    grid: tuple[int, int, int]  # (latent frames, rows, columns) of the video
    audio_frames: int


class LTX2Policy(SingleTokenizer, DiffusionPolicy):
    family = "ltx2"
    pipeline_class = LTX2Pipeline
    cfg_renormalize = False
    # Latent frames a prompt gives instead of the sampler (image-to-video: the first); they lead the video's tokens.
    given_frames: ClassVar[int] = 0

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype,
                 settings: PolicySettings | None = None) -> None:
        problems = unsupported_parts(pipeline)
        if problems:
            raise ValueError("this LTX-2 checkout is not supported: " + "; ".join(problems))
        super().__init__(pipeline, device=device, dtype=dtype, settings=settings)
        self._video_text_dim = int(pipeline.connectors.video_connector.inner_dim)

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.connectors, pipeline.vae, pipeline.audio_vae, pipeline.vocoder]

    text_processor_class = LTX2TextProcessor

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def spatial_multiple(self) -> int:
        return int(self.pipeline.vae_spatial_compression_ratio)

    @property
    def temporal_factor(self) -> int:
        return int(self.pipeline.vae_temporal_compression_ratio)

    @property
    def max_tokens_per_axis(self) -> int:
        # Rotary coordinates are computed per call from the latent grid: no table bounds the size.
        return MAX_IMAGE_SIDE // self.spatial_multiple

    @property
    def max_frames(self) -> int:
        return int(MAX_SECONDS * FRAME_RATE) // self.temporal_factor * self.temporal_factor + 1

    def _grid(self, height: int, width: int, num_frames: int) -> tuple[int, int, int]:
        side = self.spatial_multiple
        return (num_frames - 1) // self.temporal_factor + 1, height // side, width // side

    def audio_frames(self, num_frames: int) -> int:
        """Audio latent frames of a num_frames clip, computed as the stock pipeline computes them."""
        pipe = self.pipeline
        duration_s = num_frames / FRAME_RATE
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(duration_s * per_second)

    @property
    def _video_features(self) -> int:
        return int(self.pipeline.transformer.config.in_channels)

    @property
    def _audio_features(self) -> int:
        audio_vae = self.pipeline.audio_vae.config
        mel_bins = int(audio_vae.mel_bins) // int(self.pipeline.audio_vae_mel_compression_ratio)
        return int(audio_vae.latent_channels) * mel_bins

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        frames, rows, columns = self._grid(height, width, num_frames)
        sampled = max(frames - self.given_frames, 0) * rows * columns
        return (sampled * self._video_features + self.audio_frames(num_frames) * self._audio_features,)

    def split(self, latents: torch.Tensor, *, height: int, width: int) -> JointLatents:
        """Flat latents [B, n] -> the sampled video and the audio sequences. The frame count is the one whose
        latents have n values (n grows with it, so exactly one does)."""
        n = latents.shape[-1]
        for num_frames in range(1, self.max_frames + 1, self.temporal_factor):
            if self.latent_shape(height, width, num_frames)[0] == n:
                grid = self._grid(height, width, num_frames)
                audio_frames = self.audio_frames(num_frames)
                cut = n - audio_frames * self._audio_features
                return JointLatents(latents[:, :cut].reshape(len(latents), -1, self._video_features),
                                    latents[:, cut:].reshape(len(latents), audio_frames, self._audio_features),
                                    grid, audio_frames)
        raise ValueError(f"latents of {n} values are no {height}x{width} LTX-2 clip's video and audio latents")

    @staticmethod
    def join(video: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """split's inverse: [B, Nv, Dv] and [B, Na, Da] -> [B, Nv Dv + Na Da]."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def sigma_schedule_shift(self, height: int, width: int, num_frames: int) -> float:
        """The stock pipeline's mu: calculate_shift of the clip's video tokens."""
        config = self.pipeline.scheduler.config
        frames, rows, columns = self._grid(height, width, num_frames)
        return calculate_shift(frames * rows * columns, config.get("base_image_seq_len", 1024),
                               config.get("max_image_seq_len", 4096), config.get("base_shift", 0.95),
                               config.get("max_shift", 2.05))

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps),
                                mu=self.sigma_schedule_shift(height, width, num_frames), device="cpu")

    # -- model calls -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """Left-padded token ids -> every encoder layer's states -> the connectors' video and audio sequences,
        joined along the features (video first)."""
        pipe = self.pipeline
        tokenizer = pipe.tokenizer
        # The stock pipeline pads on the left whatever the tokenizer's side, with the EOS id if it has no pad id.
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids, attention = padded_ids(prompts, self.max_sequence_length, pad_id, left=True)
        ids, attention = ids.to(self.device), attention.to(self.device)
        states = pipe.text_encoder(input_ids=ids, attention_mask=attention, output_hidden_states=True).hidden_states
        stacked = torch.stack(states, dim=-1).flatten(2, 3).to(pipe.text_encoder.dtype)
        video_text, audio_text, mask = pipe.connectors(stacked, attention, padding_side="left")
        return PromptEmbeds(torch.cat([video_text, audio_text], dim=-1).to(self.dtype), mask.bool())

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep of sigmas: sigma x num_train_timesteps in float32, as the scheduler's."""
        return sigma.to(torch.float32) * self.pipeline.scheduler.config.num_train_timesteps

    def given_tokens(self, cond: PromptEmbeds | None) -> torch.Tensor | None:
        """[B, tokens, video features] of the latent frames the prompts give (None: the sampler makes every frame)."""
        return None

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        pipe = self.pipeline
        transformer = pipe.transformer
        joint = self.split(latents, height=height, width=width)
        batch, (frames, rows, columns) = len(latents), joint.grid
        embeds = cond.embeds.to(self.dtype)
        mask = cond.mask.to(torch.int64)
        timestep = self.timestep(sigma.to(latents.device))
        video, video_timestep = joint.video, timestep
        given = self.given_tokens(cond)
        if given is not None:  # clean tokens, at timestep 0, as the stock conditioning mask sets them
            video = torch.cat([given.to(video.dtype), video], dim=1)
            video_timestep = torch.cat([timestep.new_zeros(batch, given.shape[1]),
                                        timestep[:, None].expand(-1, joint.video.shape[1])], dim=1)
        video_velocity, audio_velocity = transformer(
            hidden_states=video.to(self.dtype), audio_hidden_states=joint.audio.to(self.dtype),
            encoder_hidden_states=embeds[..., : self._video_text_dim],
            audio_encoder_hidden_states=embeds[..., self._video_text_dim:],
            timestep=video_timestep, audio_timestep=timestep, sigma=timestep, encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask, num_frames=frames, height=rows, width=columns, fps=FRAME_RATE,
            audio_num_frames=joint.audio_frames,
            video_coords=transformer.rope.prepare_video_coords(batch, frames, rows, columns, latents.device,
                                                               fps=FRAME_RATE),
            audio_coords=transformer.audio_rope.prepare_audio_coords(batch, joint.audio_frames, latents.device),
            use_cross_timestep=USE_CROSS_TIMESTEP, return_dict=False,
        )
        return self.join(video_velocity[:, video.shape[1] - joint.video.shape[1]:], audio_velocity)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        """Videos [B, F, 3, H, W] float in [0, 1] from the joint latents' video part (after the given frames)."""
        pipe = self.pipeline
        vae = pipe.vae
        joint = self.split(latents, height=height, width=width)
        video = joint.video
        if self.given_frames:
            given = self.given_tokens(cond)
            if given is None:
                raise ValueError(f"{self.family} decodes its samples after the frames their prompts give: pass cond")
            video = torch.cat([given.to(video.dtype), video], dim=1)
        z = pipe._unpack_latents(video, *joint.grid).to(self.dtype)
        timestep = None
        if vae.config.timestep_conditioning:  # the stock decode_timestep 0, whose noise scale 0 adds no noise
            timestep = torch.zeros(len(z), device=z.device, dtype=z.dtype)
        z = pipe._denormalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        frames = vae.decode(z.to(vae.dtype), timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(frames, output_type="pt")

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor) -> torch.Tensor:
        return self._stock_frames(prompt, params, latents)

    def _stock_frames(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                      given: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
        """The stock call from our initial latents (after `given` [tokens, features] video tokens, image-to-video's
        first frame). The pipeline takes latents unpacked ([B, C, F', H', W'] and [B, C, L, M]) and normalises
        them as VAE latents, so each part goes in un-normalised: the pipeline then starts from ours, up to one
        rounding. `inputs`: the pipeline's other arguments (its image)."""
        pipe = self.pipeline
        vae, audio_vae = pipe.vae, pipe.audio_vae
        joint = self.split(latents, height=params.height, width=params.width)
        tokens = joint.video
        if given is not None:
            tokens = torch.cat([given.to(tokens.dtype).expand(len(latents), -1, -1), tokens], dim=1)
        video = pipe._denormalize_latents(pipe._unpack_latents(tokens, *joint.grid), vae.latents_mean,
                                          vae.latents_std, vae.config.scaling_factor)
        audio = pipe._unpack_audio_latents(
            pipe._denormalize_audio_latents(joint.audio, audio_vae.latents_mean, audio_vae.latents_std),
            joint.audio_frames, num_mel_bins=self._audio_features // int(audio_vae.config.latent_channels))
        cfg = params.guidance_scale > 1
        return pipe(
            prompt=prompt, negative_prompt=params.negative_prompt if cfg else None,
            height=params.height, width=params.width, num_frames=params.num_frames, frame_rate=FRAME_RATE,
            num_inference_steps=params.num_steps, guidance_scale=params.guidance_scale,
            audio_guidance_scale=params.guidance_scale, stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0,
            audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
            use_cross_timestep=USE_CROSS_TIMESTEP, max_sequence_length=self.max_sequence_length,
            latents=video, audio_latents=audio, num_videos_per_prompt=len(latents), output_type="pt", **inputs,
        ).frames
