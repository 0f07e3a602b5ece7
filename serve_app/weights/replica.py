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
from serve_app.weights.versions import ADAPTER, BASE_HASH, LoraSpec, VersionStore, WeightVersion, content_hash


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


def held_tensors(transformer: torch.nn.Module, weights: WeightVersion) -> dict[str, torch.Tensor]:
    """What the modules hold under the published tensors' names: the adapter's state (LoRA) or the
    transformer's state dict (full)."""
    if weights.kind == "full":
        state = transformer.state_dict()
    else:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(transformer, adapter_name=ADAPTER)
    return {name: state[name] for name in weights.tensors if name in state}


def check_held(transformer: torch.nn.Module, weights: WeightVersion, *, replica: str) -> str:
    """Compare what the modules hold with the published tensors; return the content hash to stamp.

    Each tensor is compared at the precision the module holds it in (a bf16 transformer holds the
    published values rounded), and the hash is recomputed from the modules when they hold the
    published dtypes.

    Raises:
        WeightMismatchError: a published tensor is missing from the modules or holds other values.
    """
    held = held_tensors(transformer, weights)
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
    """Moves a policy's transformer between weight versions (LoRA adapters or full state dicts) and
    keeps the content hash of what it holds (`current_hash`)."""

    ADAPTER = ADAPTER

    def __init__(self, policy: DiffusionPolicy, store: VersionStore | None) -> None:
        self.policy = policy
        self.store = store
        self.current = 0
        self.current_hash = BASE_HASH
        self._base_state: dict[str, torch.Tensor] | None = None
        self._adapter_spec: LoraSpec | None = None

    def ensure(self, version: int) -> None:
        if version == self.current:
            return
        transformer = self.policy.transformer
        if version == 0:
            self._to_base(transformer)
            self.current, self.current_hash = 0, BASE_HASH
            return
        if self.store is None:
            raise PolicyVersionError(f"policy version {version} asked for, but this replica has no weight store")
        weights = self.store.load(version)
        self._apply(transformer, weights)
        # A failed check leaves current at its old value: the next request for `version` tries again.
        self.current_hash = check_held(transformer, weights, replica=replica_name())
        self.current = version

    def _to_base(self, transformer: torch.nn.Module) -> None:
        if getattr(transformer, "peft_config", None):
            transformer.disable_adapters()
        if self._base_state is not None:
            transformer.load_state_dict(self._base_state)

    def _apply(self, transformer: torch.nn.Module, weights: WeightVersion) -> None:
        if weights.kind == "full":
            if self._base_state is None:  # keep the base to return to version 0
                self._base_state = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
            transformer.load_state_dict(weights.tensors)
            return
        from peft import set_peft_model_state_dict

        assert weights.lora is not None
        if self._adapter_spec != weights.lora:
            # Checked before peft sees the spec: a failed add_adapter leaves the model half-configured.
            if not any(_is_target(name, weights.lora.target_modules) for name, _ in transformer.named_modules()):
                raise WeightMismatchError(
                    f"replica {replica_name()} at policy version {weights.version}: 0 of {len(weights.tensors)} "
                    f"adapter tensors bound (target modules {weights.lora.target_modules} match no module)"
                )
            # A version with another rank or other targets needs an adapter of its own shape.
            if ADAPTER in (getattr(transformer, "peft_config", None) or {}):
                transformer.delete_adapters(ADAPTER)
            transformer.add_adapter(weights.lora.peft_config(), adapter_name=ADAPTER)
            self._adapter_spec = weights.lora
        result = set_peft_model_state_dict(transformer, weights.tensors, adapter_name=ADAPTER)
        if getattr(result, "unexpected_keys", None):
            raise WeightMismatchError(
                f"replica {replica_name()} at policy version {weights.version}: LoRA tensors that fit no module "
                f"of its adapter: {result.unexpected_keys[:3]}"
            )
        transformer.set_adapter(ADAPTER)
        transformer.enable_adapters()


def _is_target(module_name: str, targets: list[str]) -> bool:
    """peft's rule for a list of target modules: the name, or its last dotted parts, equals a target."""
    return any(module_name == target or module_name.endswith(f".{target}") for target in targets)
