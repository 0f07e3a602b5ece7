"""Teach the moving-shapes model's text encoder the grammar before the video model learns from it.

Wan's UMT5 arrives pretrained on language: to it "left to right" and "right to left" mean different
things before the transformer sees a video. Our small UMT5 starts from random weights, and Wan's
cross-attention sees a prompt as a set of vectors (no positions), so the word order that alone tells
the two ends of an axis apart has to be in those vectors. :func:`teach_grammar` is this model's
stand-in for language pretraining: every token's vector learns to name the prompt's colour, shape and
direction (a linear head per attribute, cross-entropy), on the train prompts only, so held-out
compositions stay unseen and the heads must compose (they do from ``attend_to_neighbours``' init).

Measured (checkpoint README): it puts the order in the vectors, yet the transformer still draws either
end of the asked axis; ``benchmarks/probe_motion_sign.py`` finds it learns a sign the frames show but
not one that only the text carries, with any of the three text encoders tried.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from serve_app.worlds.shapes.scene import COLOURS, SHAPES

from .scene import DIRECTIONS, parse_prompt

__all__ = ["ATTRIBUTES", "attribute_labels", "grammar_accuracy", "teach_grammar"]

ATTRIBUTES: dict[str, list[str]] = {"colour": list(COLOURS), "shape": list(SHAPES), "direction": list(DIRECTIONS)}


def attribute_labels(prompts: Sequence[str]) -> torch.Tensor:
    """[N, 3] vocabulary indices of each prompt's (colour, shape, direction)."""
    specs = [parse_prompt(p) for p in prompts]
    return torch.tensor([[ATTRIBUTES["colour"].index(s.obj.colour), ATTRIBUTES["shape"].index(s.obj.shape),
                          ATTRIBUTES["direction"].index(s.direction)] for s in specs])


def _token_states(text_encoder: nn.Module, tokenizer, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's last hidden states [N, L, D] and the mask [N, L] of real (non-pad) tokens."""
    encoded = tokenizer(list(prompts), padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                        add_special_tokens=True, return_tensors="pt")
    states = text_encoder(encoded.input_ids, attention_mask=encoded.attention_mask).last_hidden_state
    return states, encoded.attention_mask.bool()


def _logits(heads: nn.ModuleList, states: torch.Tensor) -> list[torch.Tensor]:
    return [head(states) for head in heads]


def teach_grammar(text_encoder: nn.Module, tokenizer, prompts: Sequence[str], *, steps: int, lr: float,
                  seed: int = 0) -> nn.ModuleList:
    """Trains ``text_encoder`` in place (full batch of ``prompts``, Adam) so that every real token's
    vector names its prompt's colour, shape and direction; returns the linear heads that read them."""
    labels = attribute_labels(prompts)
    width = text_encoder.config.d_model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        heads = nn.ModuleList(nn.Linear(width, len(values)) for values in ATTRIBUTES.values())
    optimizer = torch.optim.Adam([*text_encoder.parameters(), *heads.parameters()], lr=lr)
    text_encoder.train()
    for _ in range(steps):
        states, real = _token_states(text_encoder, tokenizer, prompts)
        loss = sum(nn.functional.cross_entropy(logits[real], labels[:, i, None].expand_as(real)[real])
                   for i, logits in enumerate(_logits(heads, states)))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    text_encoder.eval()
    return heads


@torch.no_grad()
def grammar_accuracy(text_encoder: nn.Module, tokenizer, heads: nn.ModuleList, prompts: Sequence[str]) -> dict[str, float]:
    """Share of the prompts whose attribute the head reads right from the mean of the real tokens' logits,
    per attribute."""
    labels = attribute_labels(prompts)
    states, real = _token_states(text_encoder, tokenizer, prompts)
    weights = real.float().unsqueeze(-1) / real.sum(dim=1, keepdim=True).unsqueeze(-1)
    return {name: float(((logits * weights).sum(dim=1).argmax(dim=-1) == labels[:, i]).float().mean())
            for i, (name, logits) in enumerate(zip(ATTRIBUTES, _logits(heads, states)))}
