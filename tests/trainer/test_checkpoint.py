"""Checkpoints on disk and the rollouts in flight they record (plain functions, no app)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from serve_app.trainer.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from serve_app.trainer.faults import check_crash_env
from serve_app.trainer.pipeline import RolloutPipeline

REPO = Path(__file__).resolve().parents[2]


def _state(step: int, **fields) -> CheckpointState:
    return CheckpointState(step=step, policy_version=step, trainable={"a": torch.full((2,), float(step))},
                           optimizer={"state": {}, "param_groups": []}, **fields)


def test_a_checkpoint_round_trips_what_a_resumed_run_needs(tmp_path):
    kept = {3: {"a": torch.zeros(2)}, 1: {"a": torch.ones(2)}}
    save_checkpoint(tmp_path / "checkpoint", _state(4, kept=kept, in_flight=((4, 3), (5, 4)), policy_versions=(3, 4),
                                                    dropped_batches=2), extra={"kind": "lora"})
    state = load_checkpoint(tmp_path / "checkpoint")
    assert (state.step, state.policy_version, state.in_flight, state.policy_versions, state.dropped_batches) == (
        4, 4, ((4, 3), (5, 4)), (3, 4), 2)
    assert list(state.kept) == [1, 3] and torch.equal(state.kept[1]["a"], torch.ones(2))
    assert torch.equal(state.trainable["a"], torch.full((2,), 4.0))
    assert state.rng is not None and torch.equal(state.rng["torch"], torch.get_rng_state())


def test_the_link_moves_to_each_new_checkpoint_and_the_old_one_goes(tmp_path):
    link = tmp_path / "checkpoint"
    link.mkdir()  # a checkpoint written as a plain directory before: replaced too
    save_checkpoint(link, _state(1))
    first = link.resolve()
    save_checkpoint(link, _state(2))
    assert link.is_symlink() and load_checkpoint(link).step == 2
    assert not first.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-")] == [
        link.resolve().name]


def test_a_save_killed_halfway_leaves_the_link_on_the_previous_checkpoint(tmp_path):
    link = tmp_path / "checkpoint"
    save_checkpoint(link, _state(1))
    code = ("import sys, torch; from pathlib import Path; from serve_app.trainer.checkpoint import CheckpointState, "
            "save_checkpoint; save_checkpoint(Path(sys.argv[1]), CheckpointState(step=2, policy_version=2, "
            "trainable={'a': torch.zeros(2)}, optimizer={}))")
    env = {**os.environ, "FLOWGRPO_CRASH_AT": "checkpoint@1"}
    done = subprocess.run([sys.executable, "-c", code, str(link)], env=env, cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert load_checkpoint(link).step == 1
    half = [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint-step00000002")]
    assert len(half) == 1 and not (half[0] / "state.json").exists()  # killed before it was whole
    save_checkpoint(link, _state(3))  # the next save clears it
    assert not half[0].exists() and load_checkpoint(link).step == 3


def test_a_crash_setting_no_point_matches_fails_at_start(monkeypatch):
    for spec in ("publish", "publish@x", "publishing@3"):
        monkeypatch.setenv("FLOWGRPO_CRASH_AT", spec)
        with pytest.raises(ValueError, match="FLOWGRPO_CRASH_AT"):
            check_crash_env()
    monkeypatch.setenv("FLOWGRPO_CRASH_AT", "update@0")
    check_crash_env()


def test_the_pipeline_sends_the_recorded_rollouts_again_first_and_records_them(tmp_path):
    sent = []

    def request(index, version):
        sent.append((index, version))
        return f"batch {index}"

    pipeline = RolloutPipeline(request, max_staleness=2, first_index=4, resent=[(4, 1), (5, 2)])
    assert pipeline.in_flight() == [(4, 1), (5, 2)]  # a checkpoint taken now records them again
    delivered = pipeline.take(3)
    pipeline.prefill(3)
    assert (delivered.index, delivered.version, delivered.batch) == (4, 1, "batch 4")
    assert pipeline.in_flight() == [(5, 2), (6, 3)]
    pipeline.close()
    assert sorted(sent) == [(4, 1), (5, 2), (6, 3)]
    with pytest.raises(ValueError, match="do not follow rollout 3"):
        RolloutPipeline(request, max_staleness=1, first_index=4, resent=[(5, 1)])
