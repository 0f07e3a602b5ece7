"""Which cue lets the moving-shapes model learn the sign of a motion? Pretrains a fresh model (the
architecture the question arose on: one frame a token, the text encoder training along; every other
setting from configs/motion/pretrain.yaml) on one or two prompts per case and counts, over ODE samples, how
often the subject went the asked way along the axis; for two prompts, how much the trained model's
loss rises when each video is told the other prompt (``swapped_prompt_loss``). Prints JSON.

Cases (every video moves horizontally; chance is 50% of the on-axis paths):

- ``no_condition``: one prompt, "left to right": the sign as a fixed habit of the model.
- ``sign_seen_in_the_video``: "a red circle moving left to right" / "a blue square moving right to
  left", drawn as asked: the sign goes with what the frames show.
- ``sign_only_in_the_words``: the same two prompts, both drawn as a red circle: the words differ, the
  frames do not, so the sign has to come through the cross-attention.
- ``sign_only_in_the_word_order``: "a red circle moving left to right" / "... right to left".
- ``sign_only_in_the_word_order_taught``: the same with the text encoder taught the grammar first and
  kept frozen (``text_pretrain_steps``, ``model.text_neighbour_bias=5``, ``train_text_encoder=false``).

    .venv/bin/python benchmarks/probe_motion_sign.py [--case NAME ...] [--steps 1200] \\
        [--samples-per-prompt 16] [key=value ...]   # overrides of configs/motion/pretrain.yaml
"""

from __future__ import annotations

import argparse
import json
import tempfile

from serve_app.worlds.motion.evaluation import ode_verdicts, where_they_went
from serve_app.worlds.motion.pretrain import VideoBatches, load_pretrain_config, pretrain
from serve_app.worlds.motion.scene import MotionSpec, parse_prompt
from serve_app.policies import load_policy
from serve_app.worlds.pretraining import prompt_reliance
from serve_app.trainer.statistics import wilson_interval

VAE = {"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"}

RED_CIRCLE_RIGHT = "a red circle moving left to right"
# The model before two-frame tokens shipped; a key=value override (model.temporal_patch=2) still wins.
ONE_FRAME_MODEL = ["model.temporal_patch=1", "model.text_neighbour_bias=0", "train_text_encoder=true"]
SWAP_SIGMAS = (0.9, 0.75, 0.5)  # where the training sigmas (logit-normal, mean 1) are densest, and below
CASES: dict[str, dict] = {
    "no_condition": {"prompts": [RED_CIRCLE_RIGHT]},
    "sign_seen_in_the_video": {"prompts": [RED_CIRCLE_RIGHT, "a blue square moving right to left"]},
    "sign_only_in_the_words": {"prompts": [RED_CIRCLE_RIGHT, "a blue square moving right to left"],
                               "drawn_as": "red circle"},
    "sign_only_in_the_word_order": {"prompts": [RED_CIRCLE_RIGHT, "a red circle moving right to left"]},
    "sign_only_in_the_word_order_taught": {
        "prompts": [RED_CIRCLE_RIGHT, "a red circle moving right to left"],
        "overrides": ["model.text_neighbour_bias=5", "train_text_encoder=false", "text_pretrain_steps=300"]},
}


def shown(prompts: list[str], drawn_as: str | None) -> list[MotionSpec] | None:
    if drawn_as is None:
        return None
    colour, shape = drawn_as.split()
    return [MotionSpec.of(colour, shape, parse_prompt(p).direction) for p in prompts]


def run_case(name: str, steps: int, samples_per_prompt: int, overrides: list[str]) -> dict:
    case = CASES[name]
    config = load_pretrain_config("motion/pretrain", [
        f"steps={steps}", "eval.every=0", "eval.samples_per_prompt=1", "prompt_dropout=0", *ONE_FRAME_MODEL,
        *case.get("overrides", []), *overrides])
    # The run's own evaluation draws one sample a prompt; the figures come from more, with its settings.
    settings = config.eval.model_copy(update={"samples_per_prompt": samples_per_prompt})
    with tempfile.TemporaryDirectory() as out:
        entries = pretrain(config, out, log=lambda line: None, prompts=case["prompts"],
                           shown=shown(case["prompts"], case.get("drawn_as")))
        policy = load_policy(out, family="wan", components=VAE)
        sampled, found = ode_verdicts(policy, case["prompts"], settings, size=config.image_size,
                                      frames=config.num_frames)
        reliance = swapped_prompt_losses(policy, config, case["prompts"], shown(case["prompts"], case.get("drawn_as")))
    right = sum(v.direction_ok for v in found)
    on_axis = sum(v.direction in ("left to right", "right to left") for v in found)
    lo, hi = wilson_interval(right, on_axis) if on_axis else (None, None)
    return {
        "prompts": case["prompts"], "drawn_as": case.get("drawn_as", "asked"), "overrides": case.get("overrides", []),
        "temporal_patch": config.model.temporal_patch, "train_text_encoder": config.train_text_encoder,
        "steps": steps, "minutes": entries[-1]["minutes"], "loss": entries[-1]["loss"], "samples": len(found),
        "direction_accuracy": right / len(found),
        "on_the_asked_axis": on_axis / len(found),
        "right_end_of_the_axis": right / on_axis if on_axis else None,
        "right_end_95ci": [lo, hi],
        "went": where_they_went(sampled, found),
        "swapped_prompt_loss": reliance,
    }


def swapped_prompt_losses(policy, config, prompts: list[str], drawn: list[MotionSpec] | None) -> dict | None:
    """The loss of 64 fresh videos with their own prompt and with the other one (prompt_reliance): how
    much the trained model's prediction rests on the words that tell the two prompts apart."""
    if len(prompts) != 2:
        return None
    batches = VideoBatches(config.model_copy(update={"batch_size": 64, "seed": config.seed + 1}), prompts, drawn)
    videos, picks = batches.next()
    tokens = policy.text_processor().tokenize(prompts)
    latents = policy.encode_videos(videos.float() / 255.0)
    return prompt_reliance(policy, latents, [tokens[i] for i in picks], [tokens[1 - i] for i in picks],
                           sigmas=SWAP_SIGMAS, size=config.image_size, seed=config.seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=list(CASES), help="Repeatable; default: every case.")
    parser.add_argument("--steps", type=int, default=1200, help="Pretraining steps per case.")
    parser.add_argument("--samples-per-prompt", type=int, default=16, help="ODE samples per prompt (fixed seeds).")
    parser.add_argument("overrides", nargs="*", help="Overrides of configs/motion/pretrain.yaml for every case.")
    args = parser.parse_args()
    results = {name: run_case(name, args.steps, args.samples_per_prompt, args.overrides) for name in args.case or CASES}
    print(json.dumps({"benchmark": "probe_motion_sign", "cases": results}, indent=2))


if __name__ == "__main__":
    main()
