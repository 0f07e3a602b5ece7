"""Where a moving-shapes model's paths go: for each asked direction, how many ODE samples went each way,
how far apart its text encoder puts the two ends of an axis (``word_order_gap``), and how much its
prediction rests on each kind of word (``swapped_prompt_loss``: the flow-matching loss of "a red circle
moving left to right" videos told another colour, axis or sign, over the loss with their own prompt).

The shipped model draws a path along the asked axis and picks either end; this tells the axis from
the sign. Prints JSON.

    .venv/bin/python benchmarks/bench_motion_directions.py [--model DIR] [--split train] \\
        [--samples-per-prompt 8] [--steps 20] [--guidance 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from serve_app.models import ensure_embedded_model
from serve_app.worlds.motion.evaluation import eval_prompts, ode_verdicts, where_they_went, word_order_gap
from serve_app.worlds.motion.pretrain import VideoBatches, load_pretrain_config
from serve_app.worlds.motion.scene import COLOURS, DIRECTIONS, SHAPES, parse_prompt
from serve_app.policies import load_policy
from serve_app.worlds.pretraining import EvalSettings, prompt_reliance

VAE = {"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"}
OWN = "a red circle moving left to right"
# The same videos told another colour, another axis or the other end of the axis.
SWAPPED = {"colour": "a blue circle moving left to right", "axis": "a red circle moving top to bottom",
           "sign": "a red circle moving right to left"}


def horizontal(direction: str) -> bool:
    return DIRECTIONS[direction][0] == 0


def swapped_word_losses(policy, videos: int = 64, seed: int = 7) -> dict[str, dict]:
    """prompt_reliance of ``videos`` pretraining videos of OWN told each SWAPPED prompt instead: how much
    the model's prediction rests on each kind of word."""
    config = load_pretrain_config("motion/pretrain", [f"batch_size={videos}", f"seed={seed}"])
    clips, _ = VideoBatches(config, [OWN]).next()
    latents = policy.encode_videos(clips.float() / 255.0)
    own, *others = policy.text_processor().tokenize([OWN, *SWAPPED.values()])
    return {kind: prompt_reliance(policy, latents, [own] * videos, [other] * videos, sigmas=(0.9, 0.75, 0.5),
                                  size=config.image_size, seed=seed)
            for kind, other in zip(SWAPPED, others)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="A pipeline directory (default: the shipped model).")
    parser.add_argument("--split", default="train", choices=["train", "held_out", "all"])
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20, help="ODE steps.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--guidance", type=float, default=1.0, help="True CFG scale (1 = off, as the demo samples).")
    args = parser.parse_args()

    model = args.model or ensure_embedded_model("serve_app.worlds.motion.model:MOTION_WAN")
    policy = load_policy(model, family="wan", components=VAE)
    prompts = eval_prompts(args.split)
    settings = EvalSettings(samples_per_prompt=args.samples_per_prompt, num_steps=args.steps, seed=args.seed,
                            guidance_scale=args.guidance)
    sampled, found = ode_verdicts(policy, prompts, settings)
    with torch.inference_mode():
        gaps = [word_order_gap(policy, f"{colour} {shape}") for colour in COLOURS for shape in SHAPES]
        swapped = swapped_word_losses(policy)
    asked = [parse_prompt(p).direction for p in sampled]
    went = where_they_went(sampled, found)
    on_axis = sum(v.direction in DIRECTIONS and horizontal(v.direction) == horizontal(d) for d, v in zip(asked, found))
    right = sum(v.direction_ok for v in found)
    print(json.dumps({
        "benchmark": "bench_motion_directions",
        "model": str(model),
        "split": args.split, "prompts": len(prompts), "samples_per_prompt": args.samples_per_prompt,
        "ode_steps": args.steps, "seed": args.seed, "guidance_scale": args.guidance,
        "direction_accuracy": right / len(found),
        "on_the_asked_axis": on_axis / len(found),
        "right_end_of_the_axis": right / on_axis if on_axis else None,
        "went": {d: went.get(d, {}) for d in DIRECTIONS},
        "word_order_gap": {"min": min(gaps), "median": statistics.median(gaps), "max": max(gaps),
                           "subjects": len(gaps)},
        "swapped_prompt_loss": swapped,
    }, indent=2))


if __name__ == "__main__":
    main()
