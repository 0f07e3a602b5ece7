"""The same rollout workload in process vs through the Serve app by handle, on one machine.

In process: RolloutPlanner -> DiffusersEngine -> TrajectoryAssembler called directly, one request at a
time. Through the app: a real single-node Ray cluster on 127.0.0.1 with one DiffusionReplica given
the same torch threads, requests sent by DeploymentHandle. Interleaved rounds, so machine noise
hits both alike. Also: how trajectory bytes scale with group size and steps.

    .venv/bin/python benchmarks/bench_serve.py [--repeats 5] [--model small-qwen-image --size 64]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import platform
import statistics
import time

from serve_app.local_ray import loopback_ray_env  # noqa: E402

loopback_ray_env()

import torch  # noqa: E402

from serve_app.config import load_config  # noqa: E402
from serve_app.schemas import RolloutRequest  # noqa: E402


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def in_process_runner(config):
    from serve_app.serving.aggregator import TrajectoryAssembler
    from serve_app.serving.engine import DiffusersEngine
    from serve_app.serving.ingress import RolloutPlanner
    from serve_app.policies import load_configured_policy
    from serve_app.rewards import CompositeReward

    policy = load_configured_policy(config.model)
    planner = RolloutPlanner(
        policy.text_processor(), config.ingress, config.sampling, policy.geometry, max_work=config.model.max_request_work
    )
    engine = DiffusersEngine(policy)
    assembler = TrajectoryAssembler(CompositeReward(config.reward.components), config.aggregator.advantage)

    def run(request: RolloutRequest):
        plan = planner.plan(request)
        chunks = []
        for start in range(0, len(plan.chunks), config.replica.max_batch_size):
            chunks += engine.generate(plan.chunks[start : start + config.replica.max_batch_size])[0]
        return assembler.assemble(chunks, plan.prompts, plan.group_size, request_id=plan.request_id)

    return run


def trajectory_bytes(batch) -> int:
    buffer = io.BytesIO()
    pickle.dump(batch, buffer, protocol=5)
    return buffer.getbuffer().nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="small-qwen-image")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_group = args.model.replace("-", "_")
    overrides = [
        f"model={model_group}",
        f"sampling.height={args.size}",
        f"sampling.width={args.size}",
        "ingress.chunk_size=8",
        "replica.max_batch_size=1",
        "replica.max_ongoing_requests=4",
        "replica.num_cpus=1",
        f"replica.torch_threads={args.threads}",
        "replica.autoscaling.min_replicas=1",
        "replica.autoscaling.max_replicas=1",
    ]
    config = load_config("diffusion_rollout", overrides)
    prompts = [f"a photo of object number {i}" for i in range(args.prompts)]
    request = RolloutRequest(prompts=prompts, group_size=args.group_size, seed=0)
    images = len(prompts) * args.group_size

    run_local = in_process_runner(config)
    started = time.perf_counter()
    run_local(request)  # warm-up, and the time of one chunk
    chunk_seconds = (time.perf_counter() - started) / max(1, images // 8)

    from ray import serve

    from serve_app.app import AppArgs, build_app
    from serve_app.client import RolloutClient
    from serve_app.local_ray import benchmark_cluster

    with benchmark_cluster(http_port=8125):
        serve.run(build_app(AppArgs(overrides=overrides)), name="flowgrpo-bench", route_prefix="/bench")
        client = RolloutClient("flowgrpo-bench")
        client.rollout(prompts, args.group_size, seed=0)  # warm-up
        local_s, served_s = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            run_local(request)
            local_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            client.rollout(prompts, args.group_size, seed=0)
            served_s.append(time.perf_counter() - started)

    throughput_ratio = [a / b for a, b in zip(local_s, served_s)]  # served images/s over in-process images/s
    overhead_ms = [(b - a) * 1000 for a, b in zip(local_s, served_s)]

    # Bytes on the wire: a TrajectoryBatch as pickled between deployments, by group size and steps.
    scaling = []
    for group_size in (2, 4, 8):
        for steps, window in ((4, 2), (8, 2), (8, None)):
            sampling = {"num_steps": steps, "sde_window_size": window, "sde_window_range": [0, 2]}
            batch = run_local(RolloutRequest(prompts=prompts, group_size=group_size, seed=1, sampling=sampling))
            scaling.append({
                "group_size": group_size, "num_steps": steps, "sde_window_size": window,
                "samples": len(batch), "window_steps": int(batch.trajectory.log_probs.shape[1]),
                "bytes": trajectory_bytes(batch), "bytes_per_sample": trajectory_bytes(batch) / len(batch),
                "prompt_embeds_bytes": batch.trajectory.prompt_embeds.embeds.numel() * 4,
            })

    print(json.dumps({
        "benchmark": "bench_serve",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": args.threads},
        "workload": {"model": args.model, "size": args.size, "prompts": args.prompts, "group_size": args.group_size,
                     "images_per_request": images, "chunk_size": 8, "seconds_per_chunk_in_process": chunk_seconds},
        "repeats": args.repeats,
        "in_process_seconds": _summary(local_s),
        "served_by_handle_seconds": _summary(served_s),
        "throughput_ratio_served_over_in_process": _summary(throughput_ratio),
        "per_request_overhead_ms": _summary(overhead_ms),
        "trajectory_bytes": scaling,
    }, indent=2))


if __name__ == "__main__":
    main()
