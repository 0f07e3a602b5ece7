"""Pretrain the shapes-world model with the rectified-flow loss on procedurally rendered scenes.

    python -m serve_app.shapes.pretrain --config configs/shapes/pretrain.yaml --out /tmp/shapes-model

writes a diffusers pipeline directory (weights in the config's `save_dtype`), `pretrain.yaml` (the
resolved config) and `pretrain_log.jsonl` (loss and evaluations). The shipped checkpoint
(serve_app/models/checkpoints/shapes-qwen-image) is this command's output with the committed
config; its README records the command and the figures.

Training pairs come from the `train` split of the grammar only, so the `held_out` prompts the
FlowGRPO demo evaluates on are unseen here too. Everything is seeded: model init, scene sampling,
noise and timesteps.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from serve_app.models.shapes_qwen_image import ShapesModelSpec, build_shapes_qwen_image, save_shapes_pipeline

from .evaluation import eval_prompts, score_images
from .scene import parse_prompt, render


@dataclass
class EvalSettings:
    every: int = 1000  # steps between evaluations; 0 = only at the end
    samples_per_prompt: int = 4
    num_steps: int = 20
    guidance_scale: float = 1.0
    seed: int = 1234


@dataclass
class PretrainConfig:
    model: ShapesModelSpec = field(default_factory=ShapesModelSpec)
    seed: int = 0
    steps: int = 4000
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 200
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    prompt_dropout: float = 0.1  # share of pairs trained on the negative prompt, so true CFG works
    negative_prompt: str = " "
    ema_decay: float = 0.999  # the shipped weights are the EMA; 0 ships the raw weights
    logit_normal_mean: float = 1.0  # sigma = sigmoid(N(mean, std)): SD3's timestep density, shifted to high noise
    logit_normal_std: float = 1.0
    image_size: int = 32
    scene_grid: int = 8  # object corners on multiples of 8 px: 3 x 3 places (scene.render's `grid`)
    scene_sizes: tuple[int, ...] = (12, 16)  # object sides in px; () draws them from scene.SIZE_RANGE
    torch_threads: int = 2
    save_dtype: str = "bfloat16"
    eval: EvalSettings = field(default_factory=EvalSettings)


def load_pretrain_config(path: str | Path | None, overrides: list[str] = ()) -> PretrainConfig:
    """The YAML at `path` (if any) and dotted overrides over the defaults; unknown keys fail."""
    schema = OmegaConf.structured(PretrainConfig)
    parts = [schema]
    if path is not None:
        parts.append(OmegaConf.load(path))
    parts.append(OmegaConf.from_dotlist(list(overrides)))
    merged = OmegaConf.merge(*parts)
    config = OmegaConf.to_object(merged)
    config.scene_sizes = tuple(config.scene_sizes)
    config.model = ShapesModelSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in asdict(config.model).items()})
    return config


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
        batch = sample_group(policy, processor.tokenize(prompts), settings.samples_per_prompt, params)
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
        ema = [p.detach().clone() for p in params]
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
            if config.ema_decay > 0:
                # Warm-up (diffusers' EMAModel formula): early on the average follows the weights
                # closely instead of keeping the random initialisation for thousands of steps.
                decay = min(config.ema_decay, (1 + step) / (10 + step))
                with torch.no_grad():
                    torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - decay)
            losses.append(float(loss.detach()))
            last = step + 1 == config.steps
            if (config.eval.every and (step + 1) % config.eval.every == 0) or last:
                entry = {"step": step + 1, "loss": float(np.mean(losses)), "minutes": (time.perf_counter() - started) / 60}
                losses.clear()
                with _weights_swapped(params, ema if config.ema_decay > 0 else params):
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
    OmegaConf.save(OmegaConf.structured(config), staging / "pretrain.yaml")
    (staging / "pretrain_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log_lines))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(staging, out_dir)
    shutil.rmtree(staging)


class _weights_swapped:
    """Temporarily load `replacement` tensors into `params` (evaluating the EMA mid-training)."""

    def __init__(self, params: list[torch.Tensor], replacement: list[torch.Tensor]) -> None:
        self.params, self.replacement = params, replacement

    def __enter__(self) -> None:
        if self.replacement is self.params:
            self.saved = None
            return
        self.saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, r in zip(self.params, self.replacement):
                p.copy_(r)

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            with torch.no_grad():
                for p, s in zip(self.params, self.saved):
                    p.copy_(s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/shapes/pretrain.yaml", help="YAML over PretrainConfig's defaults")
    parser.add_argument("--out", required=True, help="output pipeline directory (replaced)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. steps=100 eval.every=50")
    args = parser.parse_args(argv)
    config = load_pretrain_config(args.config, args.overrides)
    started = time.perf_counter()
    entries = pretrain(config, args.out, log=lambda line: print(line, flush=True))
    print(json.dumps({"out": str(args.out), "minutes": (time.perf_counter() - started) / 60, "final": entries[-1]["eval"]}))


if __name__ == "__main__":
    main()
