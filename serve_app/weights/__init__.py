"""Versioned policy weights: the trainer publishes, replicas fetch a version by number on demand.

- :mod:`~serve_app.weights.versions`: a version, its content hash, and what every store offers.
- :mod:`~serve_app.weights.filesystem`: versions in a folder every node sees (``weights.transport: filesystem``).
- :mod:`~serve_app.weights.registry`: versions in Ray's object store, owned by a named actor (``object_store``).
- :mod:`~serve_app.weights.replica`: what a replica holds, switched between versions and checked.

Both transports keep the last ``weights.keep_versions`` versions; a request pinned to an older one
gets a PolicyVersionError, like one pinned to a version never published.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.weights.filesystem import WeightStore
from serve_app.weights.versions import (
    BASE_HASH,
    LoraSpec,
    VersionStore,
    WeightKind,
    WeightVersion,
    check_weights_hash,
    content_hash,
    missing_version,
)

if TYPE_CHECKING:
    from serve_app.config import RolloutConfig

__all__ = [
    "BASE_HASH", "LoraSpec", "VersionStore", "WeightKind", "WeightStore", "WeightVersion", "check_weights_hash",
    "content_hash", "missing_version", "model_identity", "open_weight_store", "weights_dir",
]


def model_identity(config: RolloutConfig) -> str:
    """A name for the base checkpoint: the embedded model's name, or a local directory's name and
    a hash of its absolute path."""
    if config.model.path is None:
        return config.model.embedded
    path = Path(config.model.path).expanduser().resolve()
    return f"{path.name}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def weights_dir(config: RolloutConfig) -> Path:
    """Where the trainer publishes and replicas read weight versions: per app and base model."""
    if config.replica.weights_dir:
        return Path(config.replica.weights_dir)
    from serve_app.models import flowgrpo_home

    return flowgrpo_home() / "weights" / config.app_name / model_identity(config)


def open_weight_store(config: RolloutConfig) -> VersionStore:
    """The store the trainer and every replica of this config share (`weights.transport`)."""
    if config.weights.transport == "object_store":
        from serve_app.weights.registry import RegistryStore  # imports Ray

        return RegistryStore(f"{config.app_name}/{model_identity(config)}", model=model_identity(config),
                             keep=config.weights.keep_versions)
    return WeightStore(weights_dir(config), model=model_identity(config), keep=config.weights.keep_versions)
