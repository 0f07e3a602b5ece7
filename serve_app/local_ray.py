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
import random
import secrets
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal


def loopback_ray_env() -> dict[str, str]:
    """Set the variables above in this process where unset (children inherit them); return them."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    names = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_USAGE_STATS_ENABLED")
    return {name: os.environ[name] for name in names}


RAY_WORKER_PORTS_MAX = 19999  # Ray's default max_worker_port
_rng = random.SystemRandom()  # not the seeded `random`: two processes picking at once must not draw alike


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_loopback_port() -> int:
    """A loopback TCP port free now, for a server started a while later (Serve's proxy after `ray.init`).

    Not a port-0 bind: those come from the kernel's ephemeral range, which Ray draws from for its GCS,
    raylets, agents and workers' gRPC servers as a cluster starts, so such a port can be taken before the
    proxy binds it ("Failed to bind to address"). This one lies below that range and above Ray's worker
    ports, where nothing is handed out unasked."""
    low, high = RAY_WORKER_PORTS_MAX + 1, _ephemeral_low() - 1
    for _ in range(100 if high - low > 100 else 0):
        port = _rng.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a machine whose ephemeral range leaves no room below it
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def benchmark_cluster(*, serve: Literal["none", "handles", "http"]) -> Iterator[str | None]:
    """A one-node Ray cluster for a script whose stdout must stay one JSON document: fd 1 goes to stderr
    while Ray runs (its workers and shutdown write there).

    `serve`: "handles" starts Serve without its HTTP proxy (a script calling its apps by handle binds no
    port); "http" with the proxy on a free loopback port, never a fixed one (two benchmarks may run at
    once), and the block gets its URL."""
    loopback_ray_env()  # before Ray is imported: it reads RAY_AUTH_MODE at import
    import ray
    from ray import serve as ray_serve

    env = {k: os.environ[k] for k in ("FLOWGRPO_HOME", "HF_HUB_OFFLINE") if k in os.environ}
    sys.stdout.flush()
    stdout_fd = os.dup(1)
    os.dup2(2, 1)
    # address="local": a cluster of its own even when `ray start` left another one on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"env_vars": env})
    try:
        url = None
        if serve == "handles":
            ray_serve.start(proxy_location="Disabled")
        elif serve == "http":
            port = free_loopback_port()
            ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
            url = f"http://127.0.0.1:{port}"
        yield url
    finally:
        if serve != "none":
            ray_serve.shutdown()
        ray.shutdown()
        sys.stdout.flush()
        os.dup2(stdout_fd, 1)
