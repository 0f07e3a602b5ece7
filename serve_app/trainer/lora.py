"""What the trainer trains: a peft LoRA adapter named like the replicas' one, or the whole transformer -
on each expert `trainer.lora.experts` names (Wan2.2-A14B: `transformer` and/or `transformer_2`; every
other family has the one `transformer`).

The adapter is added with `expert.add_adapter(..., adapter_name=adapter_name(expert))` (diffusers'
PeftAdapterMixin; "flowgrpo" on the transformer, "flowgrpo_transformer_2" on the low-noise expert)
exactly as :class:`serve_app.weights.replica.PolicyVersions` does on a replica, so the keys of
`get_peft_model_state_dict` (another expert's prefixed with its name) load there unchanged. peft's
default init sets B = 0: a fresh adapter is a no-op and the trainer's weights at version 0 equal the
base checkpoint's. Experts not named stay frozen at their base weights.

It also keeps the trainable tensors of the last few published versions (`keep_version`), so that a batch
sampled a few updates ago is replayed with the weights that sampled it (`at_version`): only the trainable
tensors move (for LoRA a few MB), never the frozen transformer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from serve_app.policies.base import DiffusionPolicy
from serve_app.trainer.config import LoraSection
from serve_app.weights.versions import LoraSpec, WeightKind, adapter_name, expert_key


class TrainableTransformer:
    """Owns the trainable part of a policy's experts, the reference policy for the KL term and the
    trainable tensors of the last `keep_versions` published versions."""

    def __init__(self, policy: DiffusionPolicy, lora: LoraSection, *, keep_versions: int = 0) -> None:
        if keep_versions < 0:
            raise ValueError(f"keep_versions must be >= 0; got {keep_versions}")
        self.policy = policy
        self.lora = lora
        self.keep_versions = keep_versions
        self._versions: dict[int, dict[str, torch.Tensor]] = {}  # oldest first
        self.experts = trained_experts(policy, lora)
        for module in policy.experts.values():
            module.requires_grad_(False)
        self._reference: dict[str, torch.nn.Module] = {}
        for expert, module in self.experts.items():
            if lora.enabled:
                module.add_adapter(self.spec.peft_config(), adapter_name=adapter_name(expert))
                module.set_adapter(adapter_name(expert))
            else:
                self._reference[expert] = copy.deepcopy(module).eval()
                module.requires_grad_(True)
        self.named = self.trainable_parameters()
        if not self.named:
            raise ValueError(f"no trainable parameters: lora.target_modules {lora.target_modules} matched nothing")

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trainable parameters by the names a version gives them (another expert's prefixed)."""
        return {expert_key(expert, n): p for expert, module in self.experts.items()
                for n, p in module.named_parameters() if p.requires_grad}

    @property
    def kind(self) -> WeightKind:
        return "lora" if self.lora.enabled else "full"

    @property
    def spec(self) -> LoraSpec | None:
        if not self.lora.enabled:
            return None
        return LoraSpec(rank=self.lora.rank, alpha=self.lora.alpha, target_modules=list(self.lora.target_modules))

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.named.values())

    def publishable_state(self) -> dict[str, torch.Tensor]:
        """The tensors a replica installs for a version (peft keys for LoRA, the state dict otherwise), of
        every trained expert."""
        state = {}
        for expert, module in self.experts.items():
            if self.lora.enabled:
                from peft import get_peft_model_state_dict

                own = get_peft_model_state_dict(module, adapter_name=adapter_name(expert))
            else:
                own = module.state_dict()
            state.update({expert_key(expert, k): v.detach().cpu().clone() for k, v in own.items()})
        return state

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Trainable parameters by their module names (what a checkpoint stores)."""
        return {n: p.detach().cpu().clone() for n, p in self.named.items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self.named) - set(state))
        extra = sorted(set(state) - set(self.named))
        if missing or extra:
            raise ValueError(f"checkpoint does not fit the trainable parameters: missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for name, param in self.named.items():
                param.copy_(state[name].to(param.device, param.dtype))

    def keep_version(self, version: int) -> None:
        """Keep the trainable tensors as they are now as `version`'s (on the CPU; under fsdp this rank's shards),
        for `at_version`; only the newest `keep_versions` versions stay (none when it is 0)."""
        if not self.keep_versions:
            return
        self._versions[version] = self.local_state()
        while len(self._versions) > self.keep_versions:
            del self._versions[next(iter(self._versions))]

    @property
    def kept_versions(self) -> list[int]:
        return list(self._versions)

    @contextlib.contextmanager
    def at_version(self, version: int) -> Iterator[None]:
        """The trainable tensors of a kept `version` in place of the current ones, which are put back on exit.
        Copies only the trainable tensors (the adapter), under no grad; the optimizer state is untouched.

        Raises:
            KeyError: `version` is not among the kept ones.
        """
        with self.holding(self.version_state(version)):
            yield

    def version_state(self, version: int) -> dict[str, torch.Tensor]:
        """The kept trainable tensors of `version` (this rank's, on the CPU).

        Raises:
            KeyError: `version` is not among the kept ones.
        """
        if version not in self._versions:
            raise KeyError(f"the trainer kept no weights of policy version {version} (it keeps {self.kept_versions}: "
                           "the last trainer.max_staleness + 1 versions it published)")
        return self._versions[version]

    @contextlib.contextmanager
    def holding(self, state: dict[str, torch.Tensor]) -> Iterator[None]:
        """`state` (this rank's trainable tensors, as `version_state` gives them) in place of the current tensors,
        which are put back on exit; under no grad, the optimizer state untouched."""
        current = self.local_state()
        self._load_local(state)
        try:
            yield
        finally:
            self._load_local(current)

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's trainable tensors as they are now (copies on the CPU; under fsdp its shards), in
        `version_state`'s form."""
        return {n: _local(p).detach().to("cpu", copy=True) for n, p in self.named.items()}

    @torch.no_grad()
    def _load_local(self, state: dict[str, torch.Tensor]) -> None:
        for name, param in self.named.items():
            _local(param).copy_(state[name])
        # fsdp: a forward without backward leaves the root's parameters gathered, and a gathered copy is what the
        # next forward would use; resharding drops it, so the next forward gathers the tensors just copied.
        from torch.distributed.fsdp import FSDPModule

        for expert in self.experts.values():
            for module in expert.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    @contextlib.contextmanager
    def reference(self) -> Iterator[None]:
        """The frozen base policy for the KL term: adapters off (LoRA) or the frozen copies swapped in."""
        if self.lora.enabled:
            for module in self.experts.values():
                module.disable_adapters()
            try:
                yield
            finally:
                for expert, module in self.experts.items():
                    module.enable_adapters()
                    module.set_adapter(adapter_name(expert))
        else:
            pipeline = self.policy.pipeline
            for expert in self.experts:
                setattr(pipeline, expert, self._reference[expert])
            try:
                yield
            finally:
                for expert, module in self.experts.items():
                    setattr(pipeline, expert, module)


def trained_experts(policy: DiffusionPolicy, lora: LoraSection) -> dict[str, torch.nn.Module]:
    """The experts `lora.experts` names (None: every expert of the policy), in the policy's order.

    Raises:
        ValueError: a named expert is not in the checkpoint (the message lists the ones it has).
    """
    available = policy.experts
    if lora.experts is None:
        return dict(available)
    missing = [e for e in lora.experts if e not in available]
    if missing:
        raise ValueError(f"trainer.lora.experts names {missing}, which this {policy.family} checkpoint lacks; "
                         f"it has {list(available)}")
    return {name: module for name, module in available.items() if name in lora.experts}


def _local(param: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of a parameter: its shard of an fsdp DTensor (a view, under no grad), or itself."""
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param
