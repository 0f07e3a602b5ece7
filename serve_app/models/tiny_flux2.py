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
"""

from __future__ import annotations

import math
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

from .tiny_parts import qwen2_tokenizer, save_pipeline, seeded_components
from .tokenizer import QWEN2_ADDED_TOKENS, QWEN2_EOS_ID, QWEN2_PAD_ID, QWEN2_VOCAB_SIZE
from .tokenizer_cache import load_tokenizer

__all__ = ["FLUX2_SCHEDULER_CONFIG", "Flux2Size", "build_tiny_flux2", "flux2_pipeline"]

Flux2Size = Literal["tiny", "tiny-klein"]

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
    stacked_layers: int  # hidden-state layers the pipeline stacks: joint_attention_dim = stacked_layers x text_dim
    heads: int
    head_dim: int
    rope_axes: tuple[int, int, int, int]  # (time, row, column, text position); must sum to head_dim
    latent_channels: int
    vae_channels: tuple[int, ...]  # one level each: factor 2^(levels - 1)


_SPECS: dict[str, _Spec] = {
    "tiny": _Spec(klein=False, max_length=96, chat_template=MISTRAL_SMALL_CHAT_TEMPLATE, text_dim=16, text_layers=31,
                  stacked_layers=3, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4), latent_channels=4,
                  vae_channels=(8, 16, 16, 16)),
    "tiny-klein": _Spec(klein=True, max_length=48, chat_template=QWEN3_CHAT_TEMPLATE, text_dim=16, text_layers=28,
                        stacked_layers=3, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4), latent_channels=4,
                        vae_channels=(8, 16, 16, 16)),
}


def _mistral3(spec: _Spec) -> Mistral3ForConditionalGeneration:
    text = {
        "model_type": "mistral", "vocab_size": QWEN2_VOCAB_SIZE, "hidden_size": spec.text_dim,
        "intermediate_size": 2 * spec.text_dim, "num_hidden_layers": spec.text_layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": spec.text_dim // 2, "max_position_embeddings": 4 * spec.max_length,
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
        vocab_size=QWEN2_VOCAB_SIZE, hidden_size=spec.text_dim, intermediate_size=2 * spec.text_dim,
        num_hidden_layers=spec.text_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=spec.text_dim // 2,
        max_position_embeddings=4 * spec.max_length, tie_word_embeddings=True,  # as Qwen3-4B
        pad_token_id=QWEN2_PAD_ID, bos_token_id=QWEN2_PAD_ID, eos_token_id=QWEN2_EOS_ID,
    )
    return Qwen3ForCausalLM(config).eval()


def _text_encoder(spec: _Spec) -> torch.nn.Module:
    return _qwen3(spec) if spec.klein else _mistral3(spec)


def _transformer(spec: _Spec) -> Flux2Transformer2DModel:
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * spec.latent_channels, num_layers=1, num_single_layers=1,
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
        block_out_channels=spec.vae_channels, layers_per_block=1, latent_channels=spec.latent_channels,
        norm_num_groups=4, sample_size=32, patch_size=(2, 2),
    )
    # Released statistics are far from (0, 1); these make the pipeline's BatchNorm (de)normalisation visible.
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.5, channels))
    # Saved in float32 like every tensor of an embedded checkpoint (its int64 would be the one exception); the count
    # is never read: the BatchNorm never runs, the pipelines only read its statistics. Loading casts it back.
    vae.bn.num_batches_tracked = vae.bn.num_batches_tracked.float()
    return vae.eval()


def flux2_pipeline(size: Flux2Size, *, tokenizer: Any, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> Flux2Pipeline | Flux2KleinPipeline:
    """A random-weight FLUX.2 pipeline of `size` (``Flux2KleinPipeline`` for ``tiny-klein``) in `dtype`, in memory,
    on the current default device; bit-reproducible for a given `seed` (:func:`seeded_components`). `tokenizer` gets
    the size's ``model_max_length`` and chat template."""
    if size not in _SPECS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(_SPECS)}")
    spec = _SPECS[size]
    tokenizer.model_max_length = spec.max_length
    tokenizer.chat_template = spec.chat_template
    makers = [("transformer", _transformer), ("vae", _vae), ("text_encoder", _text_encoder)]
    components = seeded_components([(name, lambda make=make: make(spec), seed) for name, make in makers], dtype)
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
    with qwen2_tokenizer(tokenizer_dir) as tokenizer_dir:
        tokenizer = load_tokenizer(tokenizer_dir)
        with torch.device("cpu"):
            pipe = flux2_pipeline(size, tokenizer=tokenizer, seed=seed)
        return save_pipeline(pipe, out_dir, tokenizer_dir=tokenizer_dir, slots=["tokenizer"])
