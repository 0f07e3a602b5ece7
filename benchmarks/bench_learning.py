"""How fast FlowGRPO raises held-out strict accuracy in the shapes world, per sampler setting.

Each variant trains a fresh LoRA on the shipped shapes model from configs/trainer/shapes.yaml,
against the app built by build_app in Serve's local testing mode (the deployed graph's code -
ingress, replica, aggregator, weight store - in one process, without the cluster), and evaluates
the held-out prompts x fixed seeds with the ODE every few steps. Variants run one after another
within each repeat, so machine noise hits them alike; repeats change the trainer seed (rollout
noise), never the evaluation seeds.

    .venv/bin/python benchmarks/bench_learning.py [--minutes 8] [--repeats 1] [--eval-every 5]

Prints JSON: per variant and repeat the evaluation curve (strict accuracy and sub-scores against
training minutes - rollouts + updates, evaluations excluded - and images sampled), and per variant
the min/median/max over repeats of the gain in strict-accuracy points and of the minutes and images
it took to gain 10 and 20 points (null when not reached).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from serve_app.local_ray import loopback_ray_env

loopback_ray_env()

VARIANTS: dict[str, list[str]] = {
    "default": [],  # configs/trainer/shapes.yaml as shipped
    "fast_window2": ["sampling.sde_window_size=2"],  # Flow-GRPO-Fast: 2 stochastic steps in [0, 5)
    "full_sde": ["sampling.sde_window_size=null"],  # every step but the last stochastic and trained
}


def _first_reaching(rows: list[dict], gain: float, key: str) -> float | None:
    base = rows[0]["strict_accuracy"]
    for row in rows:
        if row["strict_accuracy"] - base >= gain - 1e-9:
            return row[key]
    return None


def _spread(values: list[float | None]) -> dict[str, float | None] | None:
    found = [v for v in values if v is not None]
    if not found:
        return None
    return {"min": min(found), "median": statistics.median(found), "max": max(found), "reached": len(found),
            "of": len(values)}


def run_variant(name: str, overrides: list[str], *, minutes: float, max_steps: int, eval_every: int,
                seed: int, work: Path, splits: list[str], samples: int) -> list[dict]:
    from serve_app.app import AppArgs, run_local
    from serve_app.client import RolloutClient
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.trainer import FlowGRPOTrainer, load_trainer_policy

    run_dir = work / f"{name}-seed{seed}"
    app_overrides = [f"replica.weights_dir={run_dir / 'weights'}", *[o for o in overrides if o.startswith("sampling.")]]
    handle = run_local(AppArgs(config="shapes_rollout", overrides=app_overrides), name=f"bench-{name}-{seed}")
    config = load_trainer_config("trainer/shapes", [
        *app_overrides, *overrides, f"trainer.seed={seed}", f"trainer.eval_every={eval_every}",
        f"trainer.steps={max_steps}", "trainer.image_every=0", "trainer.checkpoint_every=0",
        f"trainer.evaluation.args.splits=[{','.join(splits)}]", f"trainer.evaluation.samples_per_prompt={samples}",
    ])
    trainer = FlowGRPOTrainer(config, RolloutClient(handle=handle), run_dir / "out",
                              policy=load_trainer_policy(config), progress=False)
    trainer.evaluate()
    while trainer.step < max_steps and sum(trainer.step_seconds) < minutes * 60:
        trainer.train_step()
    if trainer.evaluator.rows[-1]["step"] != trainer.step:
        trainer.evaluate()
    trainer.finish()
    return [dict(r) for r in trainer.evaluator.rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=8.0, help="training wall-clock per variant and repeat")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--samples-per-prompt", type=int, default=4, help="fixed evaluation seeds per prompt")
    parser.add_argument("--splits", default="held_out",
                        help="comma-separated splits to evaluate; the first is the one compared (train has 5x the prompts)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()

    import torch

    from serve_app.trainer.config import load_trainer_config

    # A variant whose resolved config equals an earlier one's is reported as the same run.
    resolved, same_as = {}, {}
    for name in args.variants.split(","):
        key = load_trainer_config("trainer/shapes", VARIANTS[name]).model_dump_json()
        same_as[name] = next((other for other, k in resolved.items() if k == key), None)
        resolved.setdefault(name, key)
    runs: dict[str, list[list[dict]]] = {name: [] for name in same_as}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-learning-") as scratch:
        for repeat in range(args.repeats):
            for name in runs:
                if same_as[name] is None:
                    rows = run_variant(name, VARIANTS[name], minutes=args.minutes, max_steps=args.max_steps,
                                       eval_every=args.eval_every, seed=repeat, work=Path(scratch),
                                       splits=args.splits.split(","), samples=args.samples_per_prompt)
                    runs[name].append(rows)
    for name, other in same_as.items():
        if other is not None:
            runs[name] = runs[other]

    variants = {}
    for name, repeats in runs.items():
        variants[name] = {
            "overrides": VARIANTS[name],
            "same_run_as": same_as[name],
            "strict_gain_points": _spread([100 * (r[-1]["strict_accuracy"] - r[0]["strict_accuracy"]) for r in repeats]),
            "best_strict_gain_points": _spread(
                [100 * (max(x["strict_accuracy"] for x in r) - r[0]["strict_accuracy"]) for r in repeats]),
            "minutes_to_plus_10": _spread([_first_reaching(r, 0.10, "train_minutes") for r in repeats]),
            "images_to_plus_10": _spread([_first_reaching(r, 0.10, "images_sampled") for r in repeats]),
            "minutes_to_plus_20": _spread([_first_reaching(r, 0.20, "train_minutes") for r in repeats]),
            "images_to_plus_20": _spread([_first_reaching(r, 0.20, "images_sampled") for r in repeats]),
            "curves": repeats,
        }
    result = {
        "benchmark": "bench_learning",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "settings": {"minutes_per_variant": args.minutes, "max_steps": args.max_steps, "eval_every": args.eval_every,
                     "repeats": args.repeats, "trainer_config": "trainer/shapes", "splits": args.splits,
                     "samples_per_prompt": args.samples_per_prompt,
                     "eval": "the first of `splits` x samples_per_prompt fixed seeds, ODE, validation.num_steps"},
        "total_minutes": (time.perf_counter() - started) / 60,
        "variants": variants,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
