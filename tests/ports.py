"""Loopback ports for servers a test starts a while after it picks the port.

A port found by binding port 0 comes from the kernel's ephemeral range, the same range every other
port-0 bind draws from: Ray hands such ports to its GCS, raylets, agents and workers' gRPC servers as
a cluster starts, so a port picked that way before `ray.init` or `serve.start` can be taken by the time
Serve's proxy binds it ("Failed to bind to address"). Ports picked here lie below the ephemeral range and
above Ray's worker ports, where nothing is handed out unasked.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_MAX = 19999  # Ray's default max_worker_port
_rng = random.SystemRandom()  # not the seeded `random`: two pytest workers must not draw the same ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port free now, outside the kernel's ephemeral range and Ray's worker ports."""
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
