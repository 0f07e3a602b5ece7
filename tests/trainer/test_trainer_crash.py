"""A trainer SIGKILLed at every phase of a step resumes into the run it would have been.

The app runs on the session's shared cluster (tests/conftest.py), so it outlives the trainers; each trainer is a
process of its own (forked from a server that imported the trainer once: tests/forked.py) that trains over the HTTP
API (no Ray in it: a killed trainer is a lost HTTP client to the service). One run goes straight through 5 steps.
Another is killed four times, once at each phase (serve_app.trainer.faults: the rollout in flight at step 1, inside
the update of step 2, between publishing step 3's version and checkpointing it, halfway through writing step 4's
checkpoint), each time resumed at once with --resume, and ends at step 5 with the straight run's weights, bitwise,
and no object left in the store. One torch thread everywhere and chunks never fused (replica.max_batch_size 1):
each rollout and each update is the same computation in both runs, wherever it is cut.
"""

import csv
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from serve_app.http_client import HttpRolloutClient
from tests.forked import Finished, run_forked
from tests.object_store import back_to, objects

pytestmark = pytest.mark.cluster

APP = "flowgrpo-crash"
STEPS = 5
CRASHES = ["rollout@1", "update@2", "publish@3", "checkpoint@4"]
SAMPLING = ["sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=2",
            "sampling.sde_window_range=[0,2]"]
TRAINER = ["trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=4", "trainer.eval_every=0",
           "trainer.image_every=0", "trainer.inner_epochs=1", "trainer.lr=1e-2", "trainer.max_staleness=1",
           "trainer.torch_threads=1", "trainer.checkpoint_every=1"]
COMPARED = ("reward_mean", "loss", "ratio_max", "ratio_min", "staleness", "approx_kl")


@pytest.fixture(scope="module")
def app(ray_cluster, tmp_path_factory):
    from ray import serve

    from serve_app.app import AppArgs, build_app

    home = tmp_path_factory.mktemp("crash")
    (home / "token").write_text("crash-test-token")
    overrides = [*SAMPLING, f"app_name={APP}", f"replica.weights_dir={home / 'weights'}", "replica.torch_threads=1",
                 "replica.max_batch_size=1", "replica.num_cpus=0.2", "replica.autoscaling.min_replicas=1",
                 "replica.autoscaling.max_replicas=1", f"ingress.api_token_file={home / 'token'}"]
    serve.run(build_app(AppArgs(overrides=overrides)), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_cluster.url}/{APP}", home / "token", overrides
    serve.delete(APP)


def _train(app, out: Path, *, crash_at: str | None = None, resume: bool = False) -> Finished:
    url, token, overrides = app
    env = dict(os.environ)
    env.pop("FLOWGRPO_CRASH_AT", None)
    if crash_at is not None:
        env["FLOWGRPO_CRASH_AT"] = crash_at
    argv = ["--url", url, "--token-file", str(token), "--steps", str(STEPS), "--out", str(out),
            *(["--resume", str(out / "checkpoint")] if resume else []), *overrides, *TRAINER]
    log = out.parent / f"{out.name}-{crash_at or 'to-the-end'}{'-resumed' if resume else ''}.log"
    return run_forked("serve_app.trainer.__main__:main", argv, env=env, log=log, timeout_s=300)


def test_a_trainer_killed_at_every_phase_resumes_into_the_run_it_would_have_been(app, tmp_path):
    url, token, _ = app
    client = HttpRolloutClient(url, token.read_text())
    straight = _train(app, tmp_path / "straight")
    assert straight.returncode == 0, straight.output[-3000:]
    published = [v.policy_version for v in client.versions().versions if v.policy_version > 0]
    assert published == list(range(1, STEPS + 1))
    before = objects()

    for i, crash_at in enumerate(CRASHES):
        killed = _train(app, tmp_path / "killed", crash_at=crash_at, resume=i > 0)
        assert killed.returncode == -signal.SIGKILL, (crash_at, killed.returncode, killed.output[-3000:])
    resumed = _train(app, tmp_path / "killed", resume=True)
    assert resumed.returncode == 0, resumed.output[-3000:]

    mine = load_file(tmp_path / "killed" / "lora_final.safetensors")
    theirs = load_file(tmp_path / "straight" / "lora_final.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert any(v.abs().max() > 0 for k, v in mine.items() if "lora_B" in k)  # it trained
    rows = [list(csv.DictReader((tmp_path / run / "metrics.csv").open())) for run in ("straight", "killed")]
    assert [float(r["step"]) for r in rows[1]] == list(range(STEPS))
    assert [[float(r[c]) for c in COMPARED] for r in rows[0]] == [[float(r[c]) for c in COMPARED] for r in rows[1]]
    # One version per step: the ones published by a killed run and checkpointed by none (steps 3 and 4) were
    # recognised by their content and kept, never published again, and each holds the straight run's weights.
    versions = [v for v in client.versions().versions if v.policy_version > 0]
    assert [v.policy_version for v in versions] == list(range(1, 2 * STEPS + 1))
    hashes = [v.weights_hash for v in versions]
    assert hashes[STEPS:] == hashes[:STEPS]
    # The killed trainers' requests in flight left nothing in the object store, and the service still serves.
    assert back_to(before) <= before
    assert client.rollout(["a cat"], 2, seed=1).transitions.log_probs.shape[0] == 2
