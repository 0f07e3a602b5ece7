"""How much pipelined rollouts (trainer.max_staleness) and shared group noise buy, on the shapes world.

1. Training throughput at max_staleness k = 0, 1, 2: the app on a one-node Ray cluster (loopback),
   one replica limited to one torch thread and the trainer to one more - the CPU stand-in for a
   rollout device and a training device - and the same limits at every k. Steps/s and images/s per
   k, side by side within each repeat, and the ratio to k = 0; the rollout and update shares of a
   k = 0 step give the bound 1 / max(shares).
2. Sampling throughput with shared vs independent group noise at SDE window start 4 of 10 steps
   (in process, the same model, one torch thread, interleaved, the fastest of a few calls per mode in
   each repeat): images/s, their ratio and the bound the transformer rows put on it.
3. With --accuracy-minutes > 0: strict accuracy of the shapes checker on the train prompts (fixed
   seeds, ODE; [value, 95% low, high]) before and after that many training minutes, and its paired
   change in points, for k = 0, k = 1 and k = 1 with shared noise.

    .venv/bin/python benchmarks/bench_pipeline.py [--steps 8] [--repeats 3] [--accuracy-minutes 0] [--accuracy-samples-per-prompt 3]
        [--prompts-per-step 8] [--group-size 8]   # a training step's rollout (the default: trainer/shapes')

Prints one JSON document (min / median / max over repeats).
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

APP = "flowgrpo-pipeline"


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def app_overrides(weights: Path) -> list[str]:
    return [
        f"app_name={APP}", f"replica.weights_dir={weights}", "replica.torch_threads=1", "replica.num_cpus=1",
        "replica.autoscaling.min_replicas=1", "replica.autoscaling.max_replicas=1",
    ]


def trainer_for(overrides: list[str], out: Path, extra: list[str]):
    from serve_app.client import RolloutClient
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer

    config = load_trainer_config("trainer/shapes", [
        *overrides, "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=0", *extra,
    ])
    return FlowGRPOTrainer(config, RolloutClient(APP), out, progress=False)


def throughput(overrides: list[str], work: Path, *, staleness: list[int], steps: int, repeats: int,
               step_size: list[str] = ()) -> dict:
    """Steps/s and images/s of the training loop per k, with the k = 0 shares of a step. `step_size`:
    overrides of the trainer's prompts_per_step / group_size (none: trainer/shapes' own)."""
    rates: dict[int, list[float]] = {k: [] for k in staleness}
    shares = []
    for repeat in range(repeats):
        for k in staleness:
            trainer = trainer_for(overrides, work / f"k{k}-r{repeat}", [f"trainer.max_staleness={k}", *step_size])
            trainer.train_step()  # warm-up: the first request loads nothing new, but fills the pipeline
            started = time.perf_counter()
            rows = [trainer.train_step() for _ in range(steps)]
            rates[k].append(steps / (time.perf_counter() - started))
            trainer.finish()
            if k == 0:
                images = trainer.cfg.prompts_per_step * trainer.cfg.group_size
                rollout = statistics.mean(images / r["sample_images_per_s"] for r in rows)
                update = statistics.mean(images * trainer.cfg.inner_epochs / r["train_images_per_s"] for r in rows)
                step = statistics.mean(r["step_seconds"] for r in rows)
                shares.append({"rollout": rollout / step, "update": update / step})
    images = trainer.cfg.prompts_per_step * trainer.cfg.group_size
    result = {f"k{k}": {"steps_per_s": _summary(r), "images_per_s": _summary([x * images for x in r])}
              for k, r in rates.items()}
    for k in staleness:
        if k != 0 and 0 in rates:
            result[f"k{k}"]["speedup_over_k0"] = _summary([a / b for a, b in zip(rates[k], rates[0])])
    if shares:
        rollout = statistics.median(s["rollout"] for s in shares)
        update = statistics.median(s["update"] for s in shares)
        result["k0_step_shares"] = {"rollout": rollout, "update": update, "bound": 1 / max(rollout, update)}
    return result


def group_noise_speed(*, repeats: int, batch_prompts: int, group_size: int, calls: int = 3) -> dict:
    """images/s of shared vs independent group noise, window start 4 of 10 steps, in process on one torch
    thread (the replica's one core of part 1). A repeat times each mode `calls` times, interleaved, and
    keeps each mode's fastest call: a call lasts well under a second, so one stall of a shared machine
    would otherwise decide a repeat. `transformer_row_bound` is the ratio of rows the two modes put
    through the transformer, P*G*N / (P*s + P*G*(N - s)): what shared noise saves at most."""
    import torch

    from serve_app.config import load_config
    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.policies import load_configured_policy

    torch.set_num_threads(1)
    config = load_config("shapes_rollout")
    policy = load_configured_policy(config.model)
    prompts = policy.text_processor().tokenize([f"a red circle and a blue square {i}" for i in range(batch_prompts)])
    num_steps, window_start = 10, 4
    base = config.sampling.model_copy(update={"num_steps": num_steps, "sde_window_size": 2,
                                              "sde_window_range": (window_start, window_start + 1), "seed": 0})
    sample_group(policy, prompts, group_size, base, policy_version=0)  # warm-up
    seconds: dict[str, list[float]] = {"independent": [], "shared": []}
    for _ in range(repeats):
        fastest = {mode: float("inf") for mode in seconds}
        for _ in range(calls):
            for mode in seconds:
                started = time.perf_counter()
                sample_group(policy, prompts, group_size, base.model_copy(update={"group_noise": mode}), policy_version=0)
                fastest[mode] = min(fastest[mode], time.perf_counter() - started)
        for mode, best in fastest.items():
            seconds[mode].append(best)
    images = batch_prompts * group_size
    rates = {mode: [images / s for s in times] for mode, times in seconds.items()}
    rows_independent = images * num_steps
    rows_shared = batch_prompts * window_start + images * (num_steps - window_start)
    return {
        "window_start": window_start, "num_steps": num_steps, "prompts": batch_prompts, "group_size": group_size,
        "torch_threads": 1, "calls_per_repeat": calls,
        "images_per_s": {mode: _summary(r) for mode, r in rates.items()},
        "shared_over_independent": _summary([a / b for a, b in zip(rates["shared"], rates["independent"])]),
        "transformer_row_bound": rows_independent / rows_shared,
    }


def accuracy_over_minutes(overrides: list[str], work: Path, minutes: float, samples_per_prompt: int) -> dict:
    """Train-prompt strict accuracy before/after `minutes` of training for k = 0, k = 1, k = 1 + shared noise:
    the same fixed seeds at every evaluation, so each change comes with its paired 95% interval."""
    variants = {"k0": ["trainer.max_staleness=0"], "k1": ["trainer.max_staleness=1"],
                "k1_shared": ["trainer.max_staleness=1", "sampling.group_noise=shared"]}
    evaluation = ["trainer.eval_every=1000000", "trainer.evaluation.args.splits=[train]",
                  f"trainer.evaluation.samples_per_prompt={samples_per_prompt}"]
    result = {}
    for name, extra in variants.items():
        trainer = trainer_for(overrides, work / f"acc-{name}", [*evaluation, *extra])
        before = trainer.evaluate()
        started = time.perf_counter()
        while time.perf_counter() - started < minutes * 60:
            trainer.train_step()
        after = trainer.evaluate()
        trainer.finish()
        result[name] = {
            "steps": trainer.step, "images_evaluated": len(trainer.evaluator.splits["train"]) * samples_per_prompt,
            "strict_before": [before[k] for k in ("strict_accuracy", "strict_accuracy_lo", "strict_accuracy_hi")],
            "strict_after": [after[k] for k in ("strict_accuracy", "strict_accuracy_lo", "strict_accuracy_hi")],
            "change_points": [100 * after[k] for k in ("strict_accuracy_change", "strict_accuracy_change_lo",
                                                       "strict_accuracy_change_hi")],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per k and repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staleness", default="0,1,2", help="comma-separated k values")
    parser.add_argument("--noise-prompts", type=int, default=8)
    parser.add_argument("--noise-group-size", type=int, default=8)
    parser.add_argument("--accuracy-minutes", type=float, default=0.0, help="0 skips the accuracy comparison")
    parser.add_argument("--accuracy-samples-per-prompt", type=int, default=3, help="fixed seeds per train prompt")
    parser.add_argument("--prompts-per-step", type=int, default=None,
                        help="prompts a training step samples in part 1 (default: trainer/shapes', 8)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="samples per prompt of a training step in part 1 (default: trainer/shapes', 8)")
    args = parser.parse_args()
    step_size = [*([f"trainer.prompts_per_step={args.prompts_per_step}"] if args.prompts_per_step else []),
                 *([f"trainer.group_size={args.group_size}"] if args.group_size else [])]

    import torch
    from ray import serve

    from serve_app.app import AppArgs, build_app
    from serve_app.local_ray import benchmark_cluster

    report = {"benchmark": "bench_pipeline", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    report["group_noise"] = group_noise_speed(repeats=args.repeats, batch_prompts=args.noise_prompts,
                                              group_size=args.noise_group_size)
    torch.set_num_threads(1)  # the trainer's one core; the replica has the other
    with benchmark_cluster(serve="handles"), tempfile.TemporaryDirectory(prefix="bench-pipeline-") as scratch:
        overrides = app_overrides(Path(scratch) / "weights")
        serve.run(build_app(AppArgs(config="shapes_rollout", overrides=overrides)), name=APP, route_prefix=None)
        staleness = [int(k) for k in args.staleness.split(",")]
        report["training"] = throughput(overrides, Path(scratch), staleness=staleness, steps=args.steps,
                                        repeats=args.repeats, step_size=step_size)
        report["settings"] = {"steps": args.steps, "repeats": args.repeats, "trainer_config": "trainer/shapes",
                              "trainer_overrides": step_size, "torch_threads": {"trainer": 1, "replica": 1}}
        if args.accuracy_minutes > 0:
            report["accuracy"] = accuracy_over_minutes(overrides, Path(scratch), args.accuracy_minutes,
                                                      args.accuracy_samples_per_prompt)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
