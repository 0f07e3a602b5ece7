"""How far the second-order ODE solver with half the steps lands from Euler with all of them, at noise 0.

Workload: the shapes world's pretrained model (the demo's), its held-out prompts x `--seeds` initial noises,
sampled deterministically (`noise_level 0`, `record final`: every step is `sampling.ode_solver`'s) with
Euler at N steps, Euler at N/2 and DPM-Solver++(2M) at N/2, for each N of `--steps`; a reference of Euler
at `--reference-steps` stands for the exact ODE solution. For every run: the distance of its final
latents from Euler at N and from the reference (RMS over a sample's latent, divided by the reference's
RMS; min/median/max over the samples), its wall-clock seconds, and the checker's strict accuracy of its
images with the paired difference against Euler at N (the same prompts and noises) and its 95% interval
over prompts (a prompt's samples resampled together).

    .venv/bin/python benchmarks/bench_ode_solver.py [--steps 10 20] [--seeds 8] [--reference-steps 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from serve_app.config import load_config
from serve_app.flowgrpo.sampler import sample_group
from serve_app.policies import load_configured_policy
from serve_app.trainer.statistics import cluster_bootstrap_interval
from serve_app.worlds.shapes.evaluation import eval_prompts, per_image, verdicts


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 20], help="N: Euler's steps (even)")
    parser.add_argument("--seeds", type=int, default=8, help="initial noises per held-out prompt")
    parser.add_argument("--reference-steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=0, help="the first this many held-out prompts (0: all)")
    args = parser.parse_args()
    torch.set_num_threads(2)

    config = load_config("shapes_rollout")
    policy = load_configured_policy(config.model)
    text = policy.text_processor()
    prompts = eval_prompts("held_out")[: args.prompts or None]
    tokens = text.tokenize(prompts)
    base = config.sampling.model_copy(update={"noise_level": 0.0, "record": "final", "sde_window_size": None,
                                              "sde_window_range": (0, 1), "group_noise": "independent", "seed": 1})

    def run(num_steps: int, solver: str) -> dict:
        params = base.model_copy(update={"num_steps": num_steps, "ode_solver": solver})
        start = time.perf_counter()
        with torch.no_grad():
            trajectory = sample_group(policy, tokens, args.seeds, params, policy_version=0)
        seconds = time.perf_counter() - start
        found = verdicts(trajectory.images, [p for p in prompts for _ in range(args.seeds)])
        return {"latents": trajectory.latents[:, -1].float(), "seconds": seconds,  # record final: the last is x0
                "strict": per_image(found)["strict_accuracy"], "model_calls": num_steps}

    reference = run(args.reference_steps, "euler")
    ref_rms = reference["latents"].flatten(1).pow(2).mean(1).sqrt()

    def distance(a: torch.Tensor, b: torch.Tensor) -> list[float]:
        return ((a - b).flatten(1).pow(2).mean(1).sqrt() / ref_rms).tolist()

    clusters = [p for p in prompts for _ in range(args.seeds)]
    report: dict = {"host": platform.node(), "prompts": len(prompts), "seeds": args.seeds,
                    "reference_steps": args.reference_steps,
                    "reference_strict_accuracy": statistics.fmean(reference["strict"]), "by_steps": {}}
    for n in args.steps:
        if n % 2:
            raise SystemExit(f"--steps: {n} is odd; half of it must be a whole number of steps")
        runs = {f"euler_{n}": run(n, "euler"), f"euler_{n // 2}": run(n // 2, "euler"),
                f"dpm2m_{n // 2}": run(n // 2, "dpm2m")}
        full = runs[f"euler_{n}"]
        rows = {}
        for name, result in runs.items():
            paired = [b - a for a, b in zip(full["strict"], result["strict"])]
            lo, hi = cluster_bootstrap_interval(paired, clusters)
            rows[name] = {
                "model_calls_per_sample": result["model_calls"], "seconds": result["seconds"],
                "distance_to_euler_full": spread(distance(result["latents"], full["latents"])),
                "distance_to_reference": spread(distance(result["latents"], reference["latents"])),
                "strict_accuracy": statistics.fmean(result["strict"]),
                "strict_change_vs_euler_full": statistics.fmean(paired), "strict_change_ci95": [lo, hi],
            }
        report["by_steps"][str(n)] = rows
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
