"""The model families this service samples: one row each, data only. Config validation, policy loading, the
embedded checkpoints, the conformance suite and the docs read this table; a new family is one row here and one
policy module (serve_app/policies/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class EmbeddedCheckpoint:
    """A checkpoint built from code on first use (serve_app.models.ensure_embedded_model): random weights at the
    family's real architecture, miniature sizes. `role`: "tiny" checkpoints are what every test and the
    conformance suite run each family on; "benchmark" ones are larger, for figures."""

    name: str  # the name configs give as model.embedded
    builder: str  # "package.module:function", called as builder(out_dir, seed=0, tokenizer_dir=..., **options)
    config: str  # its model config, configs/model/<config>.yaml
    options: tuple[tuple[str, Any], ...] = ()
    role: Literal["tiny", "benchmark"] = "tiny"
    note: str = ""  # what it stands for, when the family has several layouts


@dataclass(frozen=True)
class Family:
    """One model family: the diffusers pipelines it loads, its policy, what it samples and takes."""

    name: str
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s of the checkpoints it loads
    policy: str  # "package.module:Class" of its DiffusionPolicy
    produces: Literal["images", "videos"]
    input_images: bool  # requests carry input images per prompt (editing)
    experts: tuple[str, ...]  # transformer components a checkpoint may have (Wan2.2-A14B: two)
    # "package.module:Class" of its TextProcessor, in a module free of diffusers: the ingress loads it alone.
    text_processor: str = field(kw_only=True)
    distilled_guidance: bool = False  # a guidance embedding fed model.distilled_guidance (Flux.1-dev)
    encoder_image_copy: bool = False  # the text encoder sees its own copy of each input image (model.condition_image_area)
    checkpoints: tuple[EmbeddedCheckpoint, ...] = field(default_factory=tuple)


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("qwen_image", ("QwenImagePipeline",), "serve_app.policies.qwen_image:QwenImagePolicy", "images", False,
           ("transformer",), text_processor="serve_app.policies.qwen_text:QwenImageTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-qwen-image", "serve_app.models.tiny_qwen_image:build_tiny_qwen_image",
                                  "tiny_qwen_image", (("size", "tiny"),)),
               EmbeddedCheckpoint("small-qwen-image", "serve_app.models.tiny_qwen_image:build_tiny_qwen_image",
                                  "small_qwen_image", (("size", "small"),), role="benchmark",
                                  note="4 layers, 256 wide"))),
    Family("qwen_image_edit", ("QwenImageEditPipeline",), "serve_app.policies.qwen_image_edit:QwenImageEditPolicy",
           "images", True, ("transformer",), text_processor="serve_app.policies.qwen_text:QwenImageEditTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-qwen-image-edit", "serve_app.models.tiny_qwen_image_edit:build_tiny_qwen_image_edit",
                                  "tiny_qwen_image_edit"),)),
    Family("qwen_image_edit_plus", ("QwenImageEditPlusPipeline",),
           "serve_app.policies.qwen_image_edit_plus:QwenImageEditPlusPolicy", "images", True, ("transformer",),
           encoder_image_copy=True, text_processor="serve_app.policies.qwen_text:QwenImageEditPlusTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-qwen-image-edit-plus",
                                  "serve_app.models.tiny_qwen_image_edit:build_tiny_qwen_image_edit",
                                  "tiny_qwen_image_edit_plus", (("plus", True),)),)),
    Family("sd3", ("StableDiffusion3Pipeline",), "serve_app.policies.sd3:SD3Policy", "images", False, ("transformer",),
           text_processor="serve_app.policies.clip_t5:SD3TextProcessor",
           checkpoints=(EmbeddedCheckpoint("tiny-sd3", "serve_app.models.tiny_sd3:build_tiny_sd3", "tiny_sd3"),)),
    Family("flux", ("FluxPipeline",), "serve_app.policies.flux:FluxPolicy", "images", False, ("transformer",),
           distilled_guidance=True,
           text_processor="serve_app.policies.clip_t5:FluxTextProcessor",
           checkpoints=(EmbeddedCheckpoint("tiny-flux", "serve_app.models.tiny_flux:build_tiny_flux", "tiny_flux"),)),
    Family("flux_kontext", ("FluxKontextPipeline",), "serve_app.policies.flux_kontext:FluxKontextPolicy", "images",
           True, ("transformer",), distilled_guidance=True, text_processor="serve_app.policies.clip_t5:FluxTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-flux-kontext", "serve_app.models.tiny_flux:build_tiny_flux", "tiny_flux_kontext",
                                  (("kontext", True),)),)),
    Family("wan", ("WanPipeline",), "serve_app.policies.wan:WanPolicy", "videos", False, ("transformer", "transformer_2"),
           text_processor="serve_app.policies.single_tokenizer:WanTextProcessor",
           checkpoints=(
               EmbeddedCheckpoint("tiny-wan", "serve_app.models.tiny_wan:build_tiny_wan", "tiny_wan", note="Wan2.1"),
               EmbeddedCheckpoint("tiny-wan22", "serve_app.models.tiny_wan:build_tiny_wan", "tiny_wan22",
                                  (("size", "tiny-a14b"),), note="Wan2.2-T2V-A14B's two experts"),
               EmbeddedCheckpoint("tiny-wan22-ti2v", "serve_app.models.tiny_wan:build_tiny_wan", "tiny_wan22_ti2v",
                                  (("size", "tiny-ti2v"),), note="Wan2.2-TI2V-5B's per-token timesteps, 48-channel VAE"))),
    Family("wan_i2v", ("WanImageToVideoPipeline",), "serve_app.policies.wan_i2v:WanImageToVideoPolicy", "videos", True,
           ("transformer", "transformer_2"), text_processor="serve_app.policies.single_tokenizer:WanTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-wan-i2v", "serve_app.models.tiny_wan:build_tiny_wan", "tiny_wan_i2v",
                                  (("size", "tiny-i2v"),), note="Wan2.1-I2V's CLIP image embeddings"),
               EmbeddedCheckpoint("tiny-wan22-i2v", "serve_app.models.tiny_wan:build_tiny_wan", "tiny_wan22_i2v",
                                  (("size", "tiny-i2v-a14b"),), note="Wan2.2-I2V-A14B's two experts, no CLIP"))),
    Family("ltx2", ("LTX2Pipeline",), "serve_app.policies.ltx2:LTX2Policy", "videos", False, ("transformer",),
           text_processor="serve_app.policies.single_tokenizer:LTX2TextProcessor",
           checkpoints=(EmbeddedCheckpoint("tiny-ltx2", "serve_app.models.tiny_ltx2:build_tiny_ltx2", "tiny_ltx2",
                                           note="LTX-2's joint video and audio latents"),)),
    Family("ltx2_i2v", ("LTX2ImageToVideoPipeline",), "serve_app.policies.ltx2_i2v:LTX2ImageToVideoPolicy", "videos",
           True, ("transformer",), text_processor="serve_app.policies.single_tokenizer:LTX2TextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-ltx2-i2v", "serve_app.models.tiny_ltx2:build_tiny_ltx2", "tiny_ltx2_i2v",
                                  (("size", "tiny-i2v"),), note="LTX-2's given first frame"),)),
    Family("z_image", ("ZImagePipeline",), "serve_app.policies.z_image:ZImagePolicy", "images", False, ("transformer",),
           text_processor="serve_app.policies.single_tokenizer:ZImageTextProcessor",
           checkpoints=(EmbeddedCheckpoint("tiny-z-image", "serve_app.models.tiny_z_image:build_tiny_z_image",
                                           "tiny_z_image"),)),
    Family("flux2", ("Flux2Pipeline",), "serve_app.policies.flux2:Flux2Policy", "images", True, ("transformer",),
           distilled_guidance=True,
           text_processor="serve_app.policies.single_tokenizer:Flux2TextProcessor",
           checkpoints=(EmbeddedCheckpoint("tiny-flux2", "serve_app.models.tiny_flux2:build_tiny_flux2", "tiny_flux2",
                                           note="FLUX.2 [dev]: Mistral 3 encoder, guidance embedding"),)),
    Family("flux2_klein", ("Flux2KleinPipeline",), "serve_app.policies.flux2:Flux2KleinPolicy", "images", True,
           ("transformer",), text_processor="serve_app.policies.single_tokenizer:Flux2KleinTextProcessor", checkpoints=(
               EmbeddedCheckpoint("tiny-flux2-klein", "serve_app.models.tiny_flux2:build_tiny_flux2",
                                  "tiny_flux2_klein", (("size", "tiny-klein"),),
                                  note="FLUX.2 [klein] base: Qwen3 encoder, true CFG"),)),
)}

# The config's model.family: any row's name.
FamilyName = Literal[tuple(FAMILIES)]  # type: ignore[valid-type]


def family(name: str) -> Family:
    """The row of `name`. Raises ValueError naming the families there are."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; supported: {', '.join(FAMILIES)}") from None


def families_that(predicate) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    """The names of the families `predicate(row)` holds for, in table order."""
    return tuple(name for name, row in FAMILIES.items() if predicate(row))
