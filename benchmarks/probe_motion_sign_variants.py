"""Would another transformer let the text set the sign of a motion? Runs probe_motion_sign's cases with
WanTransformer3DModel changed in this process only, in ways stock Wan is not (but one). Prints JSON.

Variants (each starts where stock Wan starts, so step 0 is the stock model):

- ``stock``: probe_motion_sign as it is.
- ``frame_embedding``: a learned vector per latent frame added to every token (absolute time; Wan's
  tokens know only relative positions, through the rotary embedding).
- ``position_embedding``: a learned vector per (frame, row, column) token (absolute time and place).
- ``text_modulation``: the prompt's mean text vector added to every block's timestep modulation (scale,
  shift and gate of the self-attention and the feed-forward), so the text acts on every token the way
  the noise level does instead of only through the cross-attention.
- ``temporal_patch``: the stock ``patch_size=(2, 2, 2)``: one token spans two frames, so a token's
  own values show which way an edge moved (as a Wan VAE latent frame folds four frames); the same
  model as ``probe_motion_sign.py model.temporal_patch=2``.

The learned additions start at zero. Their weights are saved with the transformer's and loaded back by
the same patched class for the evaluation.

    .venv/bin/python benchmarks/probe_motion_sign_variants.py --variant position_embedding \\
        [--case sign_only_in_the_words ...] [--steps 1200] [--samples-per-prompt 16] [key=value ...]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from torch import nn

from serve_app.worlds.motion.pretrain import load_pretrain_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
import probe_motion_sign  # noqa: E402  (a sibling script, not a package)

MAX_FRAMES = 16  # latent frames a frame_embedding covers


def _add_to_patch_tokens(transformer: WanTransformer3DModel, name: str, embedding: torch.Tensor, per_frame: bool) -> None:
    """Adds the parameter ``name`` ([frames, dim] or [dim, frames, rows, columns]) to the patch embedding's output."""
    transformer.register_parameter(name, nn.Parameter(embedding))

    def hook(module, inputs, tokens):  # tokens: [B, dim, frames, rows, columns]
        # Looked up at each call: from_pretrained replaces the parameter built on the meta device.
        embedding = getattr(transformer, name)
        if per_frame:
            return tokens + embedding[: tokens.shape[2]].T[None, :, :, None, None].to(tokens.dtype)
        return tokens + embedding[None, :, : tokens.shape[2], : tokens.shape[3], : tokens.shape[4]].to(tokens.dtype)

    transformer.patch_embedding.register_forward_hook(hook)


def _modulate_with_text(transformer: WanTransformer3DModel, dim: int) -> None:
    transformer.text_modulation = nn.Linear(dim, 6 * dim)
    nn.init.zeros_(transformer.text_modulation.weight)
    nn.init.zeros_(transformer.text_modulation.bias)
    embedder = transformer.condition_embedder
    stock_forward = embedder.forward

    def forward(timestep, encoder_hidden_states, encoder_hidden_states_image=None, timestep_seq_len=None):
        temb, modulation, text, image = stock_forward(timestep, encoder_hidden_states, encoder_hidden_states_image,
                                                      timestep_seq_len)
        return temb, modulation + transformer.text_modulation(nn.functional.silu(text.mean(1))), text, image

    embedder.forward = forward


def patch_transformer(variant: str, size: int, frames: int) -> None:
    """Changes WanTransformer3DModel (this process only) so that every model built or loaded is ``variant``."""
    if variant in ("stock", "temporal_patch"):  # temporal_patch is a model option: main passes it as one
        return
    stock_init = WanTransformer3DModel.__init__

    @functools.wraps(stock_init)  # from_pretrained reads the config from the wrapped signature
    def init(self, *args, **kwargs):
        stock_init(self, *args, **kwargs)
        dim = self.config.num_attention_heads * self.config.attention_head_dim
        side = size // (2 * 2)  # the pixel VAE's patch 2, the transformer's 2
        if variant == "frame_embedding":
            _add_to_patch_tokens(self, "frame_embedding", torch.zeros(MAX_FRAMES, dim), per_frame=True)
        elif variant == "position_embedding":
            _add_to_patch_tokens(self, "position_embedding", torch.zeros(dim, frames, side, side), per_frame=False)
        elif variant == "text_modulation":
            _modulate_with_text(self, dim)

    WanTransformer3DModel.__init__ = init


VARIANTS = ("stock", "frame_embedding", "position_embedding", "text_modulation", "temporal_patch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--case", action="append", choices=list(probe_motion_sign.CASES),
                        help="Repeatable; default: sign_only_in_the_words.")
    parser.add_argument("--steps", type=int, default=1200, help="Pretraining steps per case.")
    parser.add_argument("--samples-per-prompt", type=int, default=16, help="ODE samples per prompt (fixed seeds).")
    parser.add_argument("overrides", nargs="*", help="Overrides of configs/motion/pretrain.yaml for every case.")
    args = parser.parse_args()
    if args.variant == "temporal_patch":
        args.overrides.append("model.temporal_patch=2")
    config = load_pretrain_config("motion/pretrain", args.overrides)
    patch_transformer(args.variant, config.image_size, config.num_frames)
    results = {name: probe_motion_sign.run_case(name, args.steps, args.samples_per_prompt, args.overrides)
               for name in args.case or ["sign_only_in_the_words"]}
    print(json.dumps({"benchmark": "probe_motion_sign_variants", "variant": args.variant, "cases": results}, indent=2))


if __name__ == "__main__":
    main()
