"""How fast each algorithm and sampler setting raises strict accuracy in the shapes world.

Each variant trains a fresh LoRA on the shipped shapes model from configs/trainer/shapes.yaml,
against the app built by build_app in Serve's local testing mode (the deployed graph's code -
ingress, replica, aggregator, weight store - in one process, without the cluster), and evaluates
fixed prompts x fixed seeds with the ODE at fixed marks of training time, so every variant is
measured on the same clock. Variants run one after another within each repeat, so machine noise
hits them alike; repeats change the trainer seed (rollout noise), never the evaluation seeds.

    .venv/bin/python benchmarks/bench_learning.py [--minutes 15] [--repeats 3] [--eval-every-minutes 2.5]

Prints JSON: per variant and repeat the evaluation curve (strict accuracy and sub-scores with their
95% intervals, and the paired change against step 0 with its interval, against training minutes -
rollouts + updates, evaluations excluded - and images sampled), and per variant and split the
min/median/max over repeats of the final change in strict-accuracy points, how many repeats'
final change is distinguishable from zero, and the minutes and images it took to gain 10 and 20
points (null when not reached); and per variant, split and repeat, its final strict accuracy minus the
--paired-against variant's (the demo's) of the same repeat on the same images, with its 95% interval over
prompts. With --out, the JSON is rewritten after every run, so a long
benchmark stopped early keeps the repeats it finished ("complete": false).
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
from typing import TYPE_CHECKING

from serve_app.local_ray import loopback_ray_env
from serve_app.trainer.statistics import cluster_bootstrap_interval

if TYPE_CHECKING:
    from serve_app.trainer.evaluation import PairedReference

loopback_ray_env()

VARIANTS: dict[str, list[str]] = {
    # configs/trainer/shapes.yaml as shipped: Flow-GRPO-Fast (2 stochastic steps starting in [0, 5) of
    # 10), shared group noise, the next rollout in flight during the update (max_staleness 1).
    "demo": [],
    # Every step but the last stochastic and trained (the original Flow-GRPO); all else as the demo.
    "full_sde": ["sampling.sde_window_size=null"],
    # Flow-GRPO-Fast without the throughput levers: independent noise, strictly on-policy.
    "fast_plain": ["sampling.group_noise=independent", "trainer.max_staleness=0"],
    # The other algorithms by their presets (configs/algorithm/), on the demo's world and clock.
    "mix_grpo": ["algorithm=mix_grpo"],
    "dance_grpo": ["algorithm=dance_grpo"],
    # DanceGRPO at about twice its preset's noise: its constant std a sqrt(|dt|) is 1.7-5.3x below Flow-SDE's on
    # the demo's window (sigma 1 to 0.75), where Flow-SDE's a sqrt(sigma / (1 - sigma)) is large.
    "dance_grpo_noise1.5": ["algorithm=dance_grpo", "sampling.noise_level=1.5"],
    "diffusion_nft": ["algorithm=diffusion_nft"],
    # DiffusionNFT sampling a soft-updated average of the trained weights (the paper's first schedule).
    "diffusion_nft_soft": ["algorithm=diffusion_nft", "trainer.diffusion_nft.sampling_decay_rate=0.001",
                           "trainer.diffusion_nft.sampling_decay_max=0.5"],
    # The paper's second schedule: the trained weights for 75 updates, then an average that slows to 0.999 by update 208.
    "diffusion_nft_soft_late": ["algorithm=diffusion_nft", "trainer.diffusion_nft.sampling_decay_delay=75",
                                "trainer.diffusion_nft.sampling_decay_rate=0.0075",
                                "trainer.diffusion_nft.sampling_decay_max=0.999"],
    "grpo_guard": ["algorithm=grpo_guard"],
}
NEVER = 10**9  # trainer.eval_every: the benchmark evaluates on its own clock, not every N steps


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


def run_variant(name: str, overrides: list[str], *, minutes: float, max_steps: int, eval_every_minutes: float,
                seed: int, work: Path, splits: list[str], samples: int, keep_weights: Path | None,
                eval_steps: int | None = None) -> tuple[list[dict], dict[str, PairedReference]]:
    from serve_app.app import AppArgs, run_local
    from serve_app.client import RolloutClient
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

    run_dir = work / f"{name}-seed{seed}"
    app_overrides = [f"replica.weights_dir={run_dir / 'weights'}", *[o for o in overrides if o.startswith("sampling.")]]
    handle = run_local(AppArgs(config="shapes_rollout", overrides=app_overrides), name=f"bench-{name}-{seed}")
    config = load_trainer_config("trainer/shapes", [
        *app_overrides, *overrides, f"trainer.seed={seed}", f"trainer.eval_every={NEVER}",
        f"trainer.steps={max_steps}", "trainer.image_every=0", "trainer.checkpoint_every=0",
        f"trainer.evaluation.args.splits=[{','.join(splits)}]", f"trainer.evaluation.samples_per_prompt={samples}",
        *([f"validation.num_steps={eval_steps}"] if eval_steps else []),
    ])
    trainer = FlowGRPOTrainer(config, RolloutClient(handle=handle), run_dir / "out",
                              policy=load_trainer_policy(config), progress=False)
    trainer.evaluate()
    next_eval_s = eval_every_minutes * 60
    while trainer.step < max_steps and trainer.train_seconds < minutes * 60:
        trainer.train_step()
        if trainer.train_seconds >= next_eval_s:
            trainer.evaluate()
            next_eval_s += eval_every_minutes * 60
    if trainer.evaluator.first_split_rows[-1]["step"] != trainer.step:
        trainer.evaluate()
    trainer.finish()
    if keep_weights is not None:  # for bench_eval_guidance.py
        keep_weights.mkdir(parents=True, exist_ok=True)
        final = run_dir / "out" / f"{trainer.model.kind}_final.safetensors"
        final.replace(keep_weights / f"{name}-seed{seed}-{final.name}")
    # Every split's rows in order, and each split's per-image scores at the last evaluation.
    return [dict(r) for r in trainer.evaluator.log.rows], dict(trainer.evaluator.latest)


def paired_against(finals: list[dict[str, PairedReference]], baseline: list[dict[str, PairedReference]],
                   split: str) -> dict:
    """Repeat by repeat (the same trainer seed), a variant's final per-image strict accuracy minus the
    baseline's on the same prompts and seeds, in points: the mean, and its 95% interval over prompts
    (whole prompts resampled with all their seeds' differences)."""
    differences, intervals = [], []
    for mine, theirs in zip(finals, baseline):
        keys = list(mine[split].values)
        change = theirs[split].change([p for p, _ in keys], [s for _, s in keys], list(mine[split].values.values()))
        lo, hi = cluster_bootstrap_interval(change, [p for p, _ in keys])
        differences.append(100 * sum(change) / len(change))
        intervals.append([100 * lo, 100 * hi])
    return {"strict_difference_points": _spread(differences), "per_repeat": differences,
            "prompt_interval_points": intervals,
            "repeats_above": sum(lo > 0 for lo, _ in intervals), "repeats_below": sum(hi < 0 for _, hi in intervals)}


def summarize(repeats: list[list[dict]], split: str) -> dict:
    """One split's figures over repeats; each repeat's rows are that run's evaluations in order."""
    curves = [[r for r in rows if r["split"] == split] for rows in repeats]
    finals = [c[-1] for c in curves]
    return {
        "strict_change_points": _spread([100 * f["strict_accuracy_change"] for f in finals]),
        "strict_change_interval_points": [[100 * f["strict_accuracy_change_lo"], 100 * f["strict_accuracy_change_hi"]]
                                          for f in finals],
        # Over prompts: whole prompts resampled with all their seeds (what a claim about unseen prompts needs).
        "strict_change_prompt_interval_points": [[100 * f["strict_accuracy_change_prompt_lo"],
                                                  100 * f["strict_accuracy_change_prompt_hi"]] for f in finals],
        # Distinguishable from zero: the final paired 95% interval excludes 0.
        "repeats_above_zero": sum(f["strict_accuracy_change_lo"] > 0 for f in finals),
        "repeats_below_zero": sum(f["strict_accuracy_change_hi"] < 0 for f in finals),
        "repeats_above_zero_over_prompts": sum(f["strict_accuracy_change_prompt_lo"] > 0 for f in finals),
        "best_strict_change_points": _spread([100 * (max(x["strict_accuracy"] for x in c) - c[0]["strict_accuracy"])
                                              for c in curves]),
        "minutes_to_plus_10": _spread([_first_reaching(c, 0.10, "train_minutes") for c in curves]),
        "images_to_plus_10": _spread([_first_reaching(c, 0.10, "images_sampled") for c in curves]),
        "minutes_to_plus_20": _spread([_first_reaching(c, 0.20, "train_minutes") for c in curves]),
        "images_to_plus_20": _spread([_first_reaching(c, 0.20, "images_sampled") for c in curves]),
        "steps": _spread([c[-1]["step"] for c in curves]),
        "images_sampled": _spread([c[-1]["images_sampled"] for c in curves]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="training wall-clock per variant and repeat")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--eval-every-minutes", type=float, default=2.5, help="evaluate at these marks of training time")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="trainer seed of the first repeat (the next ones count up)")
    parser.add_argument("--samples-per-prompt", type=int, default=32,
                        help="fixed evaluation seeds per prompt (32 x the 14 held-out prompts: a paired interval of ~+-5 points)")
    parser.add_argument("--splits", default="held_out", help="comma-separated splits to evaluate (train has 76 prompts)")
    parser.add_argument("--eval-steps", type=int, default=None, help="ODE steps of an evaluation (default: the config's)")
    parser.add_argument("--variants", default="demo,full_sde", help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="also write the JSON here, after every run")
    parser.add_argument("--paired-against", default="demo",
                        help="the variant every other one is paired with, repeat by repeat, on the same images")
    parser.add_argument("--keep-weights", type=Path, default=None, help="keep each run's final weights in this folder")
    args = parser.parse_args()

    import torch

    from serve_app.trainer.config import load_trainer_config

    # A variant whose resolved config equals an earlier one's is reported as the same run.
    resolved, same_as = {}, {}
    for name in args.variants.split(","):
        key = load_trainer_config("trainer/shapes", VARIANTS[name]).model_dump_json()
        same_as[name] = next((other for other, k in resolved.items() if k == key), None)
        resolved.setdefault(name, key)
    splits = args.splits.split(",")
    runs: dict[str, list[list[dict]]] = {name: [] for name in same_as if same_as[name] is None}
    finals: dict[str, list[dict[str, PairedReference]]] = {name: [] for name in runs}
    baseline = same_as.get(args.paired_against) or args.paired_against
    started = time.perf_counter()

    def report(complete: bool) -> dict:
        variants = {}
        for name, other in same_as.items():
            repeats = runs[other or name]
            variants[name] = {"overrides": VARIANTS[name], "same_run_as": other, "repeats_done": len(repeats)}
            if repeats:
                variants[name].update({split: summarize(repeats, split) for split in splits}, curves=repeats)
            if baseline in finals and (other or name) != baseline and finals[baseline] and repeats:
                variants[name][f"minus_{args.paired_against}"] = {
                    split: paired_against(finals[other or name], finals[baseline], split) for split in splits}
        return {
            "benchmark": "bench_learning",
            "complete": complete,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "torch_threads": torch.get_num_threads()},
            "settings": {"minutes_per_variant": args.minutes, "max_steps": args.max_steps,
                         "eval_every_minutes": args.eval_every_minutes, "repeats": args.repeats,
                         "first_seed": args.first_seed, "paired_against": args.paired_against,
                         "trainer_config": "trainer/shapes", "splits": splits,
                         "samples_per_prompt": args.samples_per_prompt,
                         "eval": "each split's prompts x samples_per_prompt fixed seeds (train capped by "
                                 "max_images_per_split), ODE, validation.num_steps; paired change vs step 0"},
            "total_minutes": (time.perf_counter() - started) / 60,
            "variants": variants,
        }

    with tempfile.TemporaryDirectory(prefix="bench-learning-") as scratch:
        for repeat in range(args.repeats):
            for name in runs:
                rows, latest = run_variant(
                    name, VARIANTS[name], minutes=args.minutes, max_steps=args.max_steps,
                    eval_every_minutes=args.eval_every_minutes, seed=args.first_seed + repeat, work=Path(scratch), splits=splits,
                    samples=args.samples_per_prompt, keep_weights=args.keep_weights, eval_steps=args.eval_steps)
                runs[name].append(rows)
                finals[name].append(latest)
                if args.out:
                    Path(args.out).write_text(json.dumps(report(complete=False), indent=2) + "\n")
    text = json.dumps(report(complete=True), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
