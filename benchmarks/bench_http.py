"""The HTTP wire protocol beside the handle, side by side in one run on a one-node Ray cluster (127.0.0.1):

- rollouts: the same seeded request by handle (RolloutClient, transitions and images fetched) and over HTTP
  (HttpRolloutClient, the binary answer with the trajectories and images), alternating, at 26 kB to 3.5 MB
  a sample (bench_dataplane's workload and its measure of a sample: the tiny Qwen-Image at 64 to 768 px, 2
  prompts x 2 samples, 4 steps, a window of 2, chunks of 2, two replicas on one torch thread each); per size
  the throughput ratio HTTP / handle, the bytes on the wire over the raw tensor bytes (and the header's
  bytes), and the JSON answer's size and time beside the binary one's;
- weight versions: a publish over HTTP (POST /v1/weights: encoded, hashed, checked against the served model,
  stored) vs through Ray's object store (RegistryStore.publish_next, what a trainer on the cluster does), for
  the shapes world's LoRA (0.4 MB) and the small model's whole transformer (39 MB), alternating.

    .venv/bin/python benchmarks/bench_http.py [--repeats 5] [--sizes 64 256 512 768] [--payloads ...]

Prints one JSON document; every figure is min / median / max over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

from serve_app.local_ray import loopback_ray_env

loopback_ray_env()  # before Ray is imported anywhere: it reads RAY_AUTH_MODE at import

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dataplane import overrides_for  # noqa: E402  (the data plane's workload, the same requests)
from bench_weights import payload  # noqa: E402  (the trainer's versions: shapes LoRA, small transformer)

PROMPTS = ["a red circle", "two blue squares"]
# The app each weight payload is a version of (the upload is checked against the served model).
PAYLOAD_MODELS = {"shapes_lora": ["model=shapes_qwen_image", "reward=shapes"], "small_full_transformer": ["model=small_qwen_image"]}


def _summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def raw_tensor_bytes(body: bytes) -> int:
    """The bytes of the tensors a binary answer holds (its header says where each lies)."""
    length = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + length])
    return sum(end - begin for name, entry in header.items() if name != "__metadata__"
               for begin, end in [entry["data_offsets"]])


def deploy(name: str, overrides: list[str]) -> None:
    from ray import serve

    from serve_app.app import AppArgs, build_app

    serve.run(build_app(AppArgs(overrides=overrides)), name=name, route_prefix=f"/{name}")


def measure_rollouts(size: int, url: str, token_args: list[str], token: str, repeats: int) -> dict:
    import httpx
    from ray import serve

    from serve_app.client import RolloutClient
    from serve_app.http_client import HttpRolloutClient
    from serve_app.wire import TRAJECTORY_MEDIA_TYPE

    app = f"http-{size}"
    deploy(app, [*overrides_for(size), f"app_name={app}", *token_args])
    by_handle, over_http = RolloutClient(app), HttpRolloutClient(f"{url}/{app}", token)
    group = 2
    by_handle.rollout(PROMPTS, group, seed=0)  # warm-up: every replica has loaded, both paths have run once
    over_http.rollout(PROMPTS, group, seed=0)
    handle_s, http_s, json_s = [], [], []
    body = {"prompts": PROMPTS, "group_size": group, "seed": 0}
    headers = {"Authorization": f"Bearer {token}"}
    for repeat in range(repeats):
        paths = [("handle", lambda: by_handle.rollout(PROMPTS, group, seed=0, return_images=True)),
                 ("http", lambda: over_http.rollout(PROMPTS, group, seed=0, return_images=True))]
        for name, call in paths if repeat % 2 == 0 else paths[::-1]:  # either order as often: the noise hits both
            (handle_s if name == "handle" else http_s).append(_timed(call))
        json_s.append(_timed(lambda: httpx.post(f"{url}/{app}/v1/rollouts", json=body, headers=headers, timeout=600)))
    binary = httpx.post(f"{url}/{app}/v1/rollouts", json={**body, "return_trajectory": True, "return_images": True},
                        timeout=600,
                        headers={**headers, "Accept": TRAJECTORY_MEDIA_TYPE}).content
    as_json = httpx.post(f"{url}/{app}/v1/rollouts", json=body, headers=headers, timeout=600).content
    serve.delete(app)
    samples = len(PROMPTS) * group
    tensors = raw_tensor_bytes(binary)
    return {
        "size": size,
        "samples_per_request": samples,
        "tensor_bytes_per_sample": tensors / samples,
        "handle_seconds": _summary(handle_s),
        "http_binary_seconds": _summary(http_s),
        "throughput_ratio_http_over_handle": _summary([h / b for h, b in zip(handle_s, http_s)]),
        "wire_bytes_over_tensor_bytes": len(binary) / tensors,
        "binary_answer_bytes": len(binary),
        "binary_header_bytes": len(binary) - tensors,
        "json_answer_bytes": len(as_json),
        "json_answer_seconds": _summary(json_s),
    }


def measure_publish(name: str, payload: tuple, url: str, token_args: list[str], token: str, repeats: int) -> dict:
    from ray import serve

    from serve_app.config import load_config
    from serve_app.http_client import HttpRolloutClient
    from serve_app.weights import open_weight_store

    tensors, kind, lora = payload
    app = f"http-weights-{name.replace('_', '-')}"
    overrides = [*PAYLOAD_MODELS[name], f"app_name={app}", "weights.transport=object_store", "weights.keep_versions=2",
                 "replica.num_cpus=0.5", "replica.autoscaling.max_replicas=1", *token_args]
    deploy(app, overrides)
    store = open_weight_store(load_config("diffusion_rollout", overrides))  # the app's registry in the object store
    client = HttpRolloutClient(f"{url}/{app}", token)
    store.publish_next(tensors, kind=kind, lora=lora)  # warm-up of both paths (the ingress asks a replica once)
    client.publish(tensors, kind=kind, lora=lora)
    http_s, store_s = [], []
    for repeat in range(repeats):
        paths = [("http", lambda: client.publish(tensors, kind=kind, lora=lora)),
                 ("store", lambda: store.publish_next(tensors, kind=kind, lora=lora))]
        for path, call in paths if repeat % 2 == 0 else paths[::-1]:
            (http_s if path == "http" else store_s).append(_timed(call))
    serve.delete(app)
    return {
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "tensors": len(tensors),
        "http_seconds": _summary(http_s),
        "object_store_seconds": _summary(store_s),
        "ratio_http_over_object_store": _summary([h / s for h, s in zip(http_s, store_s)]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 512, 768])
    parser.add_argument("--payloads", nargs="*", default=list(PAYLOAD_MODELS), choices=list(PAYLOAD_MODELS))
    args = parser.parse_args()

    from serve_app.local_ray import benchmark_cluster

    token = secrets.token_hex(16)
    report: dict = {"benchmark": "bench_http", "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "repeats": args.repeats, "rollouts": [], "publish": {}}
    with benchmark_cluster(serve="http") as url, tempfile.TemporaryDirectory(prefix="bench-http-") as scratch:
        token_file = Path(scratch) / "token"
        token_file.write_text(token)
        token_args = [f"ingress.api_token_file={token_file}"]
        for size in args.sizes:
            report["rollouts"].append(measure_rollouts(size, url, token_args, token, args.repeats))
        for name in args.payloads:
            report["publish"][name] = measure_publish(name, payload(name), url, token_args, token, args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
