"""The environment of every Ray process this project starts on one machine (tests, demo, benchmarks).

- RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a single-node cluster on 127.0.0.1 (Ray binds to the
  machine's routable address otherwise).
- RAY_AUTH_MODE=token with a random RAY_AUTH_TOKEN: Serve replicas serve their inter-deployment gRPC on
  all interfaces ([::]) whatever the node address, and that server unpickles what it receives; Ray's
  token authentication puts an interceptor in front of it (and of the dashboard's HTTP API), so a
  client without the cluster's token is refused. The CLI (`ray start`, `serve deploy`) reads the same
  two variables, which is why they are set once, here or in the Makefile, for every process.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator


def loopback_ray_env() -> dict[str, str]:
    """Set the variables above in this process where unset (children inherit them); return them."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")
    return {name: os.environ[name] for name in names}


@contextlib.contextmanager
def benchmark_cluster(*, http_port: int | None) -> Iterator[None]:
    """A one-node Ray cluster (with Serve on loopback unless `http_port` is None) for a script whose
    stdout must stay one JSON document: fd 1 goes to stderr while Ray runs (its workers and shutdown
    write there)."""
    loopback_ray_env()  # before Ray is imported: it reads RAY_AUTH_MODE at import
    import ray
    from ray import serve

    env = {k: os.environ[k] for k in ("FLOWGRPO_HOME", "HF_HUB_OFFLINE") if k in os.environ}
    sys.stdout.flush()
    stdout_fd = os.dup(1)
    os.dup2(2, 1)
    # address="local": a cluster of its own even when `ray start` left another one on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        if http_port is not None:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield
    finally:
        if http_port is not None:
            serve.shutdown()
        ray.shutdown()
        sys.stdout.flush()
        os.dup2(stdout_fd, 1)
