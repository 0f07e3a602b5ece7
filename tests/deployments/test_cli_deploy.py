"""`serve deploy serve_config.yaml` + `serve status` from the CLI, against `ray start --head` on loopback.

The head advertises one logical GPU (`--num-gpus 1` needs no device), so the README's GPU recipe
deploys here too, with the tiny model forced onto the CPU. One `serve deploy` starts the repo's app, the
GPU recipe and a recipe whose `deployments:` conflict with its args, side by side.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.local_ray import loopback_ray_env
from serve_app.local_ray import free_loopback_port

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _dashboard_up(port: int) -> bool:
    token = {"authorization": f"Bearer {loopback_ray_env()['RAY_AUTH_TOKEN']}"}
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/ray/version", headers=token, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _run(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def head_node(flowgrpo_home, tmp_path_factory):
    dashboard_port, gcs_port, http_port = free_loopback_port(), free_loopback_port(), free_loopback_port()
    env = {
        **os.environ,
        "FLOWGRPO_HOME": flowgrpo_home,
        **loopback_ray_env(),
        "RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
        # Serve's controller gives up on a deployment after its first failed replica start (3 a replica by
        # default): the refused-option app fails at once, where each retry starts a replica process.
        "RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT": "1",
    }
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix socket paths must fit 107 chars
    # `ray start --block` in its own session: killing that process group stops exactly this cluster,
    # where `ray stop` would stop every Ray cluster on the machine (and this test process's, if any).
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--num-gpus", "1", "--port", str(gcs_port),
         "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
         "--dashboard-port", str(dashboard_port), "--disable-usage-stats",
         "--temp-dir", ray_tmp],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not _dashboard_up(dashboard_port):  # serve deploy talks to the dashboard's REST API
        assert head.poll() is None and time.monotonic() < deadline, "ray start --head did not come up"
        time.sleep(1)
    # The repo's serve_config.yaml, on a free HTTP port so it cannot collide with anything running.
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"]["port"] = http_port
    config_file = tmp_path_factory.mktemp("serve") / "serve_config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    try:
        yield env, f"http://127.0.0.1:{dashboard_port}", config_file, http_port
    finally:
        # Nothing of this cluster outlives the test: a graceful stop gets a few seconds, then the whole
        # process group is killed (Ray's own graceful stop waits up to 30 s for its workers).
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


# The README's "Training a real model" recipe, with the tiny model in place of the real checkout.
GPU_RECIPE = {
    "config": "gpu_rollout",
    "overrides": ["model=tiny_qwen_image", "model.device=cpu", "replica.num_gpus=1", "replica.autoscaling.max_replicas=8"],
}
# The recipe again, with `deployments:` giving the replica other resources than its args: it must refuse to
# start. Its ingress and aggregator take no CPU, so the three apps fit the head's 2 CPUs (0.7 + 0.7 + 0.5).
CONFLICTING = {
    "name": "flowgrpo-conflict", "route_prefix": "/conflict", "import_path": "serve_app.app:build_app",
    "args": {**GPU_RECIPE, "overrides": [*GPU_RECIPE["overrides"], "app_name=flowgrpo-conflict",
                                         "ingress.num_cpus=0", "aggregator.num_cpus=0"]},
    "deployments": [{"name": "DiffusionReplica", "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0}}],
}
APPS = ("flowgrpo", "flowgrpo-gpu", "flowgrpo-conflict")


@pytest.fixture(scope="module")
def deployed(head_node):
    """One `serve deploy` (on an empty Serve) of the repo's serve_config.yaml with two more applications
    beside its own: the README's GPU recipe and a conflicting variant of it. The three start together,
    where one deploy each (a Serve shutdown, a deploy, replicas loading their models) took three times
    as long; each test waits for its own app's status."""
    env, dashboard, config_file, http_port = head_node
    config = yaml.safe_load(config_file.read_text())
    gpu = {**config["applications"][0], "name": "flowgrpo-gpu", "route_prefix": "/gpu",
           "args": {**GPU_RECIPE, "overrides": [*GPU_RECIPE["overrides"], "app_name=flowgrpo-gpu"]}}
    config["applications"] += [gpu, CONFLICTING]
    assert [app["name"] for app in config["applications"]] == list(APPS)
    three = config_file.with_name("serve_config.three_apps.yaml")
    three.write_text(yaml.safe_dump(config))
    down = _run(str(BIN / "serve"), "shutdown", "--address", dashboard, "--yes", env=env)
    assert down.returncode == 0, down.stderr[-2000:]
    deployed = _run(str(BIN / "serve"), "deploy", str(three), "--address", dashboard, env=env)
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    return head_node


def _wait_for(name: str, env: dict, dashboard: str, *, until: str, timeout: float = 240) -> dict:
    """The app's status (the dashboard's REST API, which `serve status` reads) once it is `until`
    (RUNNING or DEPLOY_FAILED); fails at once on the other of the two."""
    deadline = time.monotonic() + timeout
    token = {"authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"}
    app: dict = {}
    while time.monotonic() < deadline:
        reply = httpx.get(f"{dashboard}/api/serve/applications/", headers=token, timeout=30)
        app = (reply.json().get("applications") or {}).get(name) or {} if reply.status_code == 200 else {}
        if app.get("status") == until:
            return app
        assert app.get("status") not in {"RUNNING", "DEPLOY_FAILED"} - {until}, app
        time.sleep(0.5)
    raise AssertionError(f"the app {name} did not reach {until} in {timeout} s:\n{app}")


def test_serve_deploy_reaches_running_and_serves(deployed):
    env, dashboard, _, http_port = deployed
    app = _wait_for("flowgrpo", env, dashboard, until="RUNNING")
    assert set(app["deployments"]) == {"TokenizerIngress", "DiffusionReplica", "TrajectoryAggregator"}
    assert all(d["status"] == "HEALTHY" for d in app["deployments"].values()), app
    status = yaml.safe_load(_run(str(BIN / "serve"), "status", "--address", dashboard, env=env).stdout)
    assert status["applications"]["flowgrpo"]["status"] == "RUNNING", status  # what the CLI reports
    reply = httpx.post(
        f"http://127.0.0.1:{http_port}/v1/rollouts", json={"prompts": ["a cat"], "group_size": 2, "seed": 1}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["samples"]) == 2


def test_the_readme_gpu_recipe_gives_the_replica_a_gpu(deployed):
    from ray.util.state import list_actors

    env, dashboard, _, _ = deployed
    _wait_for("flowgrpo-gpu", env, dashboard, until="RUNNING")
    replicas = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True, raise_on_missing_output=False)
    held = [a.required_resources for a in replicas if a.name.startswith("SERVE_REPLICA::flowgrpo-gpu#DiffusionReplica#")]
    assert held and all(r.get("GPU") == 1.0 for r in held), held


def test_an_option_set_in_serve_config_and_in_args_fails_the_deploy_naming_both(deployed):
    env, dashboard, _, _ = deployed
    app = _wait_for("flowgrpo-conflict", env, dashboard, until="DEPLOY_FAILED", timeout=300)
    message = app["deployments"]["DiffusionReplica"]["message"]
    assert "ray_actor_options.num_gpus = 0" in message and "replica.num_gpus = 1" in message, message
    assert "deployments:" in message, message


def test_the_dashboard_refuses_a_job_without_the_token(head_node):
    env, dashboard, _, _ = head_node
    job = {"entrypoint": "echo hello"}
    refused = httpx.post(f"{dashboard}/api/jobs/", json=job, timeout=30)
    assert refused.status_code in (401, 403), refused.text
    listed = httpx.get(f"{dashboard}/api/jobs/", timeout=30,
                       headers={"authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    assert listed.status_code == 200, listed.text  # the same API answers the cluster's own token
