"""Reward scoring: streaming vs after the merge, and a RewardServer's batching. Prints one JSON document.

1. Request latency with a stub reward of `--reward-seconds` per call (one call per chunk: chunk_size =
   group_size) on a RewardServer that scores one call at a time (max_batch_size 1, like one reward GPU),
   the replica sampling one chunk at a time. Three apps of the same config in Serve's local testing
   mode, requests interleaved: `streaming` scores each chunk as it arrives, `after_merge` scores all
   chunks after the last one (aggregator.score_while_sampling=false), `sampling_only` has an instant
   reward. Target: streaming ~ sampling + one chunk's scoring; after_merge ~ sampling + all of them.
2. A RewardServer's images/s at max_batch_size 1 vs 8: `--server-calls` concurrent calls of
   `--server-images` images each, the stub reward costing `--server-call-seconds` per call plus
   `--server-image-seconds` per image (a model forward: a fixed cost, and a small one per image).

    .venv/bin/python benchmarks/bench_rewards.py [--repeats 3] [--prompts 6 --group-size 8 --size 64 --steps 30]

When a chunk samples faster than it is scored, scoring is the bottleneck and streaming saves only the
sampling it overlaps (try --steps 10).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

from serve_app.local_ray import loopback_ray_env  # noqa: E402

loopback_ray_env()

import torch  # noqa: E402

from serve_app.rewards import register_reward  # noqa: E402
from serve_app.api import RolloutRequest


@register_reward("bench_sleep")
def bench_sleep(seconds: float = 0.5, per_image: float = 0.0):
    """A stand-in for a reward model: sleeps `seconds` per call (+ `per_image` per image), then scores brightness."""

    def reward(images: torch.Tensor, prompts) -> torch.Tensor:
        time.sleep(seconds + per_image * images.shape[0])
        return images.float().mean(dim=(1, 2, 3)) / 255.0

    return reward


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def latency(args: argparse.Namespace) -> dict:
    import tempfile

    from serve_app.app import run_local

    weights_dir = tempfile.mkdtemp(prefix="bench-rewards-weights-")  # version 0 only: no stale store

    def overrides(seconds: float, streaming: bool) -> list[str]:
        return [
            f"sampling.height={args.size}", f"sampling.width={args.size}", f"sampling.num_steps={args.steps}",
            "sampling.sde_window_range=[0,2]", f"ingress.chunk_size={args.group_size}",
            "replica.max_batch_size=1", f"replica.weights_dir={weights_dir}",
            f"aggregator.score_while_sampling={str(streaming).lower()}",
            f"reward.components=[{{name: bench_sleep, args: {{seconds: {seconds}}}, placement: deployment,"
            " server: {max_batch_size: 1}}]",
        ]

    modes = {
        "streaming": (args.reward_seconds, True),
        "after_merge": (args.reward_seconds, False),
        "sampling_only": (0.0, True),
    }
    handles = {mode: run_local({"overrides": overrides(*setting)}, name=f"bench-rewards-{mode}")
               for mode, setting in modes.items()}
    prompts = [f"prompt {i}" for i in range(args.prompts)]
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats + 1):  # round 0 warms up (first forward, tokenizer)
        for mode, handle in handles.items():
            started = time.perf_counter()
            batch = handle.rollout.remote(RolloutRequest(prompts=prompts, group_size=args.group_size, seed=repeat)).result()
            elapsed = time.perf_counter() - started
            assert len(batch) == args.prompts * args.group_size and not batch.dropped_groups
            if repeat:
                seconds[mode].append(elapsed)
    sampling = statistics.median(seconds["sampling_only"])
    return {
        "chunks_per_request": args.prompts,
        "reward_seconds_per_chunk": args.reward_seconds,
        "request_seconds": {mode: _summary(s) for mode, s in seconds.items()},
        "median_over_sampling_only_seconds": {
            mode: statistics.median(seconds[mode]) - sampling for mode in ("streaming", "after_merge")
        },
        "after_merge_over_streaming": _summary([a / s for a, s in zip(seconds["after_merge"], seconds["streaming"])]),
    }


def server_throughput(args: argparse.Namespace) -> dict:
    from ray import serve

    from deployments.reward_server import RewardServer
    from serve_app.app import allow_serve_batch_in_local_mode
    from serve_app.rewards.composite import RewardSpec

    allow_serve_batch_in_local_mode()
    images = torch.randint(0, 256, (args.server_images, 3, args.size, args.size), dtype=torch.uint8)
    prompts = ["a prompt"] * args.server_images
    out = {}
    for batch_size in (1, 8):
        spec = RewardSpec(name="bench_sleep", placement="deployment", args={
            "seconds": args.server_call_seconds, "per_image": args.server_image_seconds},
            server={"max_batch_size": batch_size, "max_ongoing_requests": 64, "batch_wait_timeout_s": 0.01})
        deployment = serve.deployment(RewardServer, name=f"RewardServer_b{batch_size}", max_ongoing_requests=64)
        handle = serve.run(deployment.bind(spec, f"b{batch_size}"), name=f"bench-reward-server-{batch_size}",
                           route_prefix=None, _local_testing_mode=True)

        async def burst():
            return await asyncio.gather(*(handle.score.remote(images, prompts) for _ in range(args.server_calls)))

        rates = []
        for repeat in range(args.repeats + 1):
            started = time.perf_counter()
            results = asyncio.run(burst())
            elapsed = time.perf_counter() - started
            assert all(r.shape == (args.server_images,) for r in results)
            if repeat:
                rates.append(args.server_calls * args.server_images / elapsed)
        out[f"max_batch_size_{batch_size}"] = {"images_per_second": _summary(rates)}
    out["speedup_8_over_1"] = (out["max_batch_size_8"]["images_per_second"]["median"]
                               / out["max_batch_size_1"]["images_per_second"]["median"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=6, help="Groups per request (one chunk each).")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30, help="Sampling steps: 30 make a chunk take about as long as its scoring.")
    parser.add_argument("--reward-seconds", type=float, default=0.5)
    parser.add_argument("--server-calls", type=int, default=32)
    parser.add_argument("--server-images", type=int, default=2)
    parser.add_argument("--server-call-seconds", type=float, default=0.1)
    parser.add_argument("--server-image-seconds", type=float, default=0.002)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = {
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads()},
        "args": vars(args),
        "latency": latency(args),
        "reward_server": server_throughput(args),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
