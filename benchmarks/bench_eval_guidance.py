"""What true CFG at evaluation gives in the shapes world: the shipped model and a trained LoRA, both
evaluated at each guidance scale on the same prompts and seeds (ODE, validation.num_steps).

The rollouts of configs/trainer/shapes.yaml sample without CFG (guidance 1), so a run's eval.csv
measures the policy it trained; this asks how much guidance adds at evaluation, to the base model
and to the trained one. The scales share one app built by build_app in Serve's local testing mode (a
scale is a request's sampling setting, not the app's): each publishes the adapter as a version of its own.

    .venv/bin/python benchmarks/bench_eval_guidance.py --weights RUN/lora_final.safetensors [--guidance 1,2,3]

`--weights` is a trained adapter as a run writes it (`<out>/lora_final.safetensors`, or
bench_learning's `--keep-weights`). Prints JSON: per guidance scale and split, the strict accuracy of
the base and the trained weights with 95% intervals, and the paired change (trained - base, the
same images) with its interval.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from serve_app.local_ray import loopback_ray_env

loopback_ray_env()

BASE_STEP, TRAINED_STEP = 0, 1  # eval.csv's step column: the paired change is trained vs base


def start_app(work: Path):  # type: ignore[no-untyped-def]
    """(the app's ingress handle, its overrides): one app for every scale, its versions in `work`/weights."""
    from serve_app.app import AppArgs, run_local

    app_overrides = [f"replica.weights_dir={work / 'weights'}"]
    return run_local(AppArgs(config="shapes_rollout", overrides=app_overrides), name="eval-guidance"), app_overrides


def evaluate_at(guidance: float, weights: Path, *, work: Path, splits: list[str], samples: int,
                eval_steps: int | None = None, app=None) -> list[dict]:  # type: ignore[no-untyped-def]
    """eval.csv rows of the base weights (step 0) and of `weights` (step 1) at this guidance scale;
    `app` is start_app's result (default: an app of its own)."""
    from safetensors.torch import load_file

    from serve_app.client import RolloutClient
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    run_dir = work / f"guidance-{guidance:g}"
    handle, app_overrides = app if app is not None else start_app(run_dir)
    config = load_trainer_config("trainer/shapes", [
        *app_overrides, f"validation.guidance_scale={guidance}", "trainer.image_every=0",
        "trainer.checkpoint_every=0", f"trainer.evaluation.args.splits=[{','.join(splits)}]",
        f"trainer.evaluation.samples_per_prompt={samples}", *([f"validation.num_steps={eval_steps}"] if eval_steps else []),
    ])
    trainer = FlowGRPOTrainer(config, RolloutClient(handle=handle), run_dir / "out",
                              policy=load_trainer_policy(config), progress=False)
    trainer.evaluate()  # version 0: the base weights
    version = trainer.store.latest_version() + 1  # the next free one: an earlier scale may have published
    trainer.store.publish(version, load_file(weights), kind=trainer.model.kind, lora=trainer.model.spec)
    trainer.evaluator.evaluate(TRAINED_STEP, version, weights="policy", train_minutes=0.0, images_sampled=0)
    trainer.finish()
    return [dict(r) for r in trainer.evaluator.log.rows]


def summarize(rows: list[dict], split: str) -> dict:
    base, trained = ([r for r in rows if r["split"] == split and r["step"] == step][0] for step in (BASE_STEP, TRAINED_STEP))

    def points(row: dict, key: str) -> list[float]:
        return [100 * row[f"{key}_lo"], 100 * row[key], 100 * row[f"{key}_hi"]]

    return {
        "base_strict_accuracy": points(base, "strict_accuracy"),  # [lo, value, hi], percent
        "trained_strict_accuracy": points(trained, "strict_accuracy"),
        "paired_change_points": points(trained, "strict_accuracy_change"),
        "distinguishable_from_zero": trained["strict_accuracy_change_lo"] > 0 or trained["strict_accuracy_change_hi"] < 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", required=True, type=Path, help="a trained LoRA: <run>/lora_final.safetensors")
    parser.add_argument("--guidance", default="1,2,3", help="comma-separated true-CFG scales to evaluate at")
    parser.add_argument("--samples-per-prompt", type=int, default=32, help="fixed evaluation seeds per prompt")
    parser.add_argument("--eval-steps", type=int, default=None, help="ODE steps of an evaluation (default: the config's)")
    parser.add_argument("--splits", default="held_out,train", help="comma-separated splits (train capped at 456 images)")
    args = parser.parse_args()

    import torch

    splits = args.splits.split(",")
    started = time.perf_counter()
    scales = {}
    with tempfile.TemporaryDirectory(prefix="bench-eval-guidance-") as scratch:
        app = start_app(Path(scratch))
        for guidance in (float(g) for g in args.guidance.split(",")):
            rows = evaluate_at(guidance, args.weights, work=Path(scratch), splits=splits, samples=args.samples_per_prompt,
                               eval_steps=args.eval_steps, app=app)
            scales[f"{guidance:g}"] = {split: summarize(rows, split) for split in splits}
    print(json.dumps({
        "benchmark": "bench_eval_guidance",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "settings": {"weights": str(args.weights), "samples_per_prompt": args.samples_per_prompt, "splits": splits,
                     "eval": "each split's prompts x samples_per_prompt fixed seeds, ODE, validation.num_steps; "
                             "the same images at every scale; values are [lo, value, hi] in percent"},
        "total_minutes": (time.perf_counter() - started) / 60,
        "guidance": scales,
    }, indent=2))


if __name__ == "__main__":
    main()
