"""Our sampler (ODE, and Flow-SDE with log-probs) against the stock pipeline's ``__call__``:
QwenImagePipeline for the image cases, WanPipeline for the video ones.

Same model, steps, batch, size, frames and initial latents, measured side by side, interleaved, in
one run. Prints JSON: min/median/max seconds over repeats, the ratios to the stock pipeline, and the
bytes per sample of the trajectory our SDE rollout returns (pickled, as it travels between actors).

    .venv/bin/python benchmarks/bench_sampler.py [--repeats 5] [--sizes tiny small tiny-wan motion-wan]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import platform
import statistics
import time
from typing import NamedTuple

import torch

from serve_app.flowgrpo.sampler import encode_conditioning, initial_latents, rollout
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.models import ensure_embedded_model
from serve_app.policies import load_policy
from serve_app.schemas import SamplingParams



class Case(NamedTuple):
    model: str  # an embedded model's name or import path
    size: int
    frames: int = 1  # > 1: a video family
    components: dict[str, str] = {}


CASES = {
    "tiny": Case("tiny-qwen-image", 32),
    "small": Case("small-qwen-image", 128),
    # The random tiny Wan2.1 (3-D causal VAE, temporal factor 4): 9 frames = 3 latent frames.
    "tiny-wan": Case("tiny-wan", 32, 9),
    # The pretrained moving-shapes Wan (pixel-space VAE): the make demo WORLD=video model and sizes.
    "motion-wan": Case("serve_app.worlds.motion.model:MOTION_WAN", 32, 4,
                       {"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"}),
}


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def trajectory_bytes(trajectory) -> int:
    buffer = io.BytesIO()
    pickle.dump(trajectory, buffer, protocol=5)
    return buffer.getbuffer().nbytes


def bench_case(name: str, *, batch: int, steps: int, repeats: int, guidance: float) -> dict:
    model, size, frames, components = CASES[name]
    policy = load_policy(ensure_embedded_model(model), components=components or None)
    prompt = "a red circle moving left to right" if frames > 1 else "a red circle next to a blue square"
    tokens = policy.text_processor().tokenize([prompt])
    base = SamplingParams(height=size, width=size, num_frames=frames, num_steps=steps, guidance_scale=guidance, seed=0)
    variants = {
        "ours_ode": base.model_copy(update={"noise_level": 0.0, "sde_type": "ode", "sde_window_size": None}),
        "ours_sde_window2": base.model_copy(update={"noise_level": 1.2, "sde_window_size": 2, "sde_window_range": (0, 5)}),
        "ours_sde_all_steps": base.model_copy(update={"noise_level": 1.2, "sde_window_size": None}),
    }
    seeds = torch.arange(batch)
    index = torch.zeros(batch, dtype=torch.long)
    latents = initial_latents(policy, base, sample_generators(seeds))

    def stock() -> None:
        negative = [" "] * batch if guidance > 1 else None
        if frames > 1:  # WanPipeline: its CFG is guidance_scale; text padded to the policy's length
            policy.pipeline(
                prompt=[prompt] * batch, negative_prompt=negative, guidance_scale=guidance, height=size, width=size,
                num_frames=frames, num_inference_steps=steps, latents=latents.clone(), output_type="pt",
                max_sequence_length=policy.max_sequence_length,
            )
            return
        policy.pipeline(
            prompt=[prompt] * batch, negative_prompt=negative, true_cfg_scale=guidance, height=size, width=size,
            num_inference_steps=steps, latents=latents.clone(), output_type="pt",
        )

    def ours(params: SamplingParams):
        # Encoding is part of the work, as in the stock call.
        conditioning = encode_conditioning(policy, tokens, index, None, params)
        return rollout(policy, conditioning, seeds, params, window_start=1 if params.sde_window_size else None,
                       prompt_index=index, sample_index=seeds, policy_version=0, weights_hash="base")

    runs = {"stock_pipeline": stock, **{k: (lambda p=p: ours(p)) for k, p in variants.items()}}
    for fn in runs.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for _ in range(repeats):
            for key, fn in runs.items():  # interleaved, so machine noise hits every variant alike
                started = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - started)
    result = {key: _summary(t) for key, t in times.items()}
    stock_median = result["stock_pipeline"]["median"]
    ratios = {}
    for key in variants:
        per_repeat = [a / b for a, b in zip(times[key], times["stock_pipeline"])]
        ratios[f"{key}_vs_stock"] = {**_summary(per_repeat), "of_medians": result[key]["median"] / stock_median}
    return {
        "case": name, "model": model, "height": size, "width": size, "frames": frames, "batch": batch,
        "steps": steps, "guidance_scale": guidance, "repeats": repeats, "seconds": result, "ratios": ratios,
        "samples_per_s_median": {k: batch / v["median"] for k, v in result.items()},
        "trajectory_bytes_per_sample": {
            key: trajectory_bytes(ours(variants[key])) / batch for key in ("ours_sde_window2", "ours_sde_all_steps")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--sizes", nargs="+", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {
        "benchmark": "bench_sampler",
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform()},
        "cases": [bench_case(s, batch=args.batch, steps=args.steps, repeats=args.repeats, guidance=args.guidance) for s in args.sizes],
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
