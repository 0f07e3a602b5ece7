"""FLUX.2: a chat-templated LLM text encoder (several of its layers' hidden states stacked along the features), a
Flux2Transformer2DModel over 2x2-patchified latents with four-axis rotary position ids, FLUX.2's VAE with
BatchNorm-normalised latents.

Mirrors the stock ``Flux2Pipeline.__call__`` (FLUX.2 [dev]) and ``Flux2KleinPipeline.__call__`` (FLUX.2 [klein])
of diffusers 0.42, text to image:

* Text. [dev]: the prompt (``[IMG]`` removed, as ``format_input`` does) is the user turn after the pipeline's
  system message (``SYSTEM_MESSAGE``) in the tokenizer's chat template, no generation prompt, tokenized without
  special tokens. [klein]: one user turn with the generation prompt and ``enable_thinking=False``, tokenized with
  the tokenizer's defaults. Both are truncated and padded (on the tokenizer's side, with its pad id) to
  ``max_sequence_length`` (512, capped here by the tokenizer's own limit); the encoder sees the attention mask,
  and the hidden states of layers (10, 20, 30) [dev] / (9, 18, 27) [klein] are joined along the features. Every
  position, padding included, conditions the transformer (it takes no text mask); text position ids are
  (0, 0, 0, position).
* Latents [B, (H/2f)(W/2f), 4C] are the VAE's latents patchified 2x2 and flattened row-major, the stock's packing;
  image position ids are (0, row, column, 0).
* The schedule is ``linspace(1, 1/N, N)`` shifted by mu = ``compute_empirical_mu(image tokens, N)`` (FLUX.2's own
  fit, which depends on the step count too); the transformer gets ``timestep / 1000`` of the scheduler's timesteps.
* [dev] is guidance-distilled: the pipeline's ``guidance_scale`` is an input of the model, here
  :attr:`Flux2Policy.distilled_guidance` (model.distilled_guidance; the stock default 4.0), not a request's.
  ``Flux2Pipeline`` has no true CFG and no negative prompt. SamplingParams.guidance_scale > 1 is true CFG on top
  (negative + w (cond - negative), no renormalisation), as FLUX.1 [dev]'s ``true_cfg_scale`` is; ``stock_call``
  runs it through the stock loop (see :meth:`Flux2Policy.stock_call`).
* [klein] base runs true CFG itself (guidance_scale > 1, the same combination), with the empty prompt as its only
  negative; ``stock_call`` gives it the request's negative prompt as ``negative_prompt_embeds``. A step-distilled
  klein checkout (``is_distilled``) ignores guidance in the stock pipeline: here it refuses a guidance_scale > 1.
* Reference images (the stock ``image`` argument: none, one or several a prompt): each as sent must be at least
  64 px a side with an aspect ratio of at most 8 (``check_image_input``); one larger than 1024 x 1024 px is resized
  (Lanczos) to about that area, and each is center-cropped to sides floored to the VAE factor x 2 - the ingress does
  it (:class:`Flux2ImageGeometry`). Their latents are the posterior's mode, patchified and BatchNorm-normalised,
  packed; their position ids are (10 + 10 i, row, column, 0) for the prompt's i-th image. The transformer sees
  [noisy latents ; reference latents] and its output is cut to the noisy tokens; true CFG runs the negative prompt
  over the same references. The text encoder never sees them.
* Decoding un-normalises with the VAE's BatchNorm running statistics, un-patchifies and decodes.

Not mirrored: the dev pipeline's caption upsampling (``caption_upsample_temperature``: the text encoder rewriting
the prompt by sampling, the only place its vision tower would see the reference images).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from serve_app.config.sampling import MAX_IMAGE_SIDE, SamplingParams
from serve_app.errors import InvalidRequestError
from serve_app.media import resize_image, to_pil
from serve_app.policies.base import (
    ImageGeometry,
    PackedLatentPolicy,
    PolicySettings,
    per_input_image_shapes,
    stack_padded,
)
from serve_app.policies.single_tokenizer import (
    TOKENIZER_SLOT,
    Flux2KleinTextProcessor,
    Flux2TextProcessor,
    SingleTokenizer,
    padded_ids,
    text_tokenizer,
)
from serve_app.schemas import PromptEmbeds, PromptTokens

DEFAULT_DISTILLED_GUIDANCE = 4.0  # Flux2Pipeline's `guidance_scale` default
# Reference images: the area the pipelines shrink a larger one to (a literal of their __call__), and the limits of
# Flux2ImageProcessor.check_image_input's defaults on an image as sent.
STOCK_INPUT_IMAGE_AREA = 1024 * 1024
MIN_INPUT_IMAGE_SIDE = 64
MAX_INPUT_IMAGE_ASPECT = 8
# Reference images a prompt may take: BFL's figure for FLUX.2 [dev], assumed for [klein] (the pipelines set none).
MAX_REFERENCE_IMAGES = 10
REFERENCE_TIME_STEP = 10  # the pipelines' `_prepare_image_ids` scale: reference i sits at time 10 + 10 i


@dataclass(frozen=True)
class Flux2ImageGeometry(ImageGeometry):
    """FLUX.2's reference-image sizing: no area rule, but a cap - an image larger than ``input_image_area`` is
    resized (Lanczos) to about that area, sides truncated to whole pixels (``_resize_to_target_area``) - and a
    center crop to sides floored to ``input_image_multiple`` (the pipelines' VAE factor x 2)."""

    def input_image_size(self, height: int, width: int, field: str = "images") -> tuple[int, int]:
        self._check_as_sent(height, width, field)
        capped_height, capped_width = self._capped(height, width)
        m = self.input_image_multiple
        size = (capped_height // m * m, capped_width // m * m)
        if min(size) == 0 or max(size) > self.max_side:
            raise InvalidRequestError(
                f"an input image of {height}x{width} crops to {size[0]}x{size[1]} for {self.family} (input area "
                f"{self.input_image_area} px), which the model cannot take (sides from {m} to {self.max_side})", field)
        return size

    def resize_input_image(self, image: torch.Tensor, field: str = "images") -> torch.Tensor:
        height, width = self.input_image_size(int(image.shape[-2]), int(image.shape[-1]), field)
        capped = resize_image(image, *self._capped(int(image.shape[-2]), int(image.shape[-1])))
        top, left = (capped.shape[-2] - height) // 2, (capped.shape[-1] - width) // 2
        return capped[:, top:top + height, left:left + width].contiguous()

    def _capped(self, height: int, width: int) -> tuple[int, int]:
        """The size an image of height x width is resized to before the crop (its own when within the area)."""
        if height * width <= self.input_image_area:
            return height, width
        scale = math.sqrt(self.input_image_area / (width * height))
        return int(height * scale), int(width * scale)

    def _check_as_sent(self, height: int, width: int, field: str) -> None:
        if min(height, width) < MIN_INPUT_IMAGE_SIDE:
            raise InvalidRequestError(f"an input image of {height}x{width} is too small for {self.family}: its "
                                      f"pipeline takes sides of at least {MIN_INPUT_IMAGE_SIDE} px", field)
        if max(height / width, width / height) > MAX_INPUT_IMAGE_ASPECT:
            raise InvalidRequestError(f"an input image of {height}x{width} is too elongated for {self.family}: its "
                                      f"pipeline takes aspect ratios up to {MAX_INPUT_IMAGE_ASPECT}:1", field)


class Flux2Policy(SingleTokenizer, PackedLatentPolicy):
    family = "flux2"
    pipeline_class = Flux2Pipeline
    cfg_renormalize = False
    text_processor_class: ClassVar[type[Flux2TextProcessor]] = Flux2TextProcessor
    hidden_state_layers: ClassVar[tuple[int, ...]] = (10, 20, 30)  # the stock `text_encoder_out_layers`
    input_images: ClassVar[tuple[int, int]] = (0, MAX_REFERENCE_IMAGES)
    input_image_area: int = STOCK_INPUT_IMAGE_AREA

    def __init__(self, pipeline: Any, *, device: torch.device, dtype: torch.dtype,
                 settings: PolicySettings | None = None) -> None:
        depth = int(pipeline.text_encoder.config.get_text_config().num_hidden_layers)
        if max(self.hidden_state_layers) > depth:
            raise ValueError(f"the text encoder has {depth} layers; {self.family} conditions on the hidden states of "
                             f"layers {self.hidden_state_layers}, as its pipeline does")
        super().__init__(pipeline, device=device, dtype=dtype, settings=settings)
        given = self.settings.distilled_guidance
        self.distilled_guidance = DEFAULT_DISTILLED_GUIDANCE if given is None else given

    @staticmethod
    def _frozen_modules(pipeline: Any) -> list[torch.nn.Module]:
        return [pipeline.text_encoder, pipeline.vae]

    # -- geometry and schedule -------------------------------------------------------------

    @property
    def max_tokens_per_axis(self) -> int:
        # Rotary embeddings are computed from the position ids on every call: no table bounds the size.
        return MAX_IMAGE_SIDE // self.spatial_multiple

    @property
    def geometry(self) -> Flux2ImageGeometry:
        # The pipelines crop reference images to multiples of their VAE factor x 2.
        return Flux2ImageGeometry(**{**vars(super().geometry), "input_image_multiple": self.spatial_multiple})

    def _set_timesteps(self, scheduler: Any, num_steps: int, height: int, width: int, num_frames: int = 1) -> None:
        mu = compute_empirical_mu(image_seq_len=self.latent_shape(height, width)[0], num_steps=num_steps)
        if scheduler.config.get("use_flow_sigmas", False):
            scheduler.set_timesteps(num_steps, mu=mu, device="cpu")
        else:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps), mu=mu, device="cpu")

    # -- model calls -------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """The encoder's hidden states of :attr:`hidden_state_layers` at every position, joined along the features,
        and each prompt's reference images (uint8 [3, h, w], already at their conditioning size) as packed latents:
        for every prompt, none for a prompt without any, when some prompt of the set has reference images."""
        text = self._encode_text(prompts)
        if not any(p.images for p in prompts):
            return text
        for i, p in enumerate(prompts):
            self.geometry.check_input_image_count(len(p.images), f"prompts[{i}].images")
        channels = int(self.transformer.config.in_channels)
        latents = [torch.cat([self.encode_image(image) for image in p.images]) if p.images
                   else torch.zeros(0, channels, device=self.device, dtype=self.dtype) for p in prompts]
        side = self.spatial_multiple
        # [P, most images, 3]: a prompt with fewer images than another is padded with (0, 0, 0) shapes.
        shapes = stack_padded([torch.tensor([(1, image.shape[-2] // side, image.shape[-1] // side)
                                             for image in p.images], dtype=torch.long).reshape(-1, 3) for p in prompts])
        return PromptEmbeds(text.embeds, text.mask, image_latents=stack_padded(latents).to(self.dtype),
                            image_shapes=shapes.to(self.device))

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor) -> torch.Tensor:
        """A reference image, uint8 [3, h, w] at its conditioning size -> packed latents [tokens, 4C]: the posterior's
        mode, patchified and BatchNorm-normalised, as the pipelines' ``_encode_vae_image`` does."""
        pipe = self.pipeline
        vae = pipe.vae
        self.check_size(int(image.shape[-2]), int(image.shape[-1]))
        pixels = (image[None].to(self.device, torch.float32) / 255.0 * 2.0 - 1.0).to(vae.dtype)
        # The pipeline's image comes from an H x W x C array: channels-last, which convolutions round otherwise.
        pixels = pixels.contiguous(memory_format=torch.channels_last)
        latents = pipe._patchify_latents(vae.encode(pixels).latent_dist.mode())
        mean, std = self._latent_statistics(latents)
        return pipe._pack_latents((latents - mean) / std)[0].to(self.dtype)

    def encoder_inputs(self, prompts: Sequence[PromptTokens]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids [P, max_sequence_length] and their attention mask, padded on the tokenizer's side with its pad
        id, as the stock tokenizer call pads them."""
        tokenizer = text_tokenizer(self.pipeline.tokenizer)
        return padded_ids(prompts, self.max_sequence_length, tokenizer.pad_token_id,
                          left=tokenizer.padding_side == "left")

    def _encode_text(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        if not prompts or any(TOKENIZER_SLOT not in p.token_ids for p in prompts):
            raise ValueError(f"{self.family} needs token ids for `tokenizer` (use the family's TextProcessor)")
        encoder = self.pipeline.text_encoder
        ids, mask = (t.to(self.device) for t in self.encoder_inputs(prompts))
        # The base model alone: the stock call's logits over the vocabulary are never used.
        states = encoder.model(input_ids=ids, attention_mask=mask, output_hidden_states=True,
                               use_cache=False).hidden_states
        embeds = torch.cat([states[k] for k in self.hidden_state_layers], dim=-1).to(encoder.dtype)
        # The transformer takes no text mask: padding conditions it as much as the prompt.
        every = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return PromptEmbeds(embeds.to(self.dtype), every)

    def _image_ids(self, height: int, width: int) -> torch.Tensor:
        """[tokens, 4] rotary position ids of an image's tokens: (0, row, column, 0), as the pipeline makes them."""
        side = self.spatial_multiple
        return self.pipeline._prepare_latent_ids(torch.empty(1, 0, height // side, width // side))[0].to(self.device)

    def _reference_ids(self, shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        """[tokens, 4] position ids of a prompt's reference images of (frames, rows, columns) tokens, in order:
        (10 + 10 i, row, column, 0), as the pipeline's ``_prepare_image_ids`` makes them."""
        if not shapes:
            return torch.zeros(0, 4, dtype=torch.long, device=self.device)
        grids = [torch.empty(1, 0, rows, columns) for _, rows, columns in shapes]
        return self.pipeline._prepare_image_ids(grids, scale=REFERENCE_TIME_STEP)[0].to(self.device)

    def _guidance(self, batch: int, device: torch.device) -> torch.Tensor | None:
        """The guidance embedding's input: the distilled guidance for a transformer that has one."""
        if not self.pipeline.transformer.config.guidance_embeds:
            return None
        return torch.full((batch,), self.distilled_guidance, device=device, dtype=torch.float32)

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        """The transformer over the latents, after them each sample's reference latents (their output cut off).
        Samples whose reference images differ in number or size run in separate forwards."""
        ids = self._image_ids(height, width)
        if not cond.has_images:
            return self._transformer(latents, sigma, cond.embeds, ids)
        references = cond.image_latents

        def run(rows: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
            def pick(t: torch.Tensor) -> torch.Tensor:
                return t if rows is None else t[rows]

            tokens = sum(f * h * w for f, h, w in shapes)
            noisy = pick(latents)
            hidden = torch.cat([noisy, pick(references)[:, :tokens].to(noisy.dtype)], dim=1)
            out = self._transformer(hidden, pick(sigma), pick(cond.embeds), torch.cat([ids, self._reference_ids(shapes)]))
            return out[:, : latents.shape[1]]

        return per_input_image_shapes(cond, run)

    def _transformer(self, hidden: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
                     img_ids: torch.Tensor) -> torch.Tensor:
        """One forward over `hidden` [B, tokens, C] (the latents, and any reference latents after them)."""
        pipe = self.pipeline
        embeds = embeds.to(self.dtype)
        text_ids = pipe._prepare_text_ids(embeds[:1])[0].to(hidden.device)
        # The stock loop passes the scheduler's timestep (sigma x 1000, float32) in the latents' dtype, divided by
        # 1000; the same rounding keeps noise 0 equal to it.
        timestep = (sigma.to(device=hidden.device, dtype=torch.float32)
                    * pipe.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        return pipe.transformer(
            hidden_states=hidden.to(self.dtype), timestep=timestep, guidance=self._guidance(len(hidden), hidden.device),
            encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=img_ids, return_dict=False,
        )[0]

    def _patchified(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents [B, tokens, 4C] -> the pipeline's patchified [B, 4C, H/2f, W/2f] (tokens are row-major)."""
        side = self.spatial_multiple
        return latents.transpose(1, 2).reshape(len(latents), -1, height // side, width // side)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, *, height: int, width: int,
               cond: PromptEmbeds | None = None) -> torch.Tensor:
        pipe = self.pipeline
        vae = pipe.vae
        z = self._patchified(latents, height, width)
        mean, std = self._latent_statistics(z)
        z = pipe._unpatchify_latents(z * std + mean)
        images = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(images, output_type="pt")

    def _latent_statistics(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE BatchNorm's running mean and std (sqrt(var + eps)) [1, 4C, 1, 1] of patchified latents, on the
        device and in the dtype of `like`."""
        vae = self.pipeline.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
        return mean, std

    def _stock_kwargs(self, params: SamplingParams, images: Sequence[torch.Tensor]) -> dict[str, Any]:
        self.geometry.check_input_image_count(len(images), "images")
        return dict(image=self._stock_images(images), height=params.height, width=params.width,
                    num_inference_steps=params.num_steps, max_sequence_length=self.max_sequence_length,
                    text_encoder_out_layers=self.hidden_state_layers, output_type="pt")

    def _stock_images(self, images: Sequence[torch.Tensor]) -> list[Any] | None:
        """Reference images as sent, as PIL images for the pipeline (which resizes and crops them). Its 1024 x 1024
        cap is a literal of its __call__: at a smaller ``input_image_area`` each image goes in already resized to
        that area by the pipeline's own resize, which leaves the pipeline only the crop."""
        if not images:
            return None
        if self.input_image_area > STOCK_INPUT_IMAGE_AREA:
            raise ValueError(f"the stock pipeline shrinks reference images to {STOCK_INPUT_IMAGE_AREA} px; it cannot "
                             f"run at the input area {self.input_image_area}")
        resize = self.pipeline.image_processor._resize_if_exceeds_area
        return [resize(to_pil(image), self.input_image_area) for image in images]

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock call from our initial latents (given patchified, as the pipeline takes them), its
        ``guidance_scale`` the distilled guidance, on reference `images` (uint8 [3, H, W] as sent).

        ``Flux2Pipeline`` has no negative prompt. With true CFG (params.guidance_scale > 1) the stock loop runs the
        prompt and the negative prompt as one batch of 2B (``prompt_embeds``, from the stock ``encode_prompt``), both
        from the same latents, and after every step a ``callback_on_step_end`` sets both halves to
        ``negative + w (prompt - negative)`` of the stepped latents: the Euler step is linear in the velocity, so
        that is the step of the CFG velocity, up to float rounding."""
        pipe = self.pipeline
        start = self._patchified(latents, params.height, params.width).clone()
        common = dict(guidance_scale=self.distilled_guidance, **self._stock_kwargs(params, images))
        if params.guidance_scale <= 1:
            return pipe(prompt=prompt, latents=start, num_images_per_prompt=len(latents), **common).images
        batch = len(latents)
        texts = [self._stock_embeds(text, batch) for text in (prompt, params.negative_prompt)]
        both = pipe(prompt_embeds=torch.cat(texts), latents=torch.cat([start, start]),
                    callback_on_step_end=_true_cfg_step(batch, params.guidance_scale),
                    callback_on_step_end_tensor_inputs=["latents"], **common).images
        return both[:batch]

    def _stock_embeds(self, prompt: str, copies: int) -> torch.Tensor:
        """The stock ``encode_prompt`` of `prompt`, `copies` rows."""
        embeds, _ = self.pipeline.encode_prompt(prompt, num_images_per_prompt=copies,
                                                max_sequence_length=self.max_sequence_length,
                                                text_encoder_out_layers=self.hidden_state_layers)
        return embeds


def _true_cfg_step(batch: int, guidance_scale: float) -> Callable[..., dict[str, torch.Tensor]]:
    """A ``callback_on_step_end`` for a stock loop over [prompt rows ; negative rows] from the same latents: both
    halves become negative + w (prompt - negative) of the stepped latents."""

    def combine(pipe: Any, step: int, timestep: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        latents = tensors["latents"]
        cond, negative = latents[:batch], latents[batch:]
        guided = negative + guidance_scale * (cond - negative)
        return {"latents": torch.cat([guided, guided])}

    return combine


class Flux2KleinPolicy(Flux2Policy):
    family = "flux2_klein"
    pipeline_class = Flux2KleinPipeline
    text_processor_class = Flux2KleinTextProcessor
    hidden_state_layers = (9, 18, 27)  # the klein pipeline's `text_encoder_out_layers`

    def _guidance(self, batch: int, device: torch.device) -> torch.Tensor | None:
        return None  # the klein pipeline passes no guidance input, whatever the transformer's config

    def guidance_scale_at(self, sigma: torch.Tensor, params: SamplingParams) -> float:
        """sampling.guidance_scale; a step-distilled checkout takes no true CFG (its pipeline ignores guidance).

        Raises:
            InvalidRequestError: guidance_scale > 1 for a step-distilled checkout.
        """
        if params.guidance_scale > 1 and self.pipeline.config.is_distilled:
            raise InvalidRequestError("this FLUX.2 [klein] checkout is step-distilled: its pipeline runs no true CFG; "
                                      "set it to 1", "sampling.guidance_scale")
        return super().guidance_scale_at(sigma, params)

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock call from our initial latents (patchified) on reference `images` (as sent), true CFG at
        params.guidance_scale with the request's negative prompt given as ``negative_prompt_embeds`` (the
        pipeline's own negative is the empty prompt)."""
        cfg = params.guidance_scale > 1
        negative = self._stock_embeds(params.negative_prompt, 1) if cfg else None
        return self.pipeline(
            prompt=prompt, negative_prompt_embeds=negative, guidance_scale=params.guidance_scale,
            latents=self._patchified(latents, params.height, params.width).clone(),
            num_images_per_prompt=len(latents), **self._stock_kwargs(params, images),
        ).images
