"""Pretrain the shapes-world model with the rectified-flow loss on procedurally rendered scenes.

    python -m serve_app.worlds.shapes.pretrain --config shapes/pretrain --out /tmp/shapes-model [key=value ...]

writes a diffusers pipeline directory (weights in the config's `save_dtype`), `pretrain.yaml` (the
resolved config) and `pretrain_log.jsonl` (loss and evaluations). The shipped checkpoint
(serve_app/worlds/shapes/checkpoints/shapes-qwen-image) is this command's output with the committed
config (configs/shapes/pretrain.yaml, loaded like every config: serve_app.config.loader); its README
records the command and the figures.

Training pairs come from the `train` split of the grammar only, so the `held_out` prompts the
FlowGRPO demo evaluates on are unseen here too. Everything is seeded: model init, scene sampling,
noise and timesteps.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from serve_app.config.loader import load_config
from serve_app.worlds.pretraining import EvalSettings, FlowPretrainSettings, evaluate_splits, pretrain_main, pretrain_world

from .evaluation import eval_prompts, score_images
from .model import ShapesModelSpec, build_shapes_qwen_image
from .scene import parse_prompt, render


class PretrainConfig(FlowPretrainSettings):
    """configs/shapes/pretrain.yaml."""

    model: ShapesModelSpec = Field(default_factory=ShapesModelSpec, description="The architecture.")
    image_size: int = Field(32, ge=8, description="Scene side in pixels.")
    scene_grid: int = Field(8, ge=1, description="Object corners on multiples of this many px (scene.render's grid).")
    scene_sizes: tuple[int, ...] = Field((12, 16), description="Object sides in px; () draws them from scene.SIZE_RANGE.")


def load_pretrain_config(name: str | Path = "shapes/pretrain", overrides: Sequence[str] = ()) -> PretrainConfig:
    """A config under configs/ (or a .yaml path, such as a checkpoint's pretrain.yaml) with overrides;
    unknown keys fail naming the key and the file or override."""
    return load_config(str(name), overrides, schema=PretrainConfig)


class SceneBatches:
    """An endless, seeded stream of (uint8 images [B, 3, S, S], prompts) from the train prompts."""

    def __init__(self, seed: int, batch_size: int, image_size: int, grid: int = 1, sizes: tuple[int, ...] = ()) -> None:
        self.rng = np.random.default_rng(seed)
        self.prompts = eval_prompts("train")
        self.specs = [parse_prompt(p) for p in self.prompts]
        self.batch_size, self.image_size, self.grid, self.sizes = batch_size, image_size, grid, sizes

    def next(self) -> tuple[torch.Tensor, list[int]]:
        picks = self.rng.integers(0, len(self.prompts), size=self.batch_size).tolist()
        images = np.stack([render(self.specs[i], self.rng, self.image_size, grid=self.grid, sizes=self.sizes or None)
                           for i in picks])
        return torch.from_numpy(images), picks


def evaluate(policy, settings: EvalSettings, image_size: int) -> dict[str, dict[str, float]]:
    """ODE samples of the train and held-out prompts with fixed seeds, scored by the checker."""
    return evaluate_splits(policy, settings, eval_prompts, score_images, size=image_size)


def pretrain(config: PretrainConfig, out_dir: str | Path, *, qwen2_dir: Path | None = None, log=print) -> list[dict]:
    """Build the untrained pipeline, train it, save the (EMA) weights to out_dir at every evaluation.

    Returns the log entries (also in out_dir/pretrain_log.jsonl): at every evaluation the step, the
    mean loss since the previous entry, minutes so far and the accuracies of both splits.
    """
    from serve_app.models import ensure_qwen2_tokenizer
    from serve_app.policies.qwen_image import QwenImagePolicy

    qwen2_dir = qwen2_dir or ensure_qwen2_tokenizer()
    return pretrain_world(
        config, out_dir,
        build=lambda where: build_shapes_qwen_image(where, config.model, qwen2_dir=qwen2_dir, seed=config.seed),
        policy_class=QwenImagePolicy,
        batches=SceneBatches(config.seed, config.batch_size, config.image_size, config.scene_grid, config.scene_sizes),
        encode=lambda policy, images: policy.encode_images(images),
        evaluate=lambda policy: evaluate(policy, config.eval, config.image_size),
        size=config.image_size, log=log,
    )


def main(argv: list[str] | None = None) -> None:
    pretrain_main(__doc__, "shapes/pretrain", load_pretrain_config, pretrain, argv)


if __name__ == "__main__":
    main()
