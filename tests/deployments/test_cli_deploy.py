"""`serve deploy serve_config.yaml` + `serve status` from the CLI, against `ray start --head` on loopback."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dashboard_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/ray/version", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _run(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def head_node(flowgrpo_home, tmp_path_factory):
    dashboard_port, gcs_port, http_port = _free_port(), _free_port(), _free_port()
    env = {
        **os.environ,
        "FLOWGRPO_HOME": flowgrpo_home,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_ADDRESS": f"127.0.0.1:{gcs_port}",
    }
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's unix socket paths must fit 107 chars
    # `ray start --block` in its own session: killing that process group stops exactly this cluster,
    # where `ray stop` would stop every Ray cluster on the machine (and this test process's, if any).
    head = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "2", "--port", str(gcs_port),
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
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_serve_deploy_reaches_running_and_serves(head_node):
    env, dashboard, config_file, http_port = head_node
    deployed = _run(str(BIN / "serve"), "deploy", str(config_file), "--address", dashboard, env=env)
    assert deployed.returncode == 0, deployed.stderr[-2000:]
    deadline = time.monotonic() + 240
    status = ""
    while time.monotonic() < deadline:
        out = _run(str(BIN / "serve"), "status", "--address", dashboard, env=env)
        status = out.stdout
        parsed = yaml.safe_load(status) or {}
        app = (parsed.get("applications") or {}).get("flowgrpo") or {}
        if app.get("status") == "RUNNING":
            break
        assert app.get("status") != "DEPLOY_FAILED", status
        time.sleep(2)
    parsed = yaml.safe_load(status)
    app = parsed["applications"]["flowgrpo"]
    assert app["status"] == "RUNNING", status
    assert set(app["deployments"]) == {"TokenizerIngress", "DiffusionReplica", "TrajectoryAggregator"}
    assert all(d["status"] == "HEALTHY" for d in app["deployments"].values()), status
    reply = httpx.post(
        f"http://127.0.0.1:{http_port}/v1/rollouts", json={"prompts": ["a cat"], "group_size": 2, "seed": 1}, timeout=120
    )
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["samples"]) == 2
