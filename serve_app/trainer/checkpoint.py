"""Checkpoints: trainable tensors (safetensors), optimizer and EMA state (torch.save), a json of step/version.

A checkpoint directory is written under a temporary name and renamed over the old one, so a crash
(or a diverged step, which never reaches here) leaves the previous checkpoint whole.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class CheckpointState:
    step: int
    policy_version: int
    trainable: dict[str, torch.Tensor]
    optimizer: dict
    ema: dict | None = None


def save_checkpoint(directory: Path, *, step: int, policy_version: int, trainable: dict[str, torch.Tensor],
                    optimizer: dict, ema: dict | None = None, extra: dict | None = None) -> Path:
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    save_file({k: v.contiguous() for k, v in trainable.items()}, staging / "trainable.safetensors")
    torch.save(optimizer, staging / "optimizer.pt")
    if ema is not None:
        torch.save(ema, staging / "ema.pt")
    (staging / "state.json").write_text(json.dumps({"step": step, "policy_version": policy_version, **(extra or {})}))
    if directory.exists():
        old = directory.with_name(f".{directory.name}-old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
        os.rename(staging, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, directory)
    return directory


def load_checkpoint(directory: str | Path) -> CheckpointState:
    directory = Path(directory)
    state_file = directory / "state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint (no state.json); pass outputs/<run>/checkpoint")
    state = json.loads(state_file.read_text())
    return CheckpointState(
        step=int(state["step"]),
        policy_version=int(state["policy_version"]),
        trainable=load_file(directory / "trainable.safetensors"),
        optimizer=torch.load(directory / "optimizer.pt", weights_only=True),
        ema=torch.load(directory / "ema.pt", weights_only=True) if (directory / "ema.pt").is_file() else None,
    )
