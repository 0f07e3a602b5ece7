"""Which tensors a weight version of the served model holds: names and shapes, for checking a version that
arrives from outside (POST /v1/weights) before it is stored, rather than when a replica fails to load it.

A full version holds an expert's whole state dict; a LoRA version, for every Linear layer its target modules
name, peft's ``<module>.lora_A.weight`` [rank, in_features] and ``<module>.lora_B.weight`` [out_features, rank]
(what the trainer publishes and a replica installs). Names follow serve_app.weights.versions: the primary
expert's unprefixed, another expert's prefixed with its component name. A version may hold some experts only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from serve_app.errors import InvalidRequestError
from serve_app.weights.versions import LoraSpec, WeightKind, by_expert, expert_key

# Tensor dtypes a replica installs without loss of meaning (it casts to its own).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Layout = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class ModelLayout:
    """The served model's structure as loaded, before any version's adapter wraps its layers (taken when the
    replica loads the model): per expert, its state dict's shapes and its modules' kinds."""

    state: dict[str, Layout]  # expert -> {tensor name: shape}
    modules: dict[str, dict[str, str]]  # expert -> {module name: class name}
    linear: dict[str, dict[str, tuple[int, int]]]  # expert -> {Linear module name: (in_features, out_features)}

    @classmethod
    def of(cls, experts: Mapping[str, torch.nn.Module]) -> ModelLayout:
        state, modules, linear = {}, {}, {}
        for expert, module in experts.items():
            state[expert] = {name: tuple(t.shape) for name, t in module.state_dict().items()}
            modules[expert] = {name: type(layer).__name__ for name, layer in module.named_modules()}
            linear[expert] = {name: (layer.in_features, layer.out_features) for name, layer in module.named_modules()
                              if isinstance(layer, torch.nn.Linear)}
        return cls(state, modules, linear)

    def version(self, kind: WeightKind, lora: LoraSpec | None) -> Layout:
        """{tensor name: shape} of a version of every expert (a version holds the experts it targets).

        Raises:
            InvalidRequestError: a LoRA spec whose target modules name no layer, or one that is not Linear.
        """
        layout: Layout = {}
        for expert in self.state:
            own = self.state[expert] if kind == "full" else self._lora(expert, lora)
            layout.update({expert_key(expert, name): shape for name, shape in own.items()})
        if not layout:
            assert lora is not None
            raise InvalidRequestError(f"target modules {lora.target_modules} match no layer of the served model",
                                      "lora.target_modules")
        return layout

    def _lora(self, expert: str, lora: LoraSpec | None) -> Layout:
        if lora is None:
            raise InvalidRequestError("a LoRA version needs its lora spec (rank, alpha, target_modules)", "lora")
        layout: Layout = {}
        for name, kind in self.modules[expert].items():
            if not any(name == t or name.endswith(f".{t}") for t in lora.target_modules):  # peft's rule for a list
                continue
            if name not in self.linear[expert]:
                raise InvalidRequestError(f"target module {name!r} is a {kind}; LoRA versions here adapt Linear "
                                          "layers", "lora.target_modules")
            in_features, out_features = self.linear[expert][name]
            layout[f"{name}.lora_A.weight"] = (lora.rank, in_features)
            layout[f"{name}.lora_B.weight"] = (out_features, lora.rank)
        return layout


def check_against_layout(tensors: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Raise InvalidRequestError (field ``tensors``) unless `tensors` are a version of the experts they target:
    exactly the layout's names of each such expert, each of its shape, in a float dtype, finite."""
    expected = by_expert(layout)  # type: ignore[arg-type]  (it groups names; the values ride along)
    for expert, names in by_expert(dict(tensors)).items():
        if expert not in expected:
            raise InvalidRequestError(f"tensors of expert {expert!r}, which the served model lacks (it has "
                                      f"{sorted(expected)})", "tensors")
        wanted = {expert_key(expert, n) for n in expected[expert]}
        sent = {expert_key(expert, n) for n in names}
        missing, unknown = sorted(wanted - sent), sorted(sent - wanted)
        if unknown:
            raise InvalidRequestError(f"{len(unknown)} tensors the served model has no place for, e.g. {unknown[:3]}",
                                      "tensors")
        if missing:
            raise InvalidRequestError(f"{len(missing)} of {len(wanted)} tensors of expert {expert!r} missing, e.g. "
                                      f"{missing[:3]}", "tensors")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != layout[name]:
            raise InvalidRequestError(f"{name!r} has shape {list(tensor.shape)}; the served model's is "
                                      f"{list(layout[name])}", "tensors")
        if tensor.dtype not in WEIGHT_DTYPES:
            raise InvalidRequestError(f"{name!r} is {tensor.dtype}; versions hold "
                                      f"{', '.join(str(d) for d in WEIGHT_DTYPES)}", "tensors")
        if not bool(torch.isfinite(tensor).all()):
            raise InvalidRequestError(f"{name!r} holds NaN or infinite values", "tensors")
