"""Shared fixtures: one embedded-model cache per test session, loopback-only Ray, one shared Ray cluster."""

import os
from dataclasses import dataclass

import pytest

from serve_app.local_ray import loopback_ray_env
from serve_app.local_ray import free_loopback_port

# Every Ray process a test starts stays on 127.0.0.1 and requires this session's token (CLI and API alike).
loopback_ray_env()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Every cluster a test starts inherits this: Serve's controller reconciles every 0.5 s, not every 0.1 s. Its loop
# is the largest CPU cost of an idle cluster (1.7 of 6.3 CPU-s per 30 s with one app deployed; 0.7 at 0.5 s)
# on a suite that keeps both cores busy, and no test needs a reaction faster than a second.
os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
# Under xdist (`make test`: one worker per core) a worker's second intra-op thread finds no free core: it
# only contends with the other worker and spins in OpenMP's barriers. One thread per worker, and per
# process it starts, before torch is imported here (OpenMP reads this once, at load).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def flowgrpo_home(tmp_path_factory):
    """A FLOWGRPO_HOME for the whole session (embedded models build once, ~15 s)."""
    home = os.environ.get("FLOWGRPO_TEST_HOME")
    if not home and os.environ.get("PYTEST_XDIST_WORKER"):
        # One home for every worker of the run (their base temps are siblings); builds take a file lock.
        home = str(tmp_path_factory.getbasetemp().parent / "flowgrpo_home")
    home = home or str(tmp_path_factory.mktemp("flowgrpo_home"))
    os.environ["FLOWGRPO_HOME"] = home
    return home


@pytest.fixture(scope="session")
def tiny_qwen_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-qwen-image")


@pytest.fixture(scope="session")
def ode_sample():
    """Our sampler at noise 0 from given initial latents: (images [B, 3, H, W] float, log_probs).

    What every policy family must match against its stock diffusers pipeline; `images` are an image-conditioned
    family's input images as sent (resized here as the ingress does).
    """
    from dataclasses import replace

    import torch

    from serve_app.flowgrpo.sampler import denoise, encode_conditioning

    def run(policy, prompt, params, latents, generators, *, images=()):
        resized, condition = policy.geometry.conditioning_images(images, output_size=(params.height, params.width))
        tokens = [replace(t, images=resized, condition_images=condition) for t in policy.text_processor().tokenize([prompt])]
        conditioning = encode_conditioning(policy, tokens, torch.zeros(1, dtype=torch.long), None, params)
        assert (conditioning.negative is not None) == (params.guidance_scale > 1)
        sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width, params.num_frames)
        steps = list(range(params.num_steps - 1))
        result = denoise(policy, conditioning, latents, sigmas, steps, params, generators)
        rows = conditioning.prompts.select(conditioning.embed_row)
        return policy.decode(result.final_latents, height=params.height, width=params.width, cond=rows), result.log_probs

    return run


@pytest.fixture(scope="session")
def tiny_policy(tiny_qwen_dir):
    from serve_app.policies import load_policy

    return load_policy(tiny_qwen_dir, family="qwen_image")


@pytest.fixture(scope="session")
def start_local_app(flowgrpo_home):
    """start_local_app(config, overrides, name=...) -> the ingress handle of the whole app in Serve's
    local testing mode (serve_app.app.run_local: one process, no cluster)."""
    from serve_app.app import AppArgs, run_local

    def start(config: str = "diffusion_rollout", overrides=(), *, name: str):
        return run_local(AppArgs(config=config, overrides=list(overrides)), name=name)

    return start


@dataclass(frozen=True)
class SharedCluster:
    url: str  # Serve's HTTP proxy on loopback; each module deploys its apps under a route prefix of its own
    metrics_port: int  # the node's metrics agent (Prometheus text on loopback)


# The modules that share `ray_cluster`, in the order they run (tests/deployments/test_metrics.py first: it
# checks that its app and trainer export every series, so no earlier app or trainer may have exported one).
SHARED_CLUSTER_FIRST = ("test_metrics.py",)
_shared: dict = {"modules": set(), "stop": None}


@pytest.fixture(scope="session")
def ray_cluster(flowgrpo_home):
    """One single-node Ray cluster on 127.0.0.1 with Serve on a free loopback port, for every module
    that needs no cluster of its own (starting one costs a cluster start, a Serve start and a stop per
    module). Each module deploys its apps under its own names and route prefixes and deletes them when
    it ends. These modules run first in the session, one after another (pytest_collection_modifyitems),
    and the cluster stops after the last of them (pytest_runtest_teardown): the tests that follow may
    start clusters of their own (multi-node, `ray start`), which need Ray uninitialized in this process.
    First, also because a process that was once connected to Ray keeps the metrics it records after and
    exports them to the next cluster it connects to (test_metrics must see only its own).

    What each module used to set on its own cluster, set once here: autoscaling metrics pushed every
    0.5 s (test_cluster's autoscaling test; 10 s by default), a known metrics export port reported every
    second (test_metrics), gloo on loopback with one OpenMP thread (the Ray Train workers)."""
    import ray
    from ray import serve

    env = {
        "FLOWGRPO_HOME": flowgrpo_home,
        "HF_HUB_OFFLINE": "1",
        "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
        # Gloo's pairs on loopback too (by default it binds the address the host name resolves to).
        "GLOO_SOCKET_IFNAME": "lo",
        # Ray's own default for actors of under 2 CPUs; the Ray Train workers (0.5 CPU) ask for it explicitly.
        "OMP_NUM_THREADS": "1",
    }
    # The driver's handles push their autoscaling metrics at the same interval.
    os.environ.update({k: v for k, v in env.items() if k.startswith("RAY_SERVE_")})
    assert not ray.is_initialized(), "an earlier test left Ray initialized in this process"
    metrics_port, http_port = free_loopback_port(), free_loopback_port()
    # address="local": a cluster of its own, even when another one was `ray start`ed on this machine.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000},
             runtime_env={"env_vars": env})

    def stop() -> None:
        _shared["stop"] = None
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()

    _shared["stop"] = stop
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        yield SharedCluster(url=f"http://127.0.0.1:{http_port}", metrics_port=metrics_port)
    finally:
        if _shared["stop"] is not None:
            stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared cluster stops once the last module that uses it is done (its module fixtures, which
    delete their apps, are torn down first)."""
    yield
    if _shared["stop"] is not None and (nextitem is None or nextitem.path not in _shared["modules"]):
        _shared["stop"]()


def _run_shared_cluster_modules_first(items) -> None:
    """Whole modules that use `ray_cluster` go first (SHARED_CLUSTER_FIRST first among them), in their
    collected order otherwise, so the cluster starts once and each module-scoped fixture still sets up
    once."""
    users = {item.path for item in items if "ray_cluster" in getattr(item, "fixturenames", ())}
    _shared["modules"] = users
    if users:
        rank = {path: 0 if path.name in SHARED_CLUSTER_FIRST else 1 for path in users}
        items[:] = (sorted((item for item in items if item.path in users), key=lambda item: rank[item.path])
                    + [item for item in items if item.path not in users])


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns the xdist_group marks added here into scopes
def pytest_collection_modifyitems(config, items):
    """Modules sharing `ray_cluster` run first; `gpu` tests need a CUDA device: skipped, with the reason,
    on machines without one.

    `make test` runs two xdist workers (`--dist loadgroup`). Every module that starts Ray is one unit of
    work, so its module-scoped cluster or app starts once, on one worker: the modules sharing `ray_cluster`
    together as one unit, in the order above, and each module that starts a cluster of its own (multi-node,
    `ray start`, Ray Train) as a unit of its own. The two workers run such units side by side: each cluster
    has its own temp dir and free ports (`address="local"` for the shared one). Everything else, including
    the benchmark scripts (their clusters are their subprocesses'), is spread test by test."""
    _run_shared_cluster_modules_first(items)
    for item in items:
        if item.path in _shared["modules"]:
            item.add_marker(pytest.mark.xdist_group("ray-shared"))
        elif "cluster" in item.keywords and item.path.parent.name != "benchmarks":
            item.add_marker(pytest.mark.xdist_group(f"ray-{item.path.stem}"))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """Under `--dist loadgroup`, fail at once if the groups above did not become xdist's scopes (xdist
    3.8 marks a grouped test by a suffix on its node id, which pytest 9.2 no longer reads): the Ray
    modules would then be spread test by test, each worker starting every module's cluster again."""
    if not getattr(session.config.option, "loadgroup", False):  # set in xdist workers only
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"xdist did not group {len(lost)} tests (e.g. {lost[0]}): "
                                "check the pytest / pytest-xdist versions pinned in pyproject.toml")
