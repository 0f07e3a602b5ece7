"""Model-family adapters over diffusers pipelines, chosen by name or by the pipeline directory."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from serve_app.families import FAMILIES
from serve_app.families import family as family_row
from serve_app.imports import import_object
from serve_app.policies.base import DiffusionPolicy, PolicySettings, TextProcessor

if TYPE_CHECKING:  # the config's loader pulls Hydra; a policy alone (benchmarks/gpu_rollout.py) needs none of it
    from serve_app.config import ModelConfig

__all__ = [
    "DiffusionPolicy",
    "PolicySettings",
    "TextProcessor",
    "SUPPORTED_FAMILIES",
    "policy_class",
    "detect_family",
    "load_policy",
    "load_text_processor",
    "model_dir",
    "load_configured_policy",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SUPPORTED_FAMILIES = tuple(FAMILIES)


def policy_class(family: str) -> type[DiffusionPolicy]:
    """The policy class of `family`'s row (imported on first use: each pulls its own diffusers pipeline module).

    Raises:
        ValueError: an unknown family (the message lists the supported ones).
    """
    return import_object(family_row(family).policy, what=f"the {family} policy")


def detect_family(local_dir: str | Path) -> str:
    """The family of a diffusers pipeline directory, from its model_index.json."""
    index_file = Path(local_dir) / "model_index.json"
    if not index_file.is_file():
        found = sorted(p.name for p in Path(local_dir).iterdir())[:10] if Path(local_dir).is_dir() else "nothing"
        raise ValueError(
            f"{local_dir} is not a diffusers pipeline directory (no model_index.json; found: {found}); "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    class_name = json.loads(index_file.read_text()).get("_class_name")
    for name, row in FAMILIES.items():
        if class_name in row.pipelines:
            return name
    raise ValueError(
        f"{local_dir} holds a {class_name!r} pipeline; supported families: "
        + ", ".join(f"{name} ({'/'.join(row.pipelines)})" for name, row in FAMILIES.items())
    )


def load_policy(
    local_dir: str | Path,
    *,
    family: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    components: Mapping[str, str] | None = None,
    settings: PolicySettings | None = None,
) -> DiffusionPolicy:
    """Load a pipeline directory; `family` is checked against what the directory holds, `components`
    name the classes of components diffusers does not know (DiffusionPolicy.from_pretrained), `settings`
    are the model config's settings of the policy."""
    found = _checked_family(local_dir, family)
    return policy_class(found).from_pretrained(local_dir, device=device, dtype=dtype, components=components,
                                               settings=settings)


def load_text_processor(local_dir: str | Path, *, family: str | None = None) -> TextProcessor:
    """The tokenizer side only (no model weights, no pipeline code): what the ingress needs."""
    found = _checked_family(local_dir, family)
    processor: type[TextProcessor] = import_object(family_row(found).text_processor, what=f"the {found} text processor")
    return processor.load(local_dir)


def _checked_family(local_dir: str | Path, family: str | None) -> str:
    """The directory's family, after checking that an asked-for `family` exists and matches it."""
    if family is not None:
        family_row(family)  # an unknown name gets the list of supported ones
    found = detect_family(local_dir)
    if family is not None and family != found:
        raise ValueError(
            f"{local_dir} holds a {found} pipeline ({'/'.join(FAMILIES[found].pipelines)}), "
            f"but family {family!r} was asked for"
        )
    return found


def model_dir(model: ModelConfig) -> Path:
    """The pipeline directory a model config names: its local path, or the embedded checkpoint (built once)."""
    if model.path is not None:
        return Path(model.path).expanduser()
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model(model.embedded)


def load_configured_policy(model: ModelConfig) -> DiffusionPolicy:
    """What the replicas and the trainer both load, so their weights at version 0 are the same (eager:
    the sampling engine compiles its own copy when `model.compile` says so)."""
    device = model.device if model.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    settings = PolicySettings(distilled_guidance=model.distilled_guidance, input_image_area=model.input_image_area,
                              condition_image_area=model.condition_image_area)
    return load_policy(model_dir(model), family=model.family, device=device, dtype=_DTYPES[model.dtype],
                       components=model.components, settings=settings)
