"""Qwen-Image-Edit: Qwen-Image conditioned on an input image, twice - through the Qwen2.5-VL text encoder
(the prompt with the image's vision tokens) and as the image's VAE latents, joined to the noisy latents
along the sequence.

What the stock ``QwenImageEditPipeline`` does, and so what this adapter does:

- The input image is resized to about ``input_image_area`` pixels at its aspect ratio (1024 x 1024 in the
  pipeline; the ingress does it, :meth:`ImageGeometry.resize_input_image`).
- The prompt goes into a chat template holding ``<|vision_start|><|image_pad|><|vision_end|>``; the
  processor expands the pad into one token per merged vision patch, and the encoder's hidden states of
  the first 64 tokens (the system prompt and the user header) are dropped.
- The transformer sees [noisy latents ; image latents] with ``img_shapes`` of two entries per sample and
  its output is cut back to the noisy latents' tokens. True CFG encodes the negative prompt with the
  same image and combines with Qwen-Image's norm rescaling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from diffusers import QwenImageEditPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit

from serve_app.media import to_pil
from serve_app.policies.base import PolicySettings, per_input_image_shapes, stack_padded, stock_globals
from serve_app.policies.qwen_image import QwenImagePolicy, right_padded, without_prefix
from serve_app.policies.qwen_text import EDIT_TEMPLATE_PREFIX_TOKENS, IMAGE_PAD, QwenImageEditTextProcessor
from serve_app.config.sampling import SamplingParams
from serve_app.schemas import PromptEmbeds, PromptTokens

# The area QwenImageEditPipeline.__call__ resizes an input image to (calculate_dimensions(1024 * 1024, ...)).
STOCK_INPUT_IMAGE_AREA = 1024 * 1024
_PROCESSOR = "serve_app.models.vl_processor:Qwen2VLImageOnlyProcessor"
# Taken at import, so a replacement for one call (stock_call) never wraps another's.
_STOCK_CALCULATE_DIMENSIONS = pipeline_qwenimage_edit.calculate_dimensions


class QwenImageEditPolicy(QwenImagePolicy):
    family = "qwen_image_edit"
    pipeline_class = QwenImageEditPipeline
    input_images: ClassVar[tuple[int, int]] = (1, 1)
    input_image_area: int = STOCK_INPUT_IMAGE_AREA

    @classmethod
    def from_pretrained(cls, local_dir: str | Path, *, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, components: Mapping[str, str] | None = None,
                        settings: PolicySettings | None = None) -> QwenImageEditPolicy:
        """The checkout's ``processor`` folder loads as a Qwen2-VL processor without its video half (which
        needs torchvision), unless ``components`` names another class for it."""
        return super().from_pretrained(local_dir, device=device, dtype=dtype,  # type: ignore[return-value]
                                       components={"processor": _PROCESSOR, **(components or {})}, settings=settings)

    def _make_text_processor(self) -> QwenImageEditTextProcessor:
        return QwenImageEditTextProcessor({"tokenizer": self.pipeline.tokenizer})

    # -- conditioning --------------------------------------------------------------------------

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        """Each prompt with its input image (uint8 [3, h, w], already at its conditioning size): the VL
        encoder's hidden states after the template prefix, and the image's packed VAE latents."""
        # 1. Check inputs
        for i, p in enumerate(prompts):
            self.geometry.check_input_image_count(len(p.images), f"prompts[{i}].images")
        # 2. Vision inputs of every image, and each prompt's ids with its image pads expanded
        images = [to_pil(image) for i, p in enumerate(prompts) for image in self._vision_images(p, i)]
        processor = self.pipeline.processor
        vision = processor.image_processor(images=images, return_tensors="pt")
        vision_tokens = (vision["image_grid_thw"].prod(dim=-1) // processor.image_processor.merge_size**2).tolist()
        ids = _expand_image_pads([self._template_ids(p) for p in prompts], [len(p.images) for p in prompts],
                                 processor.image_token_id, vision_tokens)
        lengths = torch.tensor([len(x) for x in ids])
        if int(lengths.min()) <= EDIT_TEMPLATE_PREFIX_TOKENS:
            raise ValueError("token ids must include the Qwen-Image-Edit prompt template (use the family's TextProcessor)")
        input_ids, attention_mask = right_padded(ids, self.pipeline.tokenizer.pad_token_id or 0)
        # 3. The VL encoder's last (normed) hidden states, without the template prefix
        hidden = self.pipeline.text_encoder.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
            pixel_values=vision["pixel_values"].to(self.device), image_grid_thw=vision["image_grid_thw"].to(self.device),
        ).last_hidden_state
        embeds, mask = without_prefix(hidden, lengths, EDIT_TEMPLATE_PREFIX_TOKENS)
        # 4. Each prompt's image latents (one VAE call per image: the images' sizes differ)
        latents = [torch.cat([self.encode_images(image[None].float() / 255.0)[0] for image in p.images]) for p in prompts]
        # [P, most images, 3]: a prompt with fewer images than another is padded with (0, 0, 0) shapes.
        shapes = stack_padded([torch.tensor([(1, image.shape[-2] // self.spatial_multiple,
                                              image.shape[-1] // self.spatial_multiple) for image in p.images],
                                            dtype=torch.long) for p in prompts])
        return PromptEmbeds(embeds.to(self.dtype), mask, image_latents=stack_padded(latents).to(self.dtype),
                            image_shapes=shapes.to(self.device))

    def _vision_images(self, prompt: PromptTokens, index: int) -> list[torch.Tensor]:
        """The images the VL encoder sees for a prompt: the ones its VAE latents come from."""
        return prompt.images

    def _template_ids(self, prompt: PromptTokens) -> torch.Tensor:
        """The prompt's ids in the full template, one ``<|image_pad|>`` per input image."""
        return prompt.token_ids["tokenizer"].to(torch.long)

    def embed_prompts(self, prompts: Sequence[PromptTokens]) -> PromptEmbeds:
        raise NotImplementedError(f"{self.family} does not train its text encoder")

    def predict(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, *, height: int, width: int
    ) -> torch.Tensor:
        """The transformer over [latents ; each sample's image latents], its output cut to the latents' tokens.
        Samples whose input images differ in size run in separate forwards (one per size)."""
        if cond.image_latents is None or cond.image_shapes is None:
            raise ValueError(f"{self.family} conditions on input images; the prompt embeddings carry none")
        grid = (1, height // self.spatial_multiple, width // self.spatial_multiple)
        image_latents = cond.image_latents

        def run(rows: torch.Tensor | None, shapes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
            def pick(t: torch.Tensor) -> torch.Tensor:
                return t if rows is None else t[rows]

            tokens = sum(f * h * w for f, h, w in shapes)
            noisy, text_mask = pick(latents), pick(cond.mask)
            return self.pipeline.transformer(
                hidden_states=torch.cat([noisy, pick(image_latents)[:, :tokens].to(noisy.dtype)], dim=1).to(self.dtype),
                timestep=pick(sigma).to(device=latents.device, dtype=self.dtype),
                encoder_hidden_states=pick(cond.embeds).to(self.dtype),
                encoder_hidden_states_mask=None if bool(text_mask.all()) else text_mask,
                img_shapes=[[grid, *shapes]] * len(noisy),
                return_dict=False,
            )[0][:, : latents.shape[1]]

        return per_input_image_shapes(cond, run)

    def stock_call(self, prompt: str, params: SamplingParams, latents: torch.Tensor, *,
                   images: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """The stock ``QwenImageEditPipeline.__call__`` on `images` (one uint8 [3, H, W], as sent, before any
        resize: the pipeline resizes it). At an ``input_image_area`` other than the pipeline's 1024 x 1024,
        that one constant is replaced for the call (the tiny checkpoint conditions on 32 x 32 px)."""
        if len(images) != 1:
            raise ValueError(f"{self.family} takes exactly one input image; got {len(images)}")
        cfg = params.guidance_scale > 1
        with stock_globals(pipeline_qwenimage_edit, **self._stock_input_area()):
            return self.pipeline(
                image=to_pil(images[0]), prompt=prompt, negative_prompt=params.negative_prompt if cfg else None,
                true_cfg_scale=params.guidance_scale, height=params.height, width=params.width,
                num_inference_steps=params.num_steps, latents=latents.clone(), num_images_per_prompt=len(latents),
                output_type="pt",
            ).images

    def _stock_input_area(self) -> dict[str, Callable[[int, float], tuple[int, int, None]]]:
        """The stock module's globals to replace for this policy's input area: none at 1024 x 1024; else its
        calculate_dimensions, which its ``__call__`` hands 1024 x 1024 inline, at our area."""
        if self.input_image_area == STOCK_INPUT_IMAGE_AREA:
            return {}
        area = self.input_image_area
        return {"calculate_dimensions": lambda _area, ratio: _STOCK_CALCULATE_DIMENSIONS(area, ratio)}


def _expand_image_pads(ids: Sequence[torch.Tensor], images: Sequence[int], pad_id: int,
                       vision_tokens: list[int]) -> list[torch.Tensor]:
    """Each prompt's token ids with its k-th ``<|image_pad|>`` repeated as many times as its k-th image has
    vision tokens (images counted across the prompts in order), as the processor expands them; `images`:
    each prompt's input image count."""
    expanded, image = [], 0
    for i, (prompt_ids, count) in enumerate(zip(ids, images)):
        at = (prompt_ids == pad_id).nonzero().flatten().tolist()
        if len(at) != count:
            raise ValueError(f"prompts[{i}] has {len(at)} {IMAGE_PAD} tokens for {count} input images")
        pieces, start = [], 0
        for position in at:
            pieces += [prompt_ids[start:position], prompt_ids.new_full((vision_tokens[image],), pad_id)]
            start, image = position + 1, image + 1
        expanded.append(torch.cat([*pieces, prompt_ids[start:]]))
    return expanded
