"""How many objects a test's cluster holds: a request or a process that is gone must leave none behind."""

import re
import time


def objects() -> int:
    """Objects in this process's cluster's object store (named by address: another test's cluster may run beside it)."""
    import ray
    from ray._private.internal_api import memory_summary

    summary = memory_summary(address=ray.get_runtime_context().gcs_address, stats_only=True)
    return int(re.search(r"(\d+) objects", summary).group(1))


def back_to(before: int, *, timeout_s: float = 60) -> int:
    """The object count once it is back to `before` (or after `timeout_s`, whatever it is then)."""
    deadline = time.monotonic() + timeout_s
    while (now := objects()) > before and time.monotonic() < deadline:
        time.sleep(0.5)
    return now
