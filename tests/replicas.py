"""How many replicas Serve counts RUNNING: started and initialized (policy loaded), so its router sends them
requests. A replica's actor exists, and its process has a pid, while it is still loading."""

from __future__ import annotations

import time


def running_replicas(app: str, deployment: str = "DiffusionReplica") -> int:
    from ray import serve

    return serve.status().applications[app].deployments[deployment].replica_states.get("RUNNING", 0)


def wait_for_running_replicas(app: str, count: int, *, timeout_s: float, deployment: str = "DiffusionReplica") -> int:
    """Polls until `count` replicas are RUNNING or `timeout_s` has passed; returns the last count (the caller
    decides whether a miss fails the test)."""
    deadline = time.monotonic() + timeout_s
    while (running := running_replicas(app, deployment)) != count and time.monotonic() < deadline:
        time.sleep(1.0)
    return running
