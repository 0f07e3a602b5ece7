"""Pretrain the shapes-world model with the rectified-flow loss on procedurally rendered scenes.

    python -m serve_app.shapes.pretrain --config shapes/pretrain --out /tmp/shapes-model [key=value ...]

writes a diffusers pipeline directory (weights in the config's `save_dtype`), `pretrain.yaml` (the
resolved config) and `pretrain_log.jsonl` (loss and evaluations). The shipped checkpoint
(serve_app/shapes/checkpoints/shapes-qwen-image) is this command's output with the committed
config (configs/shapes/pretrain.yaml, loaded like every config: serve_app.config_loader); its README
records the command and the figures.

Training pairs come from the `train` split of the grammar only, so the `held_out` prompts the
FlowGRPO demo evaluates on are unseen here too. Everything is seeded: model init, scene sampling,
noise and timesteps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from pydantic import Field

from serve_app.config import _Section
from serve_app.config_loader import config_to_yaml, load_config
from serve_app.trainer.ema import EMAModel, averaged_weights

from .evaluation import eval_prompts, score_images
from .model import ShapesModelSpec, build_shapes_qwen_image, save_shapes_pipeline
from .scene import parse_prompt, render


class EvalSettings(_Section):
    """The ODE evaluations during pretraining (train and held-out prompts x fixed seeds)."""

    every: int = Field(1000, ge=0, description="Steps between evaluations; 0 = only at the end.")
    samples_per_prompt: int = Field(4, ge=1, description="Fixed seeds per prompt.")
    num_steps: int = Field(20, ge=1, le=1000, description="ODE steps (the bound of SamplingParams.num_steps).")
    guidance_scale: float = Field(1.0, ge=0, description="True CFG scale (1 = off).")
    seed: int = Field(1234, ge=0, description="Request seed of the evaluation samples.")


class PretrainConfig(_Section):
    """configs/shapes/pretrain.yaml."""

    model: ShapesModelSpec = Field(default_factory=ShapesModelSpec, description="The architecture.")
    seed: int = Field(0, ge=0, description="Seeds model init, scenes, noise and timesteps.")
    steps: int = Field(4000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Scenes per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate after warm-up.")
    warmup_steps: int = Field(200, ge=0, description="Linear learning-rate warm-up.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip_norm: float = Field(1.0, gt=0, description="Max global gradient norm.")
    prompt_dropout: float = Field(0.1, ge=0, le=1, description="Share of pairs trained on the negative prompt (for CFG).")
    negative_prompt: str = Field(" ", description="The prompt of dropped pairs.")
    ema_decay: float = Field(0.999, ge=0, lt=1, description="EMA of the weights is what ships; 0 ships the raw weights.")
    logit_normal_mean: float = Field(1.0, description="sigma = sigmoid(N(mean, std)): SD3's density, shifted to high noise.")
    logit_normal_std: float = Field(1.0, gt=0, description="Spread of the training sigmas.")
    image_size: int = Field(32, ge=8, description="Scene side in pixels.")
    scene_grid: int = Field(8, ge=1, description="Object corners on multiples of this many px (scene.render's grid).")
    scene_sizes: tuple[int, ...] = Field((12, 16), description="Object sides in px; () draws them from scene.SIZE_RANGE.")
    torch_threads: int = Field(2, ge=1, description="torch intra-op threads.")
    save_dtype: str = Field("bfloat16", description="dtype of the saved transformer and text encoder.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Evaluations during the run.")


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


def rectified_flow_loss(policy, latents: torch.Tensor, cond, *, sigmas: torch.Tensor, noise: torch.Tensor,
                        height: int, width: int) -> torch.Tensor:
    """MSE between the predicted velocity and noise - x0 at x_sigma = (1 - sigma) x0 + sigma noise."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - s) * latents + s * noise
    predicted = policy.predict(noisy, sigmas, cond, height=height, width=width).float()
    return torch.nn.functional.mse_loss(predicted, noise - latents)


def evaluate(policy, settings: EvalSettings, image_size: int) -> dict[str, dict[str, float]]:
    """ODE samples of the train and held-out prompts with fixed seeds, scored by the checker."""
    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.schemas import SamplingParams

    params = SamplingParams(height=image_size, width=image_size, num_steps=settings.num_steps, noise_level=0.0,
                            sde_type="ode", sde_window_size=None, guidance_scale=settings.guidance_scale,
                            seed=settings.seed)
    processor = policy.text_processor()
    scores = {}
    for split in ("train", "held_out"):
        prompts = eval_prompts(split)
        batch = sample_group(policy, processor.tokenize(prompts), settings.samples_per_prompt, params, policy_version=0)
        scores[split] = score_images(batch.images, [prompts[i] for i in batch.prompt_index.tolist()])
    return scores


def pretrain(config: PretrainConfig, out_dir: str | Path, *, qwen2_dir: Path | None = None, log=print) -> list[dict]:
    """Build the untrained pipeline, train it, save the (EMA) weights to out_dir at every evaluation.

    Returns the log entries (also in out_dir/pretrain_log.jsonl): at every evaluation the step, the
    mean loss since the previous entry, minutes so far and the accuracies of both splits.
    """
    from serve_app.models import ensure_qwen2_tokenizer
    from serve_app.policies.qwen_image import QwenImagePolicy

    torch.set_num_threads(config.torch_threads)
    out_dir = Path(out_dir)
    qwen2_dir = qwen2_dir or ensure_qwen2_tokenizer()
    with tempfile.TemporaryDirectory() as scratch:
        pipe = build_shapes_qwen_image(Path(scratch) / "untrained", config.model, qwen2_dir=qwen2_dir, seed=config.seed)
        policy = QwenImagePolicy(pipe, device=torch.device("cpu"), dtype=torch.float32)
        trained = [pipe.transformer, pipe.text_encoder]
        for module in trained:
            module.train()
        params = [p for m in trained for p in m.parameters()]
        ema = EMAModel(params, decay=config.ema_decay) if config.ema_decay > 0 else None
        optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)))
        processor = policy.text_processor()
        data = SceneBatches(config.seed, config.batch_size, config.image_size, config.scene_grid, config.scene_sizes)
        tokens = processor.tokenize(data.prompts)
        negative = processor.tokenize([config.negative_prompt])[0]
        generator = torch.Generator().manual_seed(config.seed)
        size = config.image_size
        log_lines, started, losses = [], time.perf_counter(), []
        for step in range(config.steps):
            images, picks = data.next()
            latents = policy.encode_images(images.float() / 255.0)
            dropped = torch.rand(len(picks), generator=generator) < config.prompt_dropout
            batch_tokens = [negative if d else tokens[i] for i, d in zip(picks, dropped.tolist())]
            cond = policy.embed_prompts(batch_tokens)
            sigmas = torch.sigmoid(config.logit_normal_mean + config.logit_normal_std
                                   * torch.randn(len(picks), generator=generator))
            noise = torch.randn(latents.shape, generator=generator)
            loss = rectified_flow_loss(policy, latents, cond, sigmas=sigmas, noise=noise, height=size, width=size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip_norm)
            optimizer.step()
            schedule.step()
            if ema is not None:
                ema.step(params)
            losses.append(float(loss.detach()))
            last = step + 1 == config.steps
            if (config.eval.every and (step + 1) % config.eval.every == 0) or last:
                entry = {"step": step + 1, "loss": float(np.mean(losses)), "minutes": (time.perf_counter() - started) / 60}
                losses.clear()
                with averaged_weights(ema, params) if ema is not None else contextlib.nullcontext():
                    for module in trained:
                        module.eval()
                    entry["eval"] = evaluate(policy, config.eval, size)
                    log_lines.append(entry)
                    # Saved at every evaluation, so a long run leaves a usable model at each stage.
                    _save(pipe, config, log_lines, out_dir, Path(scratch) / f"step{step + 1}")
                    for module in trained:
                        module.train()
                log(json.dumps(entry))
    return log_lines


def _save(pipe, config: PretrainConfig, log_lines: list[dict], out_dir: Path, staging: Path) -> None:
    """The pipeline as it is now (a copy cast to save_dtype), its config and log -> out_dir, replaced."""
    snapshot = copy.deepcopy(pipe)
    save_shapes_pipeline(snapshot, staging, dtype=getattr(torch, config.save_dtype))
    (staging / "pretrain.yaml").write_text(config_to_yaml(config))
    (staging / "pretrain_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log_lines))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(staging, out_dir)
    shutil.rmtree(staging)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="shapes/pretrain", help="config name under configs/ or a .yaml path")
    parser.add_argument("--out", required=True, help="output pipeline directory (replaced)")
    parser.add_argument("overrides", nargs="*", help="overrides, e.g. steps=100 eval.every=50")
    args = parser.parse_args(argv)
    config = load_pretrain_config(args.config, args.overrides)
    started = time.perf_counter()
    entries = pretrain(config, args.out, log=lambda line: print(line, flush=True))
    print(json.dumps({"out": str(args.out), "minutes": (time.perf_counter() - started) / 60, "final": entries[-1]["eval"]}))


if __name__ == "__main__":
    main()
