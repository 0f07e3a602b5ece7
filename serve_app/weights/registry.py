"""Weight versions in Ray's object store: no shared filesystem between trainer and replicas.

The trainer hands a version's tensors to a small named actor, the `WeightRegistry`, which puts them
into the object store itself: Ray frees an object when its owner dies, and the registry, not the
trainer, must own them so that they outlive the trainer process. It maps version -> (object, content
hash, kind, LoRA spec). A replica on any node asks the registry for a version by
number and fetches the object (from the local object store when it is on its node). The registry
keeps the last `keep` versions; dropping a version's entry frees its object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import ray
import torch

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

NAMESPACE = "flowgrpo"


@dataclass(frozen=True)
class RegistryEntry:
    version: int
    kind: WeightKind
    lora: LoraSpec | None
    content_hash: str
    model: str | None
    # In a list: Ray would otherwise resolve a top-level ObjectRef argument to its value.
    tensors_ref: list[ray.ObjectRef]
    tensors: int = 0  # how many, and their bytes (GET /v1/weights/{version})
    bytes: int = 0


class WeightRegistry:
    """version -> RegistryEntry, the last `keep` of them (a plain class; the actor wraps it)."""

    def __init__(self, keep: int | None) -> None:
        self.keep = keep
        self.entries: dict[int, RegistryEntry] = {}
        self.newest = 0

    def register(self, entry: RegistryEntry) -> None:
        if entry.version in self.entries:
            raise PolicyVersionError(f"version {entry.version} is already published in the weight registry")
        self.entries[entry.version] = entry
        # The next number is after every one ever published, evicted ones included.
        self.newest = max(self.newest, entry.version)
        if self.keep is not None:
            for old in sorted(self.entries)[: -self.keep]:
                del self.entries[old]

    def versions(self) -> list[int]:
        return sorted(self.entries)

    def entry(self, version: int) -> RegistryEntry:
        if version not in self.entries:
            raise missing_version(version, self.versions())
        return self.entries[version]


@ray.remote(num_cpus=0, max_restarts=0)
class WeightRegistryActor(WeightRegistry):
    def publish(self, entry: RegistryEntry, tensors: dict[str, torch.Tensor]) -> None:
        # Put here, not in the publisher: the putting process owns the object (Ray 2.56 removed
        # `ray.put(_owner=...)`), and this one lives as long as the registry.
        self.register(replace(entry, tensors_ref=[ray.put(tensors)]))

    def publish_next(self, entry: RegistryEntry, tensors: dict[str, torch.Tensor]) -> int:
        # The actor runs one call at a time: numbering and registering cannot interleave with another's.
        version = self.newest + 1
        self.publish(replace(entry, version=version), tensors)
        return version


class RegistryStore(VersionStore):
    """The VersionStore over a named WeightRegistry actor, created on first use by whoever needs it.

    `name` scopes the registry (app and base model); `model` is recorded with every version and a
    version published for another model is refused, as with the filesystem store.
    """

    def __init__(self, name: str, *, model: str | None, keep: int | None) -> None:
        self.name = f"weights/{name}"
        self.model = model
        self.where = f"the weight registry {self.name!r} (Ray object store)"
        # Detached: versions outlive the trainer that published them; the cluster's end ends them.
        # On the head node: Ray would otherwise place it beside its first caller (often a replica on a
        # worker node), and losing that node would lose every published version with it.
        self.registry = WeightRegistryActor.options(
            name=self.name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            resources={"node:__internal_head__": 0.001},
        ).remote(keep)

    def versions(self) -> list[int]:
        return ray.get(self.registry.versions.remote())

    def publish(self, version: int, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                lora: LoraSpec | None = None) -> str:
        check_publishable(version, kind, lora)
        entry, on_cpu = self._entry_of(version, tensors, kind, lora)
        ray.get(self.registry.publish.remote(entry, on_cpu))
        return entry.content_hash

    def publish_next(self, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                     lora: LoraSpec | None = None) -> tuple[int, str]:
        check_publishable(1, kind, lora)
        entry, on_cpu = self._entry_of(0, tensors, kind, lora)
        return ray.get(self.registry.publish_next.remote(entry, on_cpu)), entry.content_hash

    def _entry_of(self, version: int, tensors: dict[str, torch.Tensor], kind: WeightKind,
                  lora: LoraSpec | None) -> tuple[RegistryEntry, dict[str, torch.Tensor]]:
        on_cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        entry = RegistryEntry(version, kind, lora, content_hash(on_cpu, lora), self.model, tensors_ref=[],
                              tensors=len(on_cpu), bytes=tensor_bytes(on_cpu))
        return entry, on_cpu

    def describe(self, version: int) -> VersionInfo:
        if version == 0:
            return BASE_VERSION
        entry = self._entry(version)
        return VersionInfo(policy_version=version, weights_hash=entry.content_hash, kind=entry.kind,
                           tensors=entry.tensors, bytes=entry.bytes, lora=None if entry.lora is None else asdict(entry.lora))

    def load(self, version: int) -> WeightVersion:
        entry = self._entry(version)
        return WeightVersion(version, entry.kind, ray.get(entry.tensors_ref[0]), entry.lora, entry.content_hash)

    def published_hash(self, version: int) -> str:
        return BASE_HASH if version == 0 else self._entry(version).content_hash

    def _entry(self, version: int) -> RegistryEntry:
        entry = ray.get(self.registry.entry.remote(version))
        if self.model is not None and entry.model is not None and entry.model != self.model:
            raise PolicyVersionError(
                f"policy version {version} was published for model {entry.model!r}, not {self.model!r}"
            )
        return entry
