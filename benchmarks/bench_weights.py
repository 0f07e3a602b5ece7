"""Seconds and bytes per weight version, by transport: the shapes world's LoRA and the whole
transformer of the small model, published by this process and fetched by another (a Ray task, as a
replica would), through the filesystem store and through Ray's object store.

    .venv/bin/python benchmarks/bench_weights.py [--repeats 5]

Prints one JSON document: per payload and transport, min / median / max of publish and fetch seconds
(fetch = load and read every byte once), and the payload's bytes.
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


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def payload(name: str) -> tuple[dict, str, object]:
    """(tensors, kind, LoRA spec) of a version a trainer publishes: `shapes_lora` (the shapes world's adapter) or
    `small_full_transformer` (the small model's whole transformer)."""
    from serve_app.policies import load_configured_policy
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.lora import TrainableTransformer

    if name == "shapes_lora":
        config = load_trainer_config("trainer/shapes")
    else:
        config = load_trainer_config("trainer/flowgrpo", ["model=small_qwen_image", "trainer.lora.enabled=false"])
    model = TrainableTransformer(load_configured_policy(config.model), config.trainer.lora)
    return model.publishable_state(), model.kind, model.spec


PAYLOADS = ("shapes_lora", "small_full_transformer")


def measure(make_store, tensors: dict, kind: str, lora, *, repeats: int) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    def fetch(version: int) -> float:  # another process, as a replica would fetch
        store = make_store()
        started = time.perf_counter()
        tensors = store.load(version).tensors
        # Read every byte once, as a replica copying them into its modules does: safetensors maps the
        # file lazily, so `load` alone would time the page cache lookup, not the transfer.
        for tensor in tensors.values():
            tensor.clone()
        return time.perf_counter() - started

    store = make_store()
    publish_s, fetch_s = [], []
    for repeat in range(repeats):
        version = store.latest_version() + 1
        started = time.perf_counter()
        store.publish(version, tensors, kind=kind, lora=lora)
        publish_s.append(time.perf_counter() - started)
        fetch_s.append(ray.get(fetch.remote(version)))
    return {"publish_seconds": _summary(publish_s), "fetch_seconds": _summary(fetch_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from serve_app.local_ray import benchmark_cluster
    from serve_app.weights.registry import RegistryStore
    from serve_app.weights import WeightStore

    report = {"benchmark": "bench_weights", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "repeats": args.repeats, "payloads": {}}
    with benchmark_cluster(serve="none"), tempfile.TemporaryDirectory(prefix="bench-weights-") as scratch:
        for name in PAYLOADS:
            tensors, kind, lora = payload(name)
            folder = Path(scratch) / name
            transports = {
                "filesystem": lambda folder=folder: WeightStore(folder, keep=2),
                "object_store": lambda name=name: RegistryStore(f"bench/{name}", model=None, keep=2),
            }
            report["payloads"][name] = {
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "tensors": len(tensors),
                **{t: measure(make, tensors, kind, lora, repeats=args.repeats) for t, make in transports.items()},
            }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
