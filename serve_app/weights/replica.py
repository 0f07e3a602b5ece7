"""The weights a replica holds: moving its transformer between published versions, and proving what
it then holds.

A weight sync that silently does nothing - an adapter bound to no module, tensors never loaded - is
the costliest failure in the field: hours of training against the base weights. So after every
switch the replica reads the tensors back from its modules (not from the file) and compares them
with the published ones; a difference is a WeightMismatchError naming the version, this replica and
what differs, and a trajectory is stamped with the content hash only of weights checked this way.
"""

from __future__ import annotations

import os

import torch

from serve_app.errors import PolicyVersionError, WeightMismatchError
from serve_app.policies.base import DiffusionPolicy
from serve_app.weights.versions import (
    ADAPTER, BASE_HASH, LoraSpec, VersionStore, WeightVersion, adapter_name, by_expert, content_hash, expert_key,
)


def replica_name() -> str:
    """This Serve replica's id, or the process id outside Serve (for error messages)."""
    try:  # a policy's versions also switch where Ray is not installed (benchmarks/gpu_rollout.py)
        from ray import serve
        from ray.serve.exceptions import RayServeException
    except ImportError:
        return f"process {os.getpid()}"
    try:
        return serve.get_replica_context().replica_tag
    except RayServeException:
        return f"process {os.getpid()}"


def held_tensors(experts: dict[str, torch.nn.Module], weights: WeightVersion) -> dict[str, torch.Tensor]:
    """What the modules hold under the published tensors' names (expert prefixes included): each targeted
    expert's adapter state (LoRA) or state dict (full)."""
    held = {}
    for expert, published in by_expert(weights.tensors).items():
        module = experts.get(expert)
        if module is None:
            continue
        if weights.kind == "full":
            state = module.state_dict()
        else:
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(module, adapter_name=adapter_name(expert))
        held.update({expert_key(expert, name): state[name] for name in published if name in state})
    return held


def check_held(experts: dict[str, torch.nn.Module], weights: WeightVersion, *, replica: str) -> str:
    """Compare what the experts' modules hold with the published tensors; return the content hash to stamp.

    Each tensor is compared at the precision the module holds it in (a bf16 transformer holds the
    published values rounded), and the hash is recomputed from the modules when they hold the
    published dtypes: over every expert the version targets.

    Raises:
        WeightMismatchError: a published tensor is missing from the modules or holds other values.
    """
    held = held_tensors(experts, weights)
    bound = [
        name for name, published in weights.tensors.items()
        if name in held and torch.equal(held[name].detach().cpu(), published.to(held[name].dtype))
    ]
    what = "adapter" if weights.kind == "lora" else "transformer"
    if len(bound) != len(weights.tensors):
        missing = sorted(set(weights.tensors) - set(bound))
        raise WeightMismatchError(
            f"replica {replica} at policy version {weights.version}: {len(bound)} of {len(weights.tensors)} "
            f"{what} tensors bound to the published values (first differing: {missing[:3]})"
        )
    if all(held[name].dtype == weights.tensors[name].dtype for name in held):
        recomputed = content_hash(held, weights.lora)
        if recomputed != weights.content_hash:
            raise WeightMismatchError(
                f"replica {replica} at policy version {weights.version}: the {what} holds content "
                f"{recomputed[:12]}, the version was published as {weights.content_hash[:12]}"
            )
    return weights.content_hash


class PolicyVersions:
    """Moves a policy's experts (its transformer; Wan2.2-A14B's two) between weight versions (LoRA adapters
    or full state dicts) and keeps the content hash of what they hold (`current_hash`). An expert a version
    holds no tensors of is at the base weights while that version is loaded."""

    ADAPTER = ADAPTER

    def __init__(self, policy: DiffusionPolicy, store: VersionStore | None) -> None:
        self.policy = policy
        self.store = store
        self.current = 0
        self.current_hash = BASE_HASH
        self._base_state: dict[str, dict[str, torch.Tensor]] = {}  # expert -> its base state dict
        self._adapter_spec: dict[str, LoraSpec] = {}  # expert -> the spec of the adapter it has
        self._holds_full: set[str] = set()  # experts whose weights are a full version's, not the base's

    def ensure(self, version: int) -> None:
        if version == self.current:
            return
        experts = self.policy.experts
        if version == 0:
            for expert, module in experts.items():
                self._to_base(expert, module)
            self.current, self.current_hash = 0, BASE_HASH
            return
        if self.store is None:
            raise PolicyVersionError(f"policy version {version} asked for, but this replica has no weight store")
        weights = self.store.load(version)
        parts = by_expert(weights.tensors)
        unknown = sorted(set(parts) - set(experts))
        if unknown:
            raise WeightMismatchError(f"replica {replica_name()} at policy version {weights.version}: the version "
                                      f"has tensors of {unknown}, which this model lacks (it has {list(experts)})")
        for expert, module in experts.items():
            if expert in parts:
                self._apply(expert, module, weights, parts[expert])
            else:
                self._to_base(expert, module)
        # A failed check leaves current at its old value: the next request for `version` tries again.
        self.current_hash = check_held(experts, weights, replica=replica_name())
        self.current = version

    def _to_base(self, expert: str, module: torch.nn.Module) -> None:
        if getattr(module, "peft_config", None):
            module.disable_adapters()
        self._restore_base_weights(expert, module)

    def _restore_base_weights(self, expert: str, module: torch.nn.Module) -> None:
        """The base weights back in place of a full version's: a LoRA version applies to the base."""
        if expert in self._holds_full:
            module.load_state_dict(self._base_state[expert])
            self._holds_full.discard(expert)

    def _apply(self, expert: str, module: torch.nn.Module, weights: WeightVersion,
               tensors: dict[str, torch.Tensor]) -> None:
        if weights.kind == "full":
            if expert not in self._base_state:  # keep the base to return to version 0
                self._base_state[expert] = {k: v.detach().clone() for k, v in module.state_dict().items()}
            module.load_state_dict(tensors)
            self._holds_full.add(expert)
            return
        from peft import set_peft_model_state_dict

        assert weights.lora is not None
        self._restore_base_weights(expert, module)
        adapter = adapter_name(expert)
        if self._adapter_spec.get(expert) != weights.lora:
            # Checked before peft sees the spec: a failed add_adapter leaves the model half-configured.
            if not any(_is_target(name, weights.lora.target_modules) for name, _ in module.named_modules()):
                raise WeightMismatchError(
                    f"replica {replica_name()} at policy version {weights.version}: 0 of {len(weights.tensors)} "
                    f"adapter tensors bound (target modules {weights.lora.target_modules} match no module)"
                )
            # A version with another rank or other targets needs an adapter of its own shape.
            if adapter in (getattr(module, "peft_config", None) or {}):
                module.delete_adapters(adapter)
            module.add_adapter(weights.lora.peft_config(), adapter_name=adapter)
            self._adapter_spec[expert] = weights.lora
        result = set_peft_model_state_dict(module, tensors, adapter_name=adapter)
        if getattr(result, "unexpected_keys", None):
            raise WeightMismatchError(
                f"replica {replica_name()} at policy version {weights.version}: LoRA tensors that fit no module "
                f"of its adapter: {result.unexpected_keys[:3]}"
            )
        module.set_adapter(adapter)
        module.enable_adapters()


def _is_target(module_name: str, targets: list[str]) -> bool:
    """peft's rule for a list of target modules: the name, or its last dotted parts, equals a target."""
    return any(module_name == target or module_name.endswith(f".{target}") for target in targets)
