"""Weight versions in a folder every node sees (``weights.transport: filesystem``).

``<root>/v{v:08d}/`` holds ``weights.safetensors`` (the LoRA tensors, or the whole transformer) and
``meta.json``, written under a temporary name and renamed into place, so a reader sees a version
whole or not at all.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import load_file, save_file

from serve_app.errors import PolicyVersionError
from serve_app.api import VersionInfo
from serve_app.weights.versions import (
    BASE_HASH,
    BASE_VERSION,
    LoraSpec,
    VersionStore,
    WeightKind,
    WeightVersion,
    check_publishable,
    content_hash,
    missing_version,
    tensor_bytes,
)


class WeightStore(VersionStore):
    """Versions in `root` (the filesystem transport). With `model` set, every version records the
    model it was trained from and loading one published for another model fails, instead of silently
    serving foreign weights. Keeps the last `keep` versions (None: all)."""

    def __init__(self, root: str | Path, *, model: str | None = None, keep: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.keep = keep
        self.where = str(self.root)

    def _dir(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v[0-9]*") if p.is_dir())

    def publish_next(self, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                     lora: LoraSpec | None = None) -> tuple[int, str]:
        # One publisher at a time between reading the newest version and renaming the next into place.
        with FileLock(self.root / ".publish.lock"):
            version = self.latest_version() + 1
            return version, self.publish(version, tensors, kind=kind, lora=lora)

    def publish(
        self, version: int, tensors: dict[str, torch.Tensor], *, kind: WeightKind, lora: LoraSpec | None = None
    ) -> str:
        check_publishable(version, kind, lora)
        target = self._dir(version)
        if target.exists():
            raise PolicyVersionError(f"version {version} is already published in {self.root}")
        staging = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))
        on_cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(on_cpu, staging / "weights.safetensors")
        meta = {
            "version": version, "kind": kind, "model": self.model, "lora": None if lora is None else asdict(lora),
            "content_hash": content_hash(on_cpu, lora), "tensors": len(on_cpu), "bytes": tensor_bytes(on_cpu),
        }
        (staging / "meta.json").write_text(json.dumps(meta))
        try:
            os.rename(staging, target)  # fails where another publisher renamed its version into place first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            raise PolicyVersionError(f"version {version} is already published in {self.root}") from None
        if self.keep is not None:
            for old in self.versions()[: -self.keep]:
                shutil.rmtree(self._dir(old), ignore_errors=True)
        return meta["content_hash"]

    def load(self, version: int) -> WeightVersion:
        meta = self._meta(version)
        lora = LoraSpec(**meta["lora"]) if meta["lora"] else None
        tensors = load_file(self._dir(version) / "weights.safetensors")
        return WeightVersion(version, meta["kind"], tensors, lora, meta["content_hash"])

    def describe(self, version: int) -> VersionInfo:
        if version == 0:
            return BASE_VERSION
        meta = self._meta(version)
        return VersionInfo(policy_version=version, weights_hash=meta["content_hash"], kind=meta["kind"],
                           tensors=meta["tensors"], bytes=meta["bytes"], lora=meta["lora"])

    def published_hash(self, version: int) -> str:
        """The content hash recorded when `version` was published (BASE_HASH for version 0)."""
        return BASE_HASH if version == 0 else self._meta(version)["content_hash"]

    def _meta(self, version: int) -> dict:
        directory = self._dir(version)
        if version < 1 or not (directory / "meta.json").is_file():
            raise missing_version(version, self.versions())
        meta = json.loads((directory / "meta.json").read_text())
        published_for = meta.get("model")
        if self.model is not None and published_for is not None and published_for != self.model:
            raise PolicyVersionError(
                f"policy version {version} was published for model {published_for!r}, not {self.model!r}; "
                "point replica.weights_dir at that model's versions"
            )
        return meta
