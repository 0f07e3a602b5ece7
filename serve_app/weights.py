"""Versioned policy weights: the trainer publishes, replicas fetch a version by number on demand.

Version 0 is the base checkpoint. Two transports keep versions v >= 1 (`weights.transport`):

- ``filesystem`` (:class:`WeightStore`): ``<root>/v{v:08d}/`` holds ``weights.safetensors`` (the
  LoRA tensors, or the whole transformer) and ``meta.json``, written under a temporary name and
  renamed into place, so a reader sees a version whole or not at all. Needs a folder every node sees.
- ``object_store`` (serve_app/weight_registry.py): tensors in Ray's object store, a named actor maps
  version -> object; no shared filesystem needed.

Both keep the last `weights.keep_versions` versions; a request pinned to an older one gets a
PolicyVersionError, like one pinned to a version never published.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import torch
from safetensors.torch import load_file, save_file

from serve_app.errors import PolicyVersionError

if TYPE_CHECKING:
    from peft import LoraConfig

    from serve_app.config import RolloutConfig

WeightKind = Literal["lora", "full"]


@dataclass(frozen=True)
class LoraSpec:
    """What a replica needs to build the same adapter the trainer trains."""

    rank: int
    alpha: float
    target_modules: list[str] = field(default_factory=list)

    def peft_config(self) -> LoraConfig:
        """The one LoraConfig both the trainer and the replicas build, so their adapters match key for key.
        peft's default init sets B = 0: a fresh adapter is a no-op."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules), init_lora_weights=True)


@dataclass(frozen=True)
class WeightVersion:
    version: int
    kind: WeightKind
    tensors: dict[str, torch.Tensor]
    lora: LoraSpec | None
    content_hash: str


# What version 0 (the base checkpoint, no published tensors) is stamped with.
BASE_HASH = "base"


def content_hash(tensors: dict[str, torch.Tensor], lora: LoraSpec | None) -> str:
    """sha256 of a version's content: each tensor's name, dtype, shape and bytes (in name order), and
    the LoRA spec. It names the weights themselves, whatever file or module layout holds them."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    digest.update(json.dumps(None if lora is None else asdict(lora), sort_keys=True).encode())
    return digest.hexdigest()


class VersionStore(Protocol):
    """Where published versions live; the trainer, the ingress, the replicas and the aggregator use it."""

    where: str  # for messages: which store this is

    def versions(self) -> list[int]: ...
    def latest_version(self) -> int: ...
    def publish(self, version: int, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                lora: LoraSpec | None = None) -> None: ...
    def load(self, version: int) -> WeightVersion: ...
    def published_hash(self, version: int) -> str: ...


def check_publishable(version: int, kind: WeightKind, lora: LoraSpec | None) -> None:
    if version < 1:
        raise ValueError(f"published versions start at 1 (0 is the base checkpoint); got {version}")
    if kind == "lora" and lora is None:
        raise ValueError("kind='lora' needs the LoraSpec the replicas should build")


def missing_version(version: int, kept: list[int]) -> PolicyVersionError:
    """The error for a version a store does not hold (never published, or evicted)."""
    held = f", {kept[0]}..{kept[-1]}" if kept else ""
    return PolicyVersionError(f"policy version {version} does not exist in the weight store; available: 0 (base){held}")


class WeightStore:
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

    def latest_version(self) -> int:
        """The newest published version, 0 (the base weights) when none was published."""
        kept = self.versions()
        return kept[-1] if kept else 0

    def publish(
        self, version: int, tensors: dict[str, torch.Tensor], *, kind: WeightKind, lora: LoraSpec | None = None
    ) -> None:
        check_publishable(version, kind, lora)
        target = self._dir(version)
        if target.exists():
            raise PolicyVersionError(f"version {version} is already published in {self.root}")
        staging = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))
        on_cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(on_cpu, staging / "weights.safetensors")
        meta = {
            "version": version, "kind": kind, "model": self.model, "lora": None if lora is None else asdict(lora),
            "content_hash": content_hash(on_cpu, lora),
        }
        (staging / "meta.json").write_text(json.dumps(meta))
        os.rename(staging, target)
        if self.keep is not None:
            for old in self.versions()[: -self.keep]:
                shutil.rmtree(self._dir(old), ignore_errors=True)

    def load(self, version: int) -> WeightVersion:
        meta = self._meta(version)
        lora = LoraSpec(**meta["lora"]) if meta["lora"] else None
        tensors = load_file(self._dir(version) / "weights.safetensors")
        return WeightVersion(version, meta["kind"], tensors, lora, meta["content_hash"])

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


def model_identity(config: "RolloutConfig") -> str:
    """A name for the base checkpoint: the embedded model's name, or a local directory's name and
    a hash of its absolute path."""
    if config.model.path is None:
        return config.model.embedded
    path = Path(config.model.path).expanduser().resolve()
    return f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def weights_dir(config: "RolloutConfig") -> Path:
    """Where the trainer publishes and replicas read weight versions: per app and base model."""
    if config.replica.weights_dir:
        return Path(config.replica.weights_dir)
    from serve_app.models import flowgrpo_home

    return flowgrpo_home() / "weights" / config.app_name / model_identity(config)


def open_weight_store(config: "RolloutConfig") -> VersionStore:
    """The store the trainer and every replica of this config share (`weights.transport`)."""
    if config.weights.transport == "object_store":
        from serve_app.weight_registry import RegistryStore

        return RegistryStore(f"{config.app_name}/{model_identity(config)}", model=model_identity(config),
                             keep=config.weights.keep_versions)
    return WeightStore(weights_dir(config), model=model_identity(config), keep=config.weights.keep_versions)
