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
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from serve_app.flowgrpo.sampler import initial_latents
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.models import ensure_embedded_model
from serve_app.policies import load_policy
from serve_app.config.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_timing import (  # noqa: E402  (a sibling module, not a package)
    STOCK,
    VARIANTS,
    Clock,
    our_rollout,
    ratio_summary,
    sampler_variants,
    seconds_of,
    summary,
    time_interleaved,
)


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
    variants = sampler_variants(base, list(VARIANTS))
    seeds = torch.arange(batch)
    latents = initial_latents(policy, base, sample_generators(seeds))
    runs = {STOCK: lambda: policy.stock_call(prompt, base, latents),
            **{k: (lambda p=p: our_rollout(policy, tokens, p, seeds)) for k, p in variants.items()}}
    for fn in runs.values():  # warm-up
        fn()
    times = {key: seconds_of(m) for key, m in time_interleaved(runs, repeats, Clock(torch.device("cpu"))).items()}
    result = {key: summary(t) for key, t in times.items()}
    return {
        "case": name, "model": model, "height": size, "width": size, "frames": frames, "batch": batch,
        "steps": steps, "guidance_scale": guidance, "repeats": repeats, "seconds": result,
        "ratios": {f"{key}_vs_stock": ratio_summary(times[key], times[STOCK]) for key in variants},
        "samples_per_s_median": {k: batch / v["median"] for k, v in result.items()},
        "trajectory_bytes_per_sample": {
            key: trajectory_bytes(our_rollout(policy, tokens, variants[key], seeds)) / batch
            for key in ("ours_sde_window2", "ours_sde_all_steps")
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
