"""Checkpoints: what a resumed run needs to be the run it would have been.

`outputs/<run>/checkpoint` is a link to the newest whole checkpoint directory. A checkpoint is written into
a directory of its own and the link is then replaced in one rename, so a trainer killed at any instant
(even inside a save) leaves the link on a whole checkpoint: the previous one, or the new one.

A checkpoint directory holds:

    trainable.safetensors   the trained tensors (whole ones on every data-parallel strategy)
    optimizer.pt            AdamW's state (torch.save)
    ema.pt                  the EMA's state, with trainer.ema_decay
    kept.safetensors        the tensors of the older versions rollouts in flight were pinned to, as
                            "<version>:<name>": the mismatch check replays a batch with its own version's
                            (with DiffusionNFT's soft-updated sampling policy, the current version's too)
    rng.pt                  torch's and Python's global generator states
    state.json              step, policy_version, in_flight [[rollout index, version], ...] (the rollouts
                            sent and not yet trained on: a resumed run sends them again as they were),
                            policy_versions (the published versions from the oldest one in flight on: a
                            batch's staleness counts them), dropped_batches, app_name, kind
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from serve_app.trainer.faults import crash_point


@dataclass(frozen=True)
class CheckpointState:
    step: int  # steps done
    policy_version: int  # the version the trainable tensors were published as
    trainable: dict[str, torch.Tensor]
    optimizer: dict
    ema: dict | None = None
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    in_flight: tuple[tuple[int, int], ...] = ()
    policy_versions: tuple[int, ...] = ()
    dropped_batches: int = 0
    rng: dict | None = None


def generator_states() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def restore_generators(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])


def save_checkpoint(link: Path, state: CheckpointState, *, extra: dict | None = None) -> Path:
    """Write `state` into a new directory beside `link` and point `link` at it; returns `link`."""
    parent = link.parent
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix=f".{link.name}-step{state.step:08d}-", dir=parent))
    save_file({k: v.contiguous() for k, v in state.trainable.items()}, directory / "trainable.safetensors")
    torch.save(state.optimizer, directory / "optimizer.pt")
    if state.ema is not None:
        torch.save(state.ema, directory / "ema.pt")
    kept = {f"{version}:{name}": t.contiguous() for version, tensors in state.kept.items() for name, t in tensors.items()}
    save_file(kept, directory / "kept.safetensors")
    torch.save(state.rng if state.rng is not None else generator_states(), directory / "rng.pt")
    crash_point("checkpoint", state.step - 1)
    (directory / "state.json").write_text(json.dumps({
        "step": state.step, "policy_version": state.policy_version,
        "in_flight": [list(pair) for pair in state.in_flight], "policy_versions": list(state.policy_versions),
        "dropped_batches": state.dropped_batches, **(extra or {}),
    }))
    _point(link, directory)
    for other in parent.glob(f".{link.name}-*"):
        if other != directory:
            shutil.rmtree(other, ignore_errors=True)
    return link


def _point(link: Path, directory: Path) -> None:
    """Make `link` name `directory`, in one rename (a link's rename replaces the old link, never half of it)."""
    if link.is_dir() and not link.is_symlink():  # a checkpoint written as a plain directory: moved aside first
        os.rename(link, link.with_name(f".{link.name}-plain"))
    staged = link.with_name(f".{link.name}.link-{os.getpid()}")
    staged.unlink(missing_ok=True)
    staged.symlink_to(directory.name)
    os.replace(staged, link)


def load_checkpoint(directory: str | Path) -> CheckpointState:
    directory = Path(directory)
    state_file = directory / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint (no state.json); pass outputs/<run>/checkpoint")
    state = json.loads(state_file.read_text())
    kept: dict[int, dict[str, torch.Tensor]] = {}
    if (directory / "kept.safetensors").is_file():
        for key, tensor in load_file(directory / "kept.safetensors").items():
            version, _, name = key.partition(":")
            kept.setdefault(int(version), {})[name] = tensor
    return CheckpointState(
        step=int(state["step"]),
        policy_version=int(state["policy_version"]),
        trainable=load_file(directory / "trainable.safetensors"),
        optimizer=torch.load(directory / "optimizer.pt", weights_only=True),
        ema=torch.load(directory / "ema.pt", weights_only=True) if (directory / "ema.pt").is_file() else None,
        kept=dict(sorted(kept.items())),
        in_flight=tuple((int(i), int(v)) for i, v in state.get("in_flight", [])),
        policy_versions=tuple(int(v) for v in state.get("policy_versions", [])),
        dropped_batches=int(state.get("dropped_batches", 0)),
        rng=torch.load(directory / "rng.pt", weights_only=True) if (directory / "rng.pt").is_file() else None,
    )
