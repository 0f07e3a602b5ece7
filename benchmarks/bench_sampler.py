"""Our sampler (ODE, and Flow-SDE with log-probs) against the stock QwenImagePipeline.__call__.

Same model, steps, batch, size and initial latents, measured side by side, interleaved, in one run.
Prints JSON: min/median/max seconds over repeats and the ratios to the stock pipeline.

    .venv/bin/python benchmarks/bench_sampler.py [--repeats 5] [--sizes tiny small]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from serve_app.flowgrpo.sampler import encode_conditioning, initial_latents, rollout
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.models import ensure_embedded_model
from serve_app.policies import load_policy
from serve_app.schemas import SamplingParams

CASES = {"tiny": ("tiny-qwen-image", 32), "small": ("small-qwen-image", 128)}


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def bench_case(name: str, *, batch: int, steps: int, repeats: int, guidance: float) -> dict:
    model, size = CASES[name]
    policy = load_policy(ensure_embedded_model(model))
    prompt = "a red circle next to a blue square"
    tokens = policy.text_processor().tokenize([prompt])
    base = SamplingParams(height=size, width=size, num_steps=steps, guidance_scale=guidance, seed=0)
    variants = {
        "ours_ode": base.model_copy(update={"noise_level": 0.0, "sde_type": "ode", "sde_window_size": None}),
        "ours_sde_window2": base.model_copy(update={"noise_level": 1.2, "sde_window_size": 2, "sde_window_range": (0, 5)}),
        "ours_sde_all_steps": base.model_copy(update={"noise_level": 1.2, "sde_window_size": None}),
    }
    seeds = torch.arange(batch)
    index = torch.zeros(batch, dtype=torch.long)
    latents = initial_latents(policy, base, sample_generators(seeds))

    def stock() -> None:
        policy.pipeline(
            prompt=[prompt] * batch, negative_prompt=[" "] * batch if guidance > 1 else None,
            true_cfg_scale=guidance, height=size, width=size, num_inference_steps=steps,
            latents=latents.clone(), output_type="pt",
        )

    def ours(params: SamplingParams) -> None:
        # Encoding is part of the work, as in the stock call.
        conditioning = encode_conditioning(policy, tokens, index, None, params)
        rollout(policy, conditioning, seeds, params, window_start=1 if params.sde_window_size else None,
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
        "model": model, "height": size, "width": size, "batch": batch, "steps": steps,
        "guidance_scale": guidance, "repeats": repeats, "seconds": result, "ratios": ratios,
        "images_per_s_median": {k: batch / v["median"] for k, v in result.items()},
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
