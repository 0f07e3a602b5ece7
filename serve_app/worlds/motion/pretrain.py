"""Pretrain the moving-shapes model with the rectified-flow loss on procedurally rendered videos.

    python -m serve_app.worlds.motion.pretrain --config motion/pretrain --out /tmp/motion-model [key=value ...]

writes a diffusers WanPipeline directory (weights in the config's `save_dtype`), `pretrain.yaml` (the
resolved config) and `pretrain_log.jsonl` (loss and evaluations). The shipped checkpoint
(serve_app/worlds/motion/checkpoints/motion-wan) is this command's output with the committed config
(configs/motion/pretrain.yaml); its README records the command and the figures.

Training videos come from the `train` split of the motion grammar only, so the `held_out` prompts
(unseen combinations of colour, shape and direction) are unseen here too. Everything is seeded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from serve_app.config.loader import load_config
from serve_app.worlds.pretraining import EvalSettings, FlowPretrainSettings, evaluate_splits, pretrain_main, pretrain_world

from .evaluation import eval_prompts, score_videos
from .model import MotionModelSpec, build_motion_wan
from .scene import FRAMES, MIN_TRAVEL_FRAC, parse_prompt, render


class MotionPretrainConfig(FlowPretrainSettings):
    """configs/motion/pretrain.yaml."""

    model: MotionModelSpec = Field(default_factory=MotionModelSpec, description="The architecture.")
    image_size: int = Field(32, ge=8, description="Frame side in pixels.")
    num_frames: int = Field(FRAMES, ge=2, description="Frames per video.")
    scene_sides: tuple[int, ...] = Field((), description="Object sides in px; () draws them from the shapes world's SIZE_RANGE.")
    min_travel_frac: float = Field(MIN_TRAVEL_FRAC, gt=0, le=1, description="Least travel, as a fraction of the side.")
    scene_grid: int = Field(1, ge=1, description="Travel, start and cross position on multiples of this many px.")


def load_pretrain_config(name: str | Path = "motion/pretrain", overrides: Sequence[str] = ()) -> MotionPretrainConfig:
    """A config under configs/ (or a .yaml path, such as a checkpoint's pretrain.yaml) with overrides."""
    return load_config(str(name), overrides, schema=MotionPretrainConfig)


class VideoBatches:
    """An endless, seeded stream of (uint8 videos [B, F, 3, S, S], prompt indices) of the train prompts."""

    def __init__(self, config: MotionPretrainConfig) -> None:
        self.rng = np.random.default_rng(config.seed)
        self.prompts = eval_prompts("train")
        self.specs = [parse_prompt(p) for p in self.prompts]
        self.config = config

    def next(self) -> tuple[torch.Tensor, list[int]]:
        c = self.config
        picks = self.rng.integers(0, len(self.prompts), size=c.batch_size).tolist()
        videos = np.stack([render(self.specs[i], self.rng, frames=c.num_frames, size=c.image_size,
                                  sides=c.scene_sides, min_travel_frac=c.min_travel_frac, grid=c.scene_grid)
                           for i in picks])
        return torch.from_numpy(videos), picks


def evaluate(policy, settings: EvalSettings, size: int, frames: int) -> dict[str, dict[str, float]]:
    """ODE samples of the train and held-out prompts with fixed seeds, scored by the motion checker."""
    return evaluate_splits(policy, settings, eval_prompts, score_videos, size=size, num_frames=frames)


def pretrain(config: MotionPretrainConfig, out_dir: str | Path, *, qwen2_dir: Path | None = None, log=print) -> list[dict]:
    """Build the untrained pipeline, train it, save the (EMA) weights to out_dir at every evaluation."""
    from serve_app.models import ensure_qwen2_tokenizer
    from serve_app.policies.wan import WanPolicy

    qwen2_dir = qwen2_dir or ensure_qwen2_tokenizer()
    return pretrain_world(
        config, out_dir,
        build=lambda where: build_motion_wan(where, config.model, qwen2_dir=qwen2_dir, seed=config.seed),
        policy_class=WanPolicy,
        batches=VideoBatches(config),
        encode=lambda policy, videos: policy.encode_videos(videos),
        evaluate=lambda policy: evaluate(policy, config.eval, config.image_size, config.num_frames),
        size=config.image_size, log=log,
    )


def main(argv: list[str] | None = None) -> None:
    pretrain_main(__doc__, "motion/pretrain", load_pretrain_config, pretrain, argv)


if __name__ == "__main__":
    main()
