"""Rectified-flow pretraining of a procedural world's model: the loop both worlds' pretrain commands
run (serve_app/worlds/shapes/pretrain.py for images, serve_app/worlds/motion/pretrain.py for videos).

A world supplies the untrained pipeline and its policy, an endless seeded stream of
(normalised latents, prompt tokens) pairs, an evaluation and a way to save the pipeline; this loop
supplies the loss, prompt dropout (for CFG), the logit-normal training sigmas, AdamW with warm-up,
gradient clipping, the EMA that ships, and evaluations (on the EMA weights) that save the model as it
is at each, so a long run leaves a usable model at every stage.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from serve_app.config import Section
from serve_app.config.loader import config_to_yaml
from serve_app.models.pixel_vae import save_pixel_space_pipeline
from serve_app.schemas import PromptEmbeds, PromptTokens
from serve_app.trainer.ema import averaged_weights, new_ema

__all__ = ["EvalSettings", "FlowPretrainSettings", "evaluate_splits", "ode_sample_batch", "ode_samples", "pretrain_flow_model", "pretrain_main",
           "pretrain_world", "rectified_flow_loss", "save_checkpoint"]


class EvalSettings(Section):
    """The ODE evaluations during pretraining (train and held-out prompts x fixed seeds)."""

    every: int = Field(1000, ge=0, description="Steps between evaluations; 0 = only at the end.")
    samples_per_prompt: int = Field(4, ge=1, description="Fixed seeds per prompt.")
    num_steps: int = Field(20, ge=1, le=1000, description="ODE steps (the bound of SamplingParams.num_steps).")
    guidance_scale: float = Field(1.0, ge=0, description="True CFG scale (1 = off).")
    seed: int = Field(1234, ge=0, description="Request seed of the evaluation samples.")


class FlowPretrainSettings(Section):
    """The optimisation of a pretraining run (each world's config adds its model and data)."""

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
    train_text_encoder: bool = Field(True, description="Train the text encoder with the transformer; false keeps "
                                                       "it as built (as Wan and SD3 keep their T5 frozen).")
    logit_normal_mean: float = Field(1.0, description="sigma = sigmoid(N(mean, std)): SD3's density, shifted to high noise.")
    logit_normal_std: float = Field(1.0, gt=0, description="Spread of the training sigmas.")
    torch_threads: int = Field(2, ge=1, description="torch intra-op threads.")
    save_dtype: str = Field("bfloat16", description="dtype of the saved transformer and text encoder.")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="Evaluations during the run.")


def rectified_flow_loss(policy, latents: torch.Tensor, cond: PromptEmbeds, *, sigmas: torch.Tensor,
                        noise: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """MSE between the predicted velocity and noise - x0 at x_sigma = (1 - sigma) x0 + sigma noise."""
    s = sigmas.view(-1, *([1] * (latents.ndim - 1)))
    noisy = (1.0 - s) * latents + s * noise
    predicted = policy.predict(noisy, sigmas, cond, height=height, width=width).float()
    return torch.nn.functional.mse_loss(predicted, noise - latents)


def pretrain_flow_model(
    config: FlowPretrainSettings,
    policy: Any,
    trained: Sequence[torch.nn.Module],
    next_batch: Callable[[], tuple[torch.Tensor, list[PromptTokens]]],
    *,
    size: int,
    evaluate: Callable[[], dict[str, Any]],
    save: Callable[[list[dict]], None],
    log: Callable[[str], None] = print,
    embed: Callable[[list[PromptTokens]], PromptEmbeds] | None = None,
) -> list[dict]:
    """Train ``trained`` (the policy's transformer and text encoder) for ``config.steps`` steps.

    ``next_batch()`` gives a batch of normalised latents and the prompt tokens of its rows; ``size``
    is the side in pixels. At every evaluation (``config.eval.every`` and the last step) the EMA
    weights are swapped in, ``evaluate()`` scores them and ``save(log_entries)`` writes the model.
    Returns the log entries: the step, the mean loss since the previous entry, minutes so far and
    what ``evaluate`` returned (under "eval"). ``embed``: how prompt tokens become the transformer's
    conditioning (default ``policy.embed_prompts``, through the text encoder with gradients). A dropped
    pair keeps its input images: an edit model's negative prompt is conditioned on the same image.
    """
    embed = embed or policy.embed_prompts
    torch.set_num_threads(config.torch_threads)
    for module in trained:
        module.train()
    params = [p for m in trained for p in m.parameters()]
    ema = new_ema(params, config.ema_decay) if config.ema_decay > 0 else None
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)))
    negative = policy.text_processor().tokenize([config.negative_prompt])[0]
    generator = torch.Generator().manual_seed(config.seed)
    entries, started, losses = [], time.perf_counter(), []
    for step in range(config.steps):
        latents, tokens = next_batch()
        dropped = torch.rand(len(tokens), generator=generator) < config.prompt_dropout
        cond = embed([replace(negative, images=t.images, condition_images=t.condition_images) if d else t
                      for t, d in zip(tokens, dropped.tolist())])
        sigmas = torch.sigmoid(config.logit_normal_mean + config.logit_normal_std
                               * torch.randn(len(tokens), generator=generator))
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
                entry["eval"] = evaluate()
                entries.append(entry)
                save(entries)
                for module in trained:
                    module.train()
            log(json.dumps(entry))
    return entries


def save_checkpoint(pipe: Any, config: FlowPretrainSettings, entries: list[dict], out_dir: Path, staging: Path) -> None:
    """The pipeline as it is now (a copy cast to save_dtype), its config (`pretrain.yaml`) and log
    (`pretrain_log.jsonl`) -> out_dir, replaced (written to ``staging`` first)."""
    snapshot = copy.deepcopy(pipe)
    save_pixel_space_pipeline(snapshot, staging, dtype=getattr(torch, config.save_dtype))
    (staging / "pretrain.yaml").write_text(config_to_yaml(config))
    (staging / "pretrain_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(staging, out_dir)
    shutil.rmtree(staging)


def pretrain_main(doc: str, default_config: str, load: Callable[..., FlowPretrainSettings],
                  pretrain: Callable[..., list[dict]], argv: list[str] | None = None) -> None:
    """The command line of a world's pretrain module: --config, --out and key=value overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--config", default=default_config, help="config name under configs/ or a .yaml path")
    parser.add_argument("--out", required=True, help="output pipeline directory (replaced)")
    parser.add_argument("overrides", nargs="*", help="overrides, e.g. steps=100 eval.every=50")
    args = parser.parse_args(argv)
    config = load(args.config, args.overrides)
    started = time.perf_counter()
    entries = pretrain(config, args.out, log=lambda line: print(line, flush=True))
    print(json.dumps({"out": str(args.out), "minutes": (time.perf_counter() - started) / 60, "final": entries[-1]["eval"]}))


def ode_sample_batch(policy: Any, tokens: Sequence[PromptTokens], settings: EvalSettings, *, size: int,
                     num_frames: int = 1) -> Any:
    """ODE samples (fixed seeds, ``settings.samples_per_prompt`` of every prompt) of tokenized prompts (with
    their input images, for an image-conditioned model): the sampled Trajectory."""
    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.config.sampling import SamplingParams

    params = SamplingParams(height=size, width=size, num_frames=num_frames, num_steps=settings.num_steps,
                            noise_level=0.0, sde_type="ode", sde_window_size=None,
                            guidance_scale=settings.guidance_scale, seed=settings.seed)
    return sample_group(policy, list(tokens), settings.samples_per_prompt, params, policy_version=0)


def ode_samples(policy: Any, prompts: Sequence[str], settings: EvalSettings, *, size: int,
                num_frames: int = 1) -> tuple[torch.Tensor, list[str]]:
    """ODE samples (fixed seeds, ``settings.samples_per_prompt`` of every prompt): the uint8 samples and
    each one's prompt."""
    prompts = list(prompts)
    batch = ode_sample_batch(policy, policy.text_processor().tokenize(prompts), settings, size=size,
                             num_frames=num_frames)
    return batch.images, [prompts[i] for i in batch.prompt_index.tolist()]


def evaluate_splits(policy: Any, settings: EvalSettings, prompts_of: Callable[[str], list[str]],
                    score: Callable[[torch.Tensor, list[str]], dict[str, float]], *, size: int,
                    num_frames: int = 1) -> dict[str, dict[str, float]]:
    """ODE samples (fixed seeds) of the train and held-out prompts (``prompts_of(split)``), scored by
    the world's checker (``score(uint8 samples, their prompts)``)."""
    return {split: score(*ode_samples(policy, prompts_of(split), settings, size=size, num_frames=num_frames))
            for split in ("train", "held_out")}


def pretrain_world(config: FlowPretrainSettings, out_dir: str | Path, *, build: Callable[[Path], Any],
                   policy_class: type, batches: Any, encode: Callable[[Any, torch.Tensor], torch.Tensor],
                   evaluate: Callable[[Any], dict[str, Any]], size: int, log: Callable[[str], None] = print,
                   embed: Callable[[Any], Callable[[list[PromptTokens]], PromptEmbeds]] | None = None) -> list[dict]:
    """A world's pretrain command: ``build(dir)`` makes the untrained pipeline, ``batches.next()``
    gives (uint8 samples, indices into ``batches.prompts``) or, for an image-conditioned model, also
    each sample's input images, ``encode(policy, samples in [0, 1])`` their latents,
    ``evaluate(policy)`` the scores logged and saved with the (EMA) weights to ``out_dir`` at every
    evaluation; ``embed(policy)``, when given, replaces ``policy.embed_prompts`` (a frozen encoder's
    ``encode_prompts``). Returns the log entries (also in out_dir/pretrain_log.jsonl)."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as scratch:
        pipe = build(Path(scratch) / "untrained")
        policy = policy_class(pipe, device=torch.device("cpu"), dtype=torch.float32)
        tokens = policy.text_processor().tokenize(batches.prompts)

        def next_batch():
            samples, picks, *inputs = batches.next()
            rows = [tokens[i] for i in picks]
            if inputs:  # each sample's own input images
                rows = [replace(t, images=images) for t, images in zip(rows, inputs[0], strict=True)]
            return encode(policy, samples.float() / 255.0), rows

        def save(entries: list[dict]) -> None:
            save_checkpoint(pipe, config, entries, out_dir, Path(scratch) / f"step{entries[-1]['step']}")

        trained = [pipe.transformer]
        if config.train_text_encoder:
            trained.append(pipe.text_encoder)
        else:
            pipe.text_encoder.requires_grad_(False).eval()
        return pretrain_flow_model(config, policy, trained, next_batch, size=size, evaluate=lambda: evaluate(policy),
                                   save=save, log=log, embed=None if embed is None else embed(policy))
