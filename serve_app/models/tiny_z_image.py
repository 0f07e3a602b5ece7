"""A randomly initialised miniature of Z-Image text-to-image (``ZImagePipeline``: a Qwen3 text encoder, the
single-stream ZImageTransformer2DModel, the Flux.1 AutoencoderKL), saved so that it loads through the same
``ZImagePipeline.from_pretrained(local_dir)`` a real checkout does.

Layout ``tiny`` (embedded as ``tiny-z-image``): Tongyi-MAI/Z-Image-Turbo, every component its real class at a
few channels wide:

* ``text_encoder``: a ``transformers.Qwen3Model`` (what the release's model_index names; the pipeline takes
  ``hidden_states[-2]``, so it has two layers and the conditioning is the first layer's output), 16 wide,
  grouped-query attention (2 query heads, 1 key/value head) with Qwen3's q/k norms.
* ``transformer``: a ``ZImageTransformer2DModel``: one noise-refiner and one context-refiner block (released:
  2 each) and two main single-stream blocks (released: 30), 2 heads x 16; RoPE axes (4, 6, 6) over
  (caption/frame, row, column) as released (32, 48, 48) shrunk, with the released axis lengths
  (1536, 512, 512). Patches 2x2x1, the only size the release has.
* ``vae``: an ``AutoencoderKL`` of three levels with Flux.1's latent normalisation (scaling 0.3611, shift
  0.1159), which Z-Image reuses; 4 latent channels (released: 16).

Geometry. VAE factor 4 (released: 8) x the transformer's 2x2 patches: height and width are multiples of 8
(released: 16). The pipeline samples unpacked latents [B, 4, H/4, W/4]: 32x32 px -> [4, 8, 8], 16 image tokens
(the transformer pads every image and caption sequence to a multiple of 32 tokens).

Stand-ins, as for the other tiny families (no vocabulary can be fetched offline):

* The tokenizer is the Qwen2 BPE tokenizer (``model_max_length`` 32) in place of Qwen3's, which shares its ids
  and adds four (``<think>`` and the tool-response markers) that a text-to-image prompt never uses; the Qwen3
  embedding table covers its 151665 ids, its pad id is Qwen's. It carries the part of Qwen3's chat template
  the pipeline exercises (no default system prompt, the empty thinking block only with enable_thinking
  False), so a prompt is templated as the release's tokenizer templates it. The pipeline pads every prompt to
  ``max_sequence_length`` (pass 32: its default is 512) exactly as with the real tokenizer.
* The scheduler is the released ``FlowMatchEulerDiscreteScheduler`` config (Tongyi-MAI/Z-Image-Turbo's
  ``scheduler/scheduler_config.json``, as quoted verbatim by public ports of the model): a static shift 3.0,
  no dynamic shifting, so the schedule depends on the step count only (the pipeline computes a mu from the
  image's tokens all the same, which this config ignores).

Size ``full``: Z-Image at its released dimensions, for the GPU check (benchmarks/gpu_rollout.py), built in memory
with :func:`z_image_pipeline`, never saved. Z-Image and Z-Image-Turbo share the architecture (public ports load the
base transformer beside Turbo's text encoder and VAE); the check's true CFG over 10 steps is the base model's use.

* Confirmed: the transformer as Tongyi-MAI/Z-Image-Turbo's ``transformer/config.json`` is quoted verbatim by
  public ports (dim 3840 = 30 heads x 128, 30 KV heads, 30 layers, 2 noise- and 2 context-refiner layers, 16 input
  channels, 2x2x1 patches, cap_feat_dim 2560, RoPE axes (32, 48, 48) of lengths (1536, 512, 512), theta 256,
  t_scale 1000, qk norm, norm_eps 1e-5): diffusers 0.42.1's constructor defaults but for the axis lengths (its
  1024 for the first). Its 6,154,908,736 parameters are, at 4 bytes each, the 24.62 GB a public deployment note
  gives for the released float32 transformer weights. The VAE: Flux.1's ``vae/config.json`` as a public Z-Image
  port quotes the one Z-Image ships (levels 128, 256, 512, 512 of 2 blocks, 32 norm groups, 16 latent channels, no
  quant convs, scaling 0.3611 / shift 0.1159). Qwen3-4B's text geometry (width 2560, 32 query / 8 KV heads of 128,
  MLP 9728, rope_theta 1e6, 36 layers), as its config.json is quoted by the same ports.
* Not confirmed: that the base model's scheduler config is Turbo's (static shift 3.0; the same config here for
  every size).
* Stand-ins: Qwen3-4B at its real geometry with 2 of its 36 layers (the pipeline's ``hidden_states[-2]`` is then
  the first layer's output, as the tiny's; the release's is layer 35's), over the Qwen2 vocabulary with
  ``model_max_length`` 512 (the stock ``max_sequence_length``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from transformers import Qwen3Config, Qwen3Model

from .tiny_parts import build_with_qwen2_tokenizer, kl_vae, seeded_components
from .tokenizer import QWEN2_EOS_ID, QWEN2_PAD_ID, QWEN2_VOCAB_SIZE

__all__ = ["QWEN3_CHAT_TEMPLATE", "ZImageSize", "build_tiny_z_image", "z_image_pipeline"]

ZImageSize = Literal["tiny", "full"]

# What Qwen3's chat template renders for messages without tools or reasoning content: no default system
# prompt (Qwen2's adds one), and an empty thinking block after the generation prompt when thinking is off.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

# Tongyi-MAI/Z-Image-Turbo's scheduler_config.json.
_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0}


@dataclass(frozen=True)
class _Spec:
    max_length: int  # the tokenizer's model_max_length: the policy's max_sequence_length
    text_dim: int  # Qwen3 hidden_size = the transformer's cap_feat_dim
    text_layers: int  # at least 2: the pipeline conditions on hidden_states[-2]
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_ffn: int
    layers: int
    refiner_layers: int
    heads: int
    rope_axes: tuple[int, int, int]  # (caption/frame, row, column); sums to the head dim, each even
    latent_channels: int
    vae_channels: tuple[int, ...]  # one per level: factor 2^(levels - 1)
    vae_layers: int  # resnets per level
    vae_groups: int  # GroupNorm groups
    vae_sample_size: int


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(max_length=32, text_dim=16, text_layers=2, text_heads=2, text_kv_heads=1, text_head_dim=8,
                  text_ffn=32, layers=2, refiner_layers=1, heads=2, rope_axes=(4, 6, 6), latent_channels=4,
                  vae_channels=(8, 16, 16), vae_layers=1, vae_groups=4, vae_sample_size=32),
    # Z-Image as released, over a two-layer Qwen3-4B (the module docstring).
    "full": _Spec(max_length=512, text_dim=2560, text_layers=2, text_heads=32, text_kv_heads=8, text_head_dim=128,
                  text_ffn=9728, layers=30, refiner_layers=2, heads=30, rope_axes=(32, 48, 48), latent_channels=16,
                  vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32, vae_sample_size=1024),
}


def _text_encoder(spec: _Spec) -> Qwen3Model:
    config = Qwen3Config(
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=spec.text_dim, intermediate_size=spec.text_ffn,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, head_dim=spec.text_head_dim,
        max_position_embeddings=4 * spec.max_length, rope_theta=1_000_000.0,
        pad_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_EOS_ID, bos_token_id=QWEN2_PAD_ID,
    )
    return Qwen3Model(config).eval()


def _transformer(spec: _Spec) -> ZImageTransformer2DModel:
    return ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=spec.latent_channels,
        dim=spec.heads * sum(spec.rope_axes), n_layers=spec.layers, n_refiner_layers=spec.refiner_layers,
        n_heads=spec.heads, n_kv_heads=spec.heads, cap_feat_dim=spec.text_dim, axes_dims=list(spec.rope_axes),
        axes_lens=[1536, 512, 512], rope_theta=256.0, t_scale=1000.0,
    )


def _vae(spec: _Spec) -> AutoencoderKL:
    return kl_vae(spec.vae_channels, spec.latent_channels, scaling_factor=0.3611, shift_factor=0.1159,
                  layers_per_block=spec.vae_layers, norm_num_groups=spec.vae_groups, sample_size=spec.vae_sample_size)


def z_image_pipeline(size: ZImageSize, *, tokenizer: Any, seed: int = 0,
                     dtype: torch.dtype = torch.float32) -> ZImagePipeline:
    """A random-weight ``ZImagePipeline`` of `size` in `dtype`, in memory, on the current default device;
    bit-reproducible for a given `seed` (:func:`seeded_components`). `tokenizer` gets the size's text length
    and Qwen3's chat template."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizer.model_max_length = spec.max_length
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    makers = (("transformer", _transformer), ("vae", _vae), ("text_encoder", _text_encoder))
    components = seeded_components([(name, lambda make=make: make(spec), seed) for name, make in makers], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG)
    return ZImagePipeline(tokenizer=tokenizer, scheduler=scheduler, **components)


def build_tiny_z_image(out_dir: Path, *, size: ZImageSize = "tiny", seed: int = 0,
                       tokenizer_dir: Path | None = None) -> Path:
    """Builds a tiny random-weight ``ZImagePipeline`` (`size`: the module docstring's layout) on the CPU and
    saves it (float32 safetensors), bit-reproducibly (:func:`z_image_pipeline`). ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    return build_with_qwen2_tokenizer(lambda tokenizer: z_image_pipeline(size, tokenizer=tokenizer, seed=seed), out_dir,
                                      tokenizer_dir)
