"""Randomly initialised miniatures of FLUX.2: ``Flux2Pipeline`` (FLUX.2 [dev]: a Mistral Small 3.1 text encoder,
a guidance-distilled Flux2Transformer2DModel) and ``Flux2KleinPipeline`` (FLUX.2 [klein]: a Qwen3 text encoder, a
transformer without guidance embedding, true CFG), saved so that each loads through the same
``from_pretrained(local_dir)`` a real checkout does. Both share FLUX.2's VAE (``AutoencoderKLFlux2``: a 2-D KL VAE
that patchifies its latents 2x2 and normalises them with BatchNorm running statistics) and scheduler.

Layouts, every component its real class at a few channels wide:

* ``tiny`` (embedded as ``tiny-flux2``): FLUX.2 [dev]. ``text_encoder`` is a ``Mistral3ForConditionalGeneration``
  (a Mistral text stack of 31 layers, 16 wide, and a one-layer Pixtral vision tower that text prompts never run):
  the pipeline stacks the hidden states of layers 10, 20 and 30 (released: of 40), so the transformer's
  ``joint_attention_dim`` is 3 x 16 = 48 (released 3 x 5120). The transformer has ``guidance_embeds`` True.
* ``tiny-klein`` (embedded as ``tiny-flux2-klein``): FLUX.2 [klein] base (``is_distilled`` False, so the pipeline
  runs true CFG). ``text_encoder`` is a ``Qwen3ForCausalLM`` of 28 layers, 16 wide: the pipeline stacks layers 9, 18
  and 27 (released Qwen3-4B: of 36). The transformer has no guidance embedding, as released.

Geometry (both): the VAE has four levels, factor 8 as released, and 4 latent channels (released 32); the pipeline
packs each 2x2 patch of latents into one token of 16 channels (released 128), so height and width are multiples of
16, as released, and 32x32 px gives 4 tokens (64x96: 24). The transformer: one double-stream and one single-stream
block, 2 heads x 16, four rotary axes (time, row, column, text position) of 4 each (released 32 each), rope_theta
2000; its output layer is initialised at a trained velocity's scale (see ``_transformer``). The VAE's BatchNorm
statistics (over the 16 patchified channels) are non-trivial, so the pipeline's latent (de)normalisation is
exercised.

Stand-ins, as for the other tiny families (no vocabulary can be fetched offline):

* The tokenizer is the Qwen2 BPE tokenizer (``model_max_length`` 96 for dev, 48 for klein; the pipelines' default
  ``max_sequence_length`` is 512); both encoders' embedding tables cover its 151665 ids. The released dev
  "tokenizer" is a ``PixtralProcessor``; the pipeline calls only its ``apply_chat_template`` (its image half serves
  caption upsampling alone), which a tokenizer has too, so the stand-in is the Qwen2 tokenizer carrying a chat
  template of Mistral Small 3.1's layout (``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``, image blocks as
  ``[IMG]``) written here: Qwen2's vocabulary has no such control tokens, so the markers are BPE-encoded as text.
  Klein's released tokenizer is Qwen3's (Qwen2's vocabulary plus a few added tokens); the stand-in carries a chat
  template of Qwen3's layout (chat turns, and the empty ``<think>`` block the pipeline asks for with
  ``enable_thinking=False``), written here, not the released template with its tool and reasoning branches.
* The scheduler is FLUX.2 [dev]'s released ``FlowMatchEulerDiscreteScheduler`` config (as mirrored by the
  diffusers team in ``diffusers/FLUX.2-dev-bnb-4bit``): dynamic exponential shifting. Both pipelines compute mu
  with their own empirical formula (``compute_empirical_mu`` of the image tokens and the step count), so the
  config's base/max shift never enter. Klein's scheduler config is assumed to be the same (its pipeline computes
  its schedule the same way).

Sizes ``full`` (FLUX.2 [dev]) and ``full-klein`` (FLUX.2 [klein] base 4B: the Apache-2.0 one, whose Qwen3-4B is the
tiny klein's model, rather than the non-commercial 9B over Qwen3-8B): the released dimensions, for the GPU check
(benchmarks/gpu_rollout.py), built in memory with :func:`flux2_pipeline`, never saved:

* Confirmed against diffusers' scripts/convert_flux2_to_diffusers.py (its ``flux2-dev`` and ``klein-4b`` transformer
  configs, and its VAE: ``AutoencoderKLFlux2()``, the constructor's defaults, into which it loads the released VAE
  with strict=True, so every shape is the release's): [dev]'s transformer (8 double- and 48 single-stream blocks,
  48 heads x 128, MLP ratio 3, 128 input channels, joint_attention_dim 15360 = 3 x 5120, RoPE axes 4 x 32 with theta
  2000, guidance embedding; diffusers 0.42.1's constructor defaults all); klein 4B's (5 + 20 blocks, 24 heads x 128,
  joint_attention_dim 7680 = 3 x 2560, no guidance embedding); the VAE (levels 128, 256, 512, 512 of 2 blocks, 32
  norm groups, 32 latent channels, quant convs, 2x2 patches: 128 channels a token). Qwen3-4B's text geometry (width
  2560, 32 query / 8 KV heads of 128, MLP 9728, 36 layers, tied embeddings) as its released config.json is quoted by
  public ports; Mistral Small 3's text geometry (width 5120, 32 / 8 heads of 128, MLP 32768, 40 layers) likewise.
* Not confirmed: the VAE's BatchNorm statistics (weights; the tiny's ramps here) and sample_size 1024 (the
  constructor's, marked unsure in its source; it never enters a decode); klein's scheduler config (assumed [dev]'s,
  as for the tiny).
* Stand-ins. [klein]: Qwen3-4B at its real geometry with 28 of its 36 layers, the fewest whose hidden states 9, 18
  and 27 the pipeline stacks. [dev]: Mistral Small 3.1 (24B; the conversion script takes 3.2's weights, the same
  architecture) at its real width 5120 with 31 layers, the fewest for the states of layers 10, 20 and 30, but each
  layer thinned to 4 query / 1 KV heads of 128 (the release's head size and 4:1 grouping; released 32 / 8) and an
  MLP 1024 wide (released 32768): 1.5B parameters, 2.8 GiB in bf16. 31 released layers would be 17.2B (32 GiB), and
  with the transformer's 60 GiB neither they nor the whole 24B (44 GiB) fit an 80 GB H100; the encoder runs once a
  rollout on one prompt and its negative, so its layers' size moves no figure the check reports but the memory.
  Both over the Qwen2 vocabulary with ``model_max_length`` 512 (the pipelines' ``max_sequence_length``), the tiny's
  one-layer Pixtral tower, and the tiny's chat templates.
* The [dev] transformer is made directly in the target dtype (the smaller components in float32, then cast): 32B
  parameters in float32 would be 120 GiB, more than an H100 holds, and with the rest more than an H200.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (
    AutoencoderKLFlux2,
    FlowMatchEulerDiscreteScheduler,
    Flux2KleinPipeline,
    Flux2Pipeline,
    Flux2Transformer2DModel,
)
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from .tiny_parts import build_with_qwen2_tokenizer, seeded_components
from .tokenizer import QWEN2_ADDED_TOKENS, QWEN2_EOS_ID, QWEN2_PAD_ID, QWEN2_VOCAB_SIZE

__all__ = ["FLUX2_SCHEDULER_CONFIG", "Flux2Size", "build_tiny_flux2", "flux2_pipeline"]

Flux2Size = Literal["tiny", "tiny-klein", "full", "full-klein"]

# FLUX.2 [dev]'s scheduler_config.json (diffusers/FLUX.2-dev-bnb-4bit, the diffusers team's copy of the release).
FLUX2_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "invert_sigmas": False,
    "shift_terminal": None,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
}

# Mistral Small 3.1's chat layout, as the dev pipeline's messages use it: a system turn and user turns whose content
# is a list of text (and image) blocks.
MISTRAL_SMALL_CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for block in content -%}"
    "{%- if block['type'] == 'text' -%}{{ block['text'] }}"
    "{%- elif block['type'] in ['image', 'image_url'] -%}{{ '[IMG]' }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token or '' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '[SYSTEM_PROMPT]' + text_of(message['content']) + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' -%}{{ '[INST]' + text_of(message['content']) + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ text_of(message['content']) + (eos_token or '') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# Qwen3's chat layout: ChatML turns, and an empty reasoning block opening the answer when thinking is off.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

# Qwen2's own image placeholder: the id Mistral3 treats as its image token, one plain text never produces.
_IMAGE_TOKEN_ID = QWEN2_VOCAB_SIZE - len(QWEN2_ADDED_TOKENS) + [c for c, _ in QWEN2_ADDED_TOKENS].index("<|image_pad|>")


@dataclass(frozen=True)
class _Spec:
    klein: bool  # Flux2KleinPipeline (Qwen3, true CFG) rather than Flux2Pipeline (Mistral 3, guidance embedding)
    max_length: int  # the tokenizer's model_max_length: the policy's max_sequence_length
    chat_template: str
    text_dim: int
    text_layers: int  # enough for the pipeline's deepest hidden-state layer to be a layer's output, not the last
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_ffn: int
    stacked_layers: int  # hidden-state layers the pipeline stacks: joint_attention_dim = stacked_layers x text_dim
    double_layers: int
    single_layers: int
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int, int]  # (time, row, column, text position); must sum to head_dim
    latent_channels: int
    vae_channels: tuple[int, ...]  # one level each: factor 2^(levels - 1)
    vae_layers: int  # resnets per level
    vae_groups: int  # GroupNorm groups
    vae_sample_size: int
    transformer_in_dtype: bool = False  # made in the target dtype, not float32 then cast (see the module docstring)


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(klein=False, max_length=96, chat_template=MISTRAL_SMALL_CHAT_TEMPLATE, text_dim=16, text_layers=31,
                  text_heads=2, text_kv_heads=1, text_head_dim=8, text_ffn=32, stacked_layers=3, double_layers=1,
                  single_layers=1, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4), latent_channels=4,
                  vae_channels=(8, 16, 16, 16), vae_layers=1, vae_groups=4, vae_sample_size=32),
    "tiny-klein": _Spec(klein=True, max_length=48, chat_template=QWEN3_CHAT_TEMPLATE, text_dim=16, text_layers=28,
                        text_heads=2, text_kv_heads=1, text_head_dim=8, text_ffn=32, stacked_layers=3,
                        double_layers=1, single_layers=1, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4),
                        latent_channels=4, vae_channels=(8, 16, 16, 16), vae_layers=1, vae_groups=4,
                        vae_sample_size=32),
    # FLUX.2 [dev] as released, over a thinned 31-layer Mistral of the real width (the module docstring).
    "full": _Spec(klein=False, max_length=512, chat_template=MISTRAL_SMALL_CHAT_TEMPLATE, text_dim=5120,
                  text_layers=31, text_heads=4, text_kv_heads=1, text_head_dim=128, text_ffn=1024, stacked_layers=3,
                  double_layers=8, single_layers=48, heads=48, head_dim=128, rope_axes=(32, 32, 32, 32),
                  latent_channels=32, vae_channels=(128, 256, 512, 512), vae_layers=2, vae_groups=32,
                  vae_sample_size=1024, transformer_in_dtype=True),
    # FLUX.2 [klein] base 4B as released, over Qwen3-4B with 28 of its 36 layers.
    "full-klein": _Spec(klein=True, max_length=512, chat_template=QWEN3_CHAT_TEMPLATE, text_dim=2560,
                        text_layers=28, text_heads=32, text_kv_heads=8, text_head_dim=128, text_ffn=9728,
                        stacked_layers=3, double_layers=5, single_layers=20, heads=24, head_dim=128,
                        rope_axes=(32, 32, 32, 32), latent_channels=32, vae_channels=(128, 256, 512, 512),
                        vae_layers=2, vae_groups=32, vae_sample_size=1024),
}


def _mistral3(spec: _Spec) -> Mistral3ForConditionalGeneration:
    text = {
        "model_type": "mistral", "vocab_size": QWEN2_VOCAB_SIZE, "hidden_size": spec.text_dim,
        "intermediate_size": spec.text_ffn, "num_hidden_layers": spec.text_layers,
        "num_attention_heads": spec.text_heads, "num_key_value_heads": spec.text_kv_heads,
        "head_dim": spec.text_head_dim, "max_position_embeddings": 4 * spec.max_length,
        "sliding_window": None, "pad_token_id": QWEN2_PAD_ID, "bos_token_id": QWEN2_PAD_ID,
        "eos_token_id": QWEN2_EOS_ID,
    }
    # Four 7 px patches a side, merged 2x2 by the projector as Mistral 3 merges Pixtral's.
    vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 7}
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=_IMAGE_TOKEN_ID,
                            spatial_merge_size=2)
    return Mistral3ForConditionalGeneration(config).eval()


def _qwen3(spec: _Spec) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=spec.text_dim, intermediate_size=spec.text_ffn,
        num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
        num_key_value_heads=spec.text_kv_heads, head_dim=spec.text_head_dim,
        max_position_embeddings=4 * spec.max_length, tie_word_embeddings=True,  # as Qwen3-4B
        pad_token_id=QWEN2_PAD_ID, bos_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_EOS_ID,
    )
    return Qwen3ForCausalLM(config).eval()


def _text_encoder(spec: _Spec) -> torch.nn.Module:
    return _qwen3(spec) if spec.klein else _mistral3(spec)


def _transformer(spec: _Spec) -> Flux2Transformer2DModel:
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * spec.latent_channels, num_layers=spec.double_layers,
        num_single_layers=spec.single_layers,
        attention_head_dim=spec.head_dim, num_attention_heads=spec.heads,
        joint_attention_dim=spec.stacked_layers * spec.text_dim, axes_dims_rope=spec.rope_axes, rope_theta=2000,
        guidance_embeds=not spec.klein,
    )
    # A velocity of a trained flow model is noise minus data, of std about sqrt(2); nn.Linear's default init gives
    # about 0.6 out of the normalised last layer. At that scale FLUX.2's strongly shifted few-step schedule makes a
    # step's log-probability so insensitive that a bf16-rounded velocity barely shows in it (the conformance suite's
    # flagged engine); weights of variance 2 / fan-in give the trained scale.
    proj_out = transformer.proj_out.weight
    torch.nn.init.normal_(proj_out, std=math.sqrt(2.0 / proj_out.shape[1]))
    return transformer


def _vae(spec: _Spec) -> AutoencoderKLFlux2:
    levels = len(spec.vae_channels)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",) * levels, up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=spec.vae_channels, layers_per_block=spec.vae_layers, latent_channels=spec.latent_channels,
        norm_num_groups=spec.vae_groups, sample_size=spec.vae_sample_size, patch_size=(2, 2),
    )
    # Released statistics are far from (0, 1); these make the pipeline's BatchNorm (de)normalisation visible.
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.5, channels))
    # Saved in float32 like every tensor of an embedded checkpoint (its int64 would be the one exception); the count
    # is never read: the BatchNorm never runs, the pipelines only read its statistics. Loading casts it back.
    vae.bn.num_batches_tracked = vae.bn.num_batches_tracked.float()
    return vae.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules made in the block get parameters of `dtype` (float32 changes nothing)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def flux2_pipeline(size: Flux2Size, *, tokenizer: Any, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Flux2Pipeline | Flux2KleinPipeline:
    """A random-weight FLUX.2 pipeline of `size` (``Flux2KleinPipeline`` for the klein sizes) in `dtype`, in memory,
    on the current default device; bit-reproducible for a given `seed` (:func:`seeded_components`). `tokenizer` gets
    the size's ``model_max_length`` and chat template."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizer.model_max_length = spec.max_length
    tokenizer.chat_template = spec.chat_template
    made_in = dtype if spec.transformer_in_dtype else torch.float32

    def transformer() -> Flux2Transformer2DModel:
        with _default_dtype(made_in):
            return _transformer(spec)

    makers = [("transformer", transformer), ("vae", lambda: _vae(spec)), ("text_encoder", lambda: _text_encoder(spec))]
    components = seeded_components([(name, make, seed) for name, make in makers], dtype)
    with torch.device("cpu"):  # a scheduler keeps its tables on the CPU, as when loaded
        scheduler = FlowMatchEulerDiscreteScheduler(**FLUX2_SCHEDULER_CONFIG)
    if spec.klein:
        return Flux2KleinPipeline(tokenizer=tokenizer, scheduler=scheduler, is_distilled=False, **components)
    return Flux2Pipeline(tokenizer=tokenizer, scheduler=scheduler, **components)


def build_tiny_flux2(out_dir: Path, *, size: Flux2Size = "tiny", seed: int = 0,
                     tokenizer_dir: Path | None = None) -> Path:
    """Builds a tiny random-weight FLUX.2 pipeline (`size`: the module docstring's layout) on the CPU and saves it
    (float32 safetensors), bit-reproducibly (:func:`flux2_pipeline`). ``tokenizer_dir`` is a
    :func:`build_qwen2_tokenizer` output; without it one is built (~3 s)."""
    return build_with_qwen2_tokenizer(lambda tokenizer: flux2_pipeline(size, tokenizer=tokenizer, seed=seed), out_dir,
                                      tokenizer_dir)
