"""What a published weight version is, how its content is named, and what every store of versions offers.

Version 0 is the base checkpoint. The trainer publishes versions v >= 1 (LoRA tensors or a whole
transformer) to a store; replicas fetch a version by number and stamp every trajectory with the
content hash of the weights they checked they hold.

A model with several experts (Wan2.2-A14B: ``transformer`` and ``transformer_2``) keeps them apart by
name: the primary ``transformer``'s tensors carry their own names (as for every one-transformer
family), another expert's carry its component name as a prefix (``transformer_2.blocks.0...``). A
version holds the tensors of the experts it targets, one or several; the content hash covers them all.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from serve_app.errors import PolicyVersionError, WeightMismatchError
from serve_app.policies.base import PRIMARY_EXPERT  # unprefixed tensor names are its
from serve_app.api import VersionInfo
from serve_app.schemas import BASE_HASH, ChunkHeader, Trajectory
from serve_app.wire.weights import content_hash  # a version's name; clients compute it too

if TYPE_CHECKING:
    from peft import LoraConfig

__all__ = [
    "ADAPTER", "BASE_HASH", "BASE_VERSION", "PRIMARY_EXPERT", "LoraSpec", "VersionStore", "WeightKind", "WeightVersion", "adapter_name",
    "by_expert", "check_publishable", "check_weights_hash", "expert_key",
    "content_hash", "missing_version",
]

WeightKind = Literal["lora", "full"]

# The adapter name the trainer trains under and every replica loads a LoRA version under.
ADAPTER = "flowgrpo"


def adapter_name(expert: str) -> str:
    """The peft adapter name of `expert`'s LoRA: ``flowgrpo`` on the primary transformer, ``flowgrpo_<expert>``
    on another, so two experts' adapters never share a name (in peft or in a pipeline's adapter list)."""
    return ADAPTER if expert == PRIMARY_EXPERT else f"{ADAPTER}_{expert}"


def expert_key(expert: str, name: str) -> str:
    """A version's name for `expert`'s tensor `name` (the primary's unprefixed)."""
    return name if expert == PRIMARY_EXPERT else f"{expert}.{name}"


def by_expert(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """A version's tensors split per expert (names as the expert's module has them), only the experts the
    version holds tensors of: a name prefixed ``transformer_<n>.`` is that expert's, any other the primary's."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _EXPERT_PREFIX.match(key)
        expert, name = (match.group(1), key[match.end():]) if match else (PRIMARY_EXPERT, key)
        parts.setdefault(expert, {})[name] = tensor
    return parts


_EXPERT_PREFIX = re.compile(r"(transformer_\d+)\.")


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


class VersionStore(abc.ABC):
    """Where published versions live; the trainer, the ingress, the replicas and the aggregator use it."""

    where: str  # for messages: which store this is

    @abc.abstractmethod
    def versions(self) -> list[int]:
        """The published versions still kept, oldest first."""

    @abc.abstractmethod
    def publish(self, version: int, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                lora: LoraSpec | None = None) -> str:
        """Store `tensors` as `version` (never published before); returns its content hash.

        Raises:
            PolicyVersionError: `version` is already published.
        """

    @abc.abstractmethod
    def publish_next(self, tensors: dict[str, torch.Tensor], *, kind: WeightKind,
                     lora: LoraSpec | None = None) -> tuple[int, str]:
        """Store `tensors` as the version after the newest, atomically: publishers at once get distinct
        versions, in the order they were stored. Returns (version, content hash)."""

    @abc.abstractmethod
    def load(self, version: int) -> WeightVersion: ...

    @abc.abstractmethod
    def published_hash(self, version: int) -> str:
        """The content hash recorded when `version` was published (BASE_HASH for version 0)."""

    @abc.abstractmethod
    def describe(self, version: int) -> VersionInfo:
        """What `version` holds (its hash, kind, tensor count and bytes); version 0 is the base checkpoint.

        Raises:
            PolicyVersionError: the store does not hold `version`.
        """

    def latest_version(self) -> int:
        """The newest published version, 0 (the base weights) when none was published."""
        kept = self.versions()
        return kept[-1] if kept else 0


BASE_VERSION = VersionInfo(policy_version=0, weights_hash=BASE_HASH, kind="base", tensors=0, bytes=0)


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_publishable(version: int, kind: WeightKind, lora: LoraSpec | None) -> None:
    if version < 1:
        raise ValueError(f"published versions start at 1 (0 is the base checkpoint); got {version}")
    if kind == "lora" and lora is None:
        raise ValueError("kind='lora' needs the LoraSpec the replicas should build")


def missing_version(version: int, kept: list[int]) -> PolicyVersionError:
    """The error for a version a store does not hold (never published, or evicted)."""
    held = f", {kept[0]}..{kept[-1]}" if kept else ""
    return PolicyVersionError(f"policy version {version} does not exist; available: 0 (base){held}")


def check_weights_hash(trajectory: Trajectory | ChunkHeader, store: VersionStore) -> None:
    """Raise WeightMismatchError unless the stamp of a trajectory (or of a chunk's header) is the content hash
    published for its version (`store`: anything with published_hash, e.g. the trainer's HTTP publisher)."""
    published = store.published_hash(trajectory.policy_version)
    if trajectory.weights_hash != published:
        raise WeightMismatchError(
            f"policy version {trajectory.policy_version} was sampled with weights {trajectory.weights_hash[:12]}, "
            f"but was published as {published[:12]}: the replicas hold other weights under that version "
            "(another weight store, or a version changed after publishing)"
        )
