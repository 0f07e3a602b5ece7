"""Where a rollout's bytes go, as trajectories grow: the app served by handle vs the same flow in one
process, and the tensor bytes each process of the app serializes and deserializes per request.

Workload: the embedded tiny Qwen-Image at image sides from 64 to 768 px (about 25 kB to 4 MB per
sample: latents of the SDE window, log-probs, prompt embeddings and the image), 4 steps with a window
of 2, two prompts x `--group-size` samples a request, chunks of 2 samples, two replicas on one torch
thread each. In process: the planner, the engine and the coordinator (or, on a checkout from before it,
the assembler) called directly on two torch threads. Served: a one-node Ray cluster on 127.0.0.1, the
trainer's RolloutClient fetching each batch's transitions (what a trainer replays), not its images.
Rounds alternate in-process and served requests, so the machine's noise hits both alike.

Bytes: every process of the job counts the bytes of the torch storages it pickles and unpickles
(tensors travel between Ray processes as pickled storages), by role: trainer (this process), ingress,
aggregator, replicas.

    .venv/bin/python benchmarks/bench_dataplane.py [--repeats 3] [--sizes 64 256 512 768]
    .venv/bin/python benchmarks/bench_dataplane.py --code DIR    # another checkout's flow, e.g. the one
                                                                 # before this: git worktree add DIR COMMIT
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from serve_app.local_ray import loopback_ray_env

loopback_ray_env()  # before Ray is imported: it reads RAY_AUTH_MODE at import

# Counters of pickled / unpickled storage bytes; each process of the job writes its own to a file.
COUNTS_DIR_ENV = "FLOWGRPO_DATAPLANE_COUNTS"


def count_tensor_bytes() -> None:
    """Count the bytes of every torch storage this process pickles or unpickles (Ray's path for
    tensors), and write the totals to $FLOWGRPO_DATAPLANE_COUNTS/<pid>.json a few times a second."""
    import torch

    counts = {"pid": os.getpid(), "serialized": 0, "deserialized": 0}
    original_reduce = torch.storage.TypedStorage.__reduce__
    original_load = torch.storage._load_from_bytes

    def reduce(storage):  # type: ignore[no-untyped-def]
        function, (data,) = original_reduce(storage)
        counts["serialized"] += len(data)
        return function, (data,)

    def load(data: bytes):  # type: ignore[no-untyped-def]
        counts["deserialized"] += len(data)
        return original_load(data)

    # Pickled by name, as the original: an unpickling process finds its own (counting or not) in torch.storage.
    load.__module__, load.__qualname__ = original_load.__module__, original_load.__qualname__
    torch.storage.TypedStorage.__reduce__ = reduce
    torch.storage._load_from_bytes = load
    folder = os.environ.get(COUNTS_DIR_ENV)
    if not folder:
        return

    def flush() -> None:
        path = Path(folder) / f"{os.getpid()}.json"
        staging = path.with_suffix(".tmp")
        while True:
            staging.write_text(json.dumps(counts))
            os.replace(staging, path)  # a reader sees a whole file, never a half-written one
            time.sleep(0.1)

    threading.Thread(target=flush, daemon=True).start()


def _summary(samples: list[float]) -> dict[str, float]:
    return {"min": min(samples), "median": statistics.median(samples), "max": max(samples)}


def overrides_for(size: int) -> list[str]:
    return [
        "model=tiny_qwen_image", f"sampling.height={size}", f"sampling.width={size}", "sampling.num_steps=4",
        "sampling.sde_window_range=[0,2]", "sampling.guidance_scale=1.0", "ingress.chunk_size=2",
        "ingress.max_samples=64", "model.max_request_work=1000000000", "replica.max_batch_size=1",
        "replica.max_ongoing_requests=1",  # a replica takes one chunk at a time: a request spreads over both
        "replica.num_cpus=0.5", "replica.torch_threads=1", "replica.autoscaling.min_replicas=2",
        "replica.autoscaling.max_replicas=2",
    ]


def in_process_runner(config):  # type: ignore[no-untyped-def]
    """The flow of the checkout in use, in this process."""
    from serve_app.policies import load_configured_policy
    from serve_app.rewards import CompositeReward
    from serve_app.serving.aggregator import TrajectoryAssembler
    from serve_app.serving.engine import DiffusersEngine
    from serve_app.serving.ingress import RolloutPlanner

    policy = load_configured_policy(config.model)
    planner = RolloutPlanner(policy.text_processor(), config.ingress, config.sampling, policy.geometry,
                             max_work=config.model.max_request_work)
    engine = DiffusersEngine(policy)
    assembler = TrajectoryAssembler(CompositeReward(config.reward.components), config.aggregator.advantage)
    try:
        from serve_app.serving.coordinator import RolloutCoordinator, engine_sample_call
    except ImportError:  # a checkout from before the coordinator: trajectories passed by value
        def run(request):  # type: ignore[no-untyped-def]
            plan = planner.plan(request)
            trajectories = [t for chunk in plan.chunks for t in engine.generate([chunk])[0]]
            return assembler.assemble(trajectories, plan.prompts, plan.group_size, request_id=plan.request_id)

        return run
    coordinator = RolloutCoordinator.in_process(assembler, sample=engine_sample_call(engine))

    def run(request):  # type: ignore[no-untyped-def]
        plan = planner.plan(request)
        return coordinator.run_sync(plan.chunks, plan.prompts, plan.group_size, request_id=plan.request_id).fetch()

    return run


def trajectory_bytes_per_sample(batch) -> float:  # type: ignore[no-untyped-def]
    """Tensor bytes of a sample as it travels: transitions and image."""
    import pickle

    trajectory = batch.trajectory
    return len(pickle.dumps(trajectory, protocol=5)) / len(batch)


def read_counts(folder: Path) -> dict[int, dict[str, int]]:
    counts = {}
    for path in folder.glob("*.json"):
        try:
            entry = json.loads(path.read_text())
        except (json.JSONDecodeError, OSError) as exc:
            raise RuntimeError(f"unreadable tensor-byte counts {path}") from exc
        counts[int(entry["pid"])] = entry
    return counts


def roles(app: str) -> dict[int, str]:
    """pid -> role of the app's processes (Ray titles each actor process ray::ServeReplica:<app>:<deployment>,
    with .<method> appended while a method runs)."""
    import psutil

    found = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        title = (process.info["cmdline"] or [""])[0].strip().split(".", 1)[0]
        for role, deployment in (("ingress", "TokenizerIngress"), ("aggregator", "TrajectoryAggregator"),
                                 ("replicas", "DiffusionReplica")):
            if title == f"ray::ServeReplica:{app}:{deployment}":
                found[int(process.info["pid"])] = role
    return found


def bytes_by_role(before: dict, after: dict, pid_roles: dict[int, str], requests: int) -> dict[str, dict[str, float]]:
    totals = {role: {"serialized": 0.0, "deserialized": 0.0} for role in ("trainer", "ingress", "aggregator", "replicas")}
    for pid, entry in after.items():
        role = "trainer" if pid == os.getpid() else pid_roles.get(pid)
        if role is None:
            continue
        for kind in ("serialized", "deserialized"):
            totals[role][kind] += (entry[kind] - before.get(pid, {}).get(kind, 0)) / requests
    return totals


def measure(args: argparse.Namespace) -> dict:
    import ray
    import torch
    from ray import serve

    from serve_app.app import AppArgs, build_app
    from serve_app.client import RolloutClient
    from serve_app.config import load_config
    from serve_app.api import RolloutRequest

    counts_dir = Path(tempfile.mkdtemp(prefix="dataplane-counts-"))
    os.environ[COUNTS_DIR_ENV] = str(counts_dir)
    count_tensor_bytes()
    torch.set_num_threads(2)
    results = []
    env = {k: os.environ[k] for k in ("FLOWGRPO_HOME", "HF_HUB_OFFLINE", "PYTHONPATH", COUNTS_DIR_ENV) if k in os.environ}
    # stdout stays one JSON document: Ray's workers and shutdown write to fd 1, sent to stderr meanwhile.
    sys.stdout.flush()
    stdout_fd = os.dup(1)
    os.dup2(2, 1)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env, "worker_process_setup_hook": count_tensor_bytes})
    try:
        serve.start(proxy_location="Disabled")  # by handle only: no HTTP proxy, no port to bind
        for size in args.sizes:
            overrides = overrides_for(size)
            config = load_config("diffusion_rollout", overrides)
            prompts = ["a red circle", "two blue squares"]
            request = RolloutRequest(prompts=prompts, group_size=args.group_size, seed=0)
            run_in_process = in_process_runner(config)
            app = f"dataplane-{size}"
            serve.run(build_app(AppArgs(overrides=overrides)), name=app, route_prefix=None)
            client = RolloutClient(app)
            sample_bytes = trajectory_bytes_per_sample(run_in_process(request))
            client.rollout(prompts, args.group_size, seed=0)  # warm-up: every replica has loaded
            local_s, served_s = [], []
            pid_roles = roles(app)
            time.sleep(0.3)
            before = read_counts(counts_dir)
            for _ in range(args.repeats):
                started = time.perf_counter()
                run_in_process(request)
                local_s.append(time.perf_counter() - started)
                started = time.perf_counter()
                client.rollout(prompts, args.group_size, seed=0)
                served_s.append(time.perf_counter() - started)
            time.sleep(0.5)
            after = read_counts(counts_dir)
            served = bytes_by_role(before, after, pid_roles, args.repeats)
            serve.delete(app)
            results.append({
                "size": size,
                "trajectory_bytes_per_sample": sample_bytes,
                "samples_per_request": len(prompts) * args.group_size,
                "in_process_seconds": _summary(local_s),
                "served_seconds": _summary(served_s),
                "throughput_ratio_served_over_in_process": _summary([a / b for a, b in zip(local_s, served_s)]),
                "tensor_bytes_per_request": served,
            })
    finally:
        serve.shutdown()
        ray.shutdown()
        sys.stdout.flush()
        os.dup2(stdout_fd, 1)
    return {
        "benchmark": "bench_dataplane",
        "code": args.code_label,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workload": {"model": "tiny-qwen-image", "prompts": 2, "group_size": args.group_size, "num_steps": 4,
                     "sde_window_size": 2, "chunk_size": 2, "replicas": 2, "replica_torch_threads": 1,
                     "in_process_torch_threads": 2},
        "repeats": args.repeats,
        "sizes": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 512, 768])
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--code", default=None, help="measure the flow of another checkout (its serve_app)")
    parser.add_argument("--code-label", default="this checkout", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.code is not None:
        # Run this script with the other checkout's package first on the path, for this process and Ray's workers.
        code = str(Path(args.code).resolve())
        label = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
        argv = [a for a in sys.argv[1:] if a not in ("--code", args.code)]
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--code-label",
                               label.strip() or code], cwd=code, env={**os.environ, "PYTHONPATH": code})
        sys.exit(done.returncode)
    print(json.dumps(measure(args), indent=2))


if __name__ == "__main__":
    main()
