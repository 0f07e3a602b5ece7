"""A weight version as one container (serve_app.wire.container), for `POST /v1/weights`, and the content
hash that names a version's weights.

Tensors: the version's, by the names the replicas install them under (a LoRA adapter's peft keys, or the
transformer's state dict; another expert's prefixed with its component name, ``transformer_2.``). The
metadata document: ``{"format": "flowgrpo.weights/1", "kind": "lora" | "full", "lora": {"rank", "alpha",
"target_modules"} (LoRA only), "weights_hash": the content hash the sender expects (optional)}``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from serve_app.wire.container import WireFormatError, pack, unpack

WEIGHTS_MEDIA_TYPE = "application/vnd.flowgrpo.weights+safetensors"
FORMAT = "flowgrpo.weights/1"
Kind = Literal["lora", "full"]


def content_hash(tensors: Mapping[str, torch.Tensor], lora: Any) -> str:
    """sha256 of a version's content: each tensor's name, dtype, shape and bytes (in name order), then the
    LoRA spec as sorted-key JSON (``null`` for a full version). `lora`: None, a mapping or a dataclass
    (serve_app.weights.LoraSpec) with rank, alpha and target_modules. It names the weights themselves,
    whatever file or module layout holds them; docs/http.md states it for clients in other languages."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    spec = dataclasses.asdict(lora) if dataclasses.is_dataclass(lora) else lora
    digest.update(json.dumps(None if spec is None else dict(spec), sort_keys=True).encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class WeightUpload:
    """A decoded upload: the tensors (views of the body), their kind, the LoRA spec (normalised:
    rank int, alpha float, target_modules a list of str) and the hash the sender expects, if it sent one."""

    tensors: dict[str, torch.Tensor]
    kind: Kind
    lora: dict[str, Any] | None
    expected_hash: str | None


def lora_fields(lora: Any) -> dict[str, Any]:
    """A LoRA spec (mapping or dataclass) as the hash and the replicas read it: exactly rank (int >= 1),
    alpha (float > 0) and target_modules (a non-empty list of str).

    Raises:
        WireFormatError: a field is missing, extra or of the wrong type.
    """
    spec = dataclasses.asdict(lora) if dataclasses.is_dataclass(lora) else lora
    if not isinstance(spec, Mapping) or set(spec) != {"rank", "alpha", "target_modules"}:
        raise WireFormatError(f"lora must have exactly rank, alpha and target_modules; got {spec!r}")
    rank, alpha, targets = spec["rank"], spec["alpha"], spec["target_modules"]
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise WireFormatError(f"lora.rank must be an integer >= 1; got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise WireFormatError(f"lora.alpha must be a finite number > 0; got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise WireFormatError(f"lora.target_modules must be a non-empty list of module names; got {targets!r}")
    return {"rank": rank, "alpha": float(alpha), "target_modules": list(targets)}


def encode_weights(tensors: Mapping[str, torch.Tensor], *, kind: Kind, lora: Any = None,
                   expected_hash: str | None = None) -> bytearray:
    """The upload body of a version (`lora`: its spec, for kind "lora")."""
    spec = lora_fields(lora) if kind == "lora" else None
    return pack(tensors, {"format": FORMAT, "kind": kind, "lora": spec, "weights_hash": expected_hash})


def decode_weights(buffer: bytes | bytearray | memoryview) -> WeightUpload:
    """The upload a body holds.

    Raises:
        WireFormatError: not a container, not this format, no tensors, or metadata of the wrong shape.
    """
    tensors, meta = unpack(buffer)
    if meta.get("format") != FORMAT:
        raise WireFormatError(f"the safetensors metadata must hold a {FORMAT} document under __metadata__['flowgrpo'] "
                              f"(format {meta.get('format')!r})")
    unknown = sorted(set(meta) - {"format", "kind", "lora", "weights_hash"})
    if unknown:
        raise WireFormatError(f"unknown metadata fields {unknown}")
    kind = meta.get("kind")
    if kind not in ("lora", "full"):
        raise WireFormatError(f"kind must be 'lora' or 'full'; got {kind!r}")
    if kind == "full" and meta.get("lora") is not None:
        raise WireFormatError("a full version has no lora spec")
    expected = meta.get("weights_hash")
    if expected is not None and not isinstance(expected, str):
        raise WireFormatError(f"weights_hash must be a string; got {expected!r}")
    if not tensors:
        raise WireFormatError("the upload holds no tensors")
    spec = lora_fields(meta.get("lora")) if kind == "lora" else None
    return WeightUpload(tensors, kind, spec, expected)
