"""The reference trainer over HTTP alone: the same loop, the HTTP client and publisher, in a process where
`import ray` never runs, trains to the same weights as the trainer by handle (bitwise, on the CPU).

Both train against one app in Serve's local testing mode, its HTTP API served on loopback in this process
(tests/http_server.py). One torch thread everywhere and chunks never fused (replica.max_batch_size 1), so
each rollout and each update is the same computation in both runs.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.http_server import serve_http
from serve_app.client import RolloutClient
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.loop import FlowGRPOTrainer, load_trainer_policy

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 3
APP = ["sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=2",
       "sampling.sde_window_range=[0,2]", "replica.torch_threads=1", "replica.max_batch_size=1"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8", "trainer.eval_every=0",
           "trainer.image_every=0", "trainer.inner_epochs=1", "trainer.lr=1e-2", "trainer.max_staleness=1",
           "trainer.torch_threads=1", "trainer.checkpoint_every=0"]
# Runs `python -m serve_app.trainer ...` with Ray unimportable: an `import ray` anywhere in the run fails it.
WITHOUT_RAY = ("import runpy, sys\n"
               "sys.modules['ray'] = None\n"
               "sys.argv = ['serve_app.trainer', *sys.argv[1:]]\n"
               "runpy.run_module('serve_app.trainer', run_name='__main__', alter_sys=True)\n")


def test_the_trainer_over_http_publishes_the_weights_the_trainer_by_handle_does(start_local_app, tmp_path):
    overrides = [*APP, f"replica.weights_dir={tmp_path / 'weights'}"]
    handle = start_local_app("diffusion_rollout", overrides, name="trainer-http")
    config = load_trainer_config("trainer/flowgrpo", [*overrides, *TRAINER])
    by_handle = FlowGRPOTrainer(config, RolloutClient(handle=handle), tmp_path / "handle",
                                policy=load_trainer_policy(config), progress=False)
    by_handle.train(STEPS)
    assert by_handle.store.versions() == list(range(1, STEPS + 1))

    token = "trainer-http-test-token"
    (tmp_path / "token").write_text(token)
    with serve_http(handle, token=token) as url:
        done = subprocess.run(
            [sys.executable, "-c", WITHOUT_RAY, "--url", url, "--token-file", str(tmp_path / "token"),
             "--config", "trainer/flowgrpo", "--steps", str(STEPS), "--out", str(tmp_path / "http"),
             *overrides, *TRAINER],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    # The HTTP run's versions were numbered by the app after the handle run's: STEPS + 1 .. 2 STEPS.
    assert by_handle.store.versions() == list(range(1, 2 * STEPS + 1))
    mine, theirs = load_file(tmp_path / "handle" / "lora_final.safetensors"), load_file(tmp_path / "http" / "lora_final.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert any(v.abs().max() > 0 for k, v in mine.items() if "lora_B" in k)  # the runs trained: B left zero
    # Each HTTP version holds the handle run's weights of the same step, under its own number.
    for step in range(1, STEPS + 1):
        assert by_handle.store.published_hash(step) == by_handle.store.published_hash(step + STEPS)
    rows = [list(csv.DictReader((tmp_path / run / "metrics.csv").open())) for run in ("handle", "http")]
    assert [(r["reward_mean"], r["loss"]) for r in rows[0]] == [(r["reward_mean"], r["loss"]) for r in rows[1]]
