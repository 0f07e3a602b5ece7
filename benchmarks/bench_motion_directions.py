"""Where a moving-shapes model's paths go: for each asked direction, how many ODE samples went each way,
and how far apart its text encoder puts the two ends of an axis (``word_order_gap``).

The shipped model draws a path along the asked axis and picks either end; this tells the axis from
the sign. Prints JSON.

    .venv/bin/python benchmarks/bench_motion_directions.py [--model DIR] [--split train] \\
        [--samples-per-prompt 8] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from serve_app.models import ensure_embedded_model
from serve_app.motion.evaluation import eval_prompts, ode_verdicts, where_they_went, word_order_gap
from serve_app.motion.scene import COLOURS, DIRECTIONS, SHAPES, parse_prompt
from serve_app.policies import load_policy
from serve_app.pretraining import EvalSettings

VAE = {"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"}


def horizontal(direction: str) -> bool:
    return DIRECTIONS[direction][0] == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="A pipeline directory (default: the shipped model).")
    parser.add_argument("--split", default="train", choices=["train", "held_out", "all"])
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="ODE steps.")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    model = args.model or ensure_embedded_model("serve_app.motion.model:MOTION_WAN")
    policy = load_policy(model, family="wan", components=VAE)
    prompts = eval_prompts(args.split)
    settings = EvalSettings(samples_per_prompt=args.samples_per_prompt, num_steps=args.steps, seed=args.seed)
    sampled, found = ode_verdicts(policy, prompts, settings)
    with torch.inference_mode():
        gaps = [word_order_gap(policy, f"{colour} {shape}") for colour in COLOURS for shape in SHAPES]
    asked = [parse_prompt(p).direction for p in sampled]
    went = where_they_went(sampled, found)
    on_axis = sum(v.direction in DIRECTIONS and horizontal(v.direction) == horizontal(d) for d, v in zip(asked, found))
    right = sum(v.direction_ok for v in found)
    print(json.dumps({
        "benchmark": "bench_motion_directions",
        "model": str(model),
        "split": args.split, "prompts": len(prompts), "samples_per_prompt": args.samples_per_prompt,
        "ode_steps": args.steps, "seed": args.seed,
        "direction_accuracy": right / len(found),
        "on_the_asked_axis": on_axis / len(found),
        "right_end_of_the_axis": right / on_axis if on_axis else None,
        "went": {d: went.get(d, {}) for d in DIRECTIONS},
        "word_order_gap": {"min": min(gaps), "median": statistics.median(gaps), "max": max(gaps),
                           "subjects": len(gaps)},
    }, indent=2))


if __name__ == "__main__":
    main()
