"""Pretrain the editing-world model with the rectified-flow loss on procedurally rendered edits.

    python -m serve_app.worlds.edit.pretrain --config edit/pretrain --out /tmp/edit-model [key=value ...]

writes a diffusers pipeline directory (weights in the config's `save_dtype`), `pretrain.yaml` (the
resolved config) and `pretrain_log.jsonl` (loss and evaluations). The shipped checkpoint
(serve_app/worlds/edit/checkpoints/edit-qwen-image) is this command's output with the committed config
(configs/edit/pretrain.yaml); its README records the command and the figures.

Each pair is a source scene with a train instruction (the held-out six are never seen) and one scene
the instruction allows; the model learns to draw the edited scene given the instruction and the
source, through its VL encoder and its source latents. Everything is seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from serve_app.config.loader import load_config
from serve_app.worlds.pretraining import EvalSettings, FlowPretrainSettings, ode_sample_batch, pretrain_main, pretrain_world
from serve_app.worlds.shapes.model import ShapesModelSpec

from .evaluation import eval_examples, instructions, score_edits
from .instructions import IMAGE_SIZE, sample_example
from .model import build_edit_qwen_image


class PretrainConfig(FlowPretrainSettings):
    """configs/edit/pretrain.yaml."""

    model: ShapesModelSpec = Field(default_factory=ShapesModelSpec, description="The architecture (the shapes model's).")
    warm_start: bool = Field(True, description="Start from the shipped shapes model's transformer and text weights.")
    eval_scenes_per_instruction: int = Field(4, ge=1, description="Source scenes per instruction in the evaluations.")


def load_pretrain_config(name: str | Path = "edit/pretrain", overrides: Sequence[str] = ()) -> PretrainConfig:
    """A config under configs/ (or a .yaml path) with overrides; unknown keys fail."""
    return load_config(str(name), overrides, schema=PretrainConfig)


class EditBatches:
    """An endless, seeded stream of (uint8 targets [B, 3, S, S], instruction indices, sources) over the
    train instructions."""

    def __init__(self, seed: int, batch_size: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.prompts = instructions("train")
        self.batch_size = batch_size

    def next(self) -> tuple[torch.Tensor, list[int], list[list[torch.Tensor]]]:
        picks = self.rng.integers(0, len(self.prompts), size=self.batch_size).tolist()
        examples = [sample_example(self.prompts[i], self.rng) for i in picks]
        targets = torch.from_numpy(np.stack([e.target.render() for e in examples]))
        return targets, picks, [[torch.from_numpy(e.source.render())] for e in examples]


def edit_samples(policy, split: str, settings: EvalSettings, scenes_per_instruction: int):
    """ODE samples of a split's fixed evaluation prompts: (uint8 edits, their instructions, their sources)."""
    examples = eval_examples(split, scenes_per_instruction)
    texts = [e.instruction.text() for e in examples]
    sources = [torch.from_numpy(e.source.render()) for e in examples]
    tokens = [replace(t, images=[s]) for t, s in zip(policy.text_processor().tokenize(texts), sources)]
    batch = ode_sample_batch(policy, tokens, settings, size=IMAGE_SIZE)
    index = batch.prompt_index.tolist()
    return batch.images, [texts[i] for i in index], [sources[i] for i in index]


def evaluate(policy, settings: EvalSettings, scenes_per_instruction: int) -> dict[str, dict[str, float]]:
    """ODE samples of the train and held-out evaluation prompts with fixed seeds, scored by the checker."""
    return {split: score_edits(*edit_samples(policy, split, settings, scenes_per_instruction))
            for split in ("train", "held_out")}


def pretrain(config: PretrainConfig, out_dir: str | Path, *, qwen2_dir: Path | None = None, log=print) -> list[dict]:
    """Build the untrained pipeline, train its transformer, save the (EMA) weights to out_dir at every
    evaluation; returns the log entries (also in out_dir/pretrain_log.jsonl)."""
    from serve_app.models import ensure_qwen2_tokenizer
    from serve_app.policies.qwen_image_edit import QwenImageEditPolicy

    if config.train_text_encoder:
        raise ValueError("the edit model keeps its text encoder as built (train_text_encoder: false)")
    qwen2_dir = qwen2_dir or ensure_qwen2_tokenizer()
    return pretrain_world(
        config, out_dir,
        build=lambda where: build_edit_qwen_image(where, config.model, qwen2_dir=qwen2_dir, seed=config.seed,
                                                  warm_start=config.warm_start),
        policy_class=QwenImageEditPolicy,
        batches=EditBatches(config.seed, config.batch_size),
        encode=lambda policy, images: policy.encode_images(images),
        evaluate=lambda policy: evaluate(policy, config.eval, config.eval_scenes_per_instruction),
        size=IMAGE_SIZE, log=log, embed=lambda policy: policy.encode_prompts,
    )


def main(argv: list[str] | None = None) -> None:
    pretrain_main(__doc__, "edit/pretrain", load_pretrain_config, pretrain, argv)


if __name__ == "__main__":
    main()
