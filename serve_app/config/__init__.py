"""The rollout service's settings: the typed schema (every setting's one home and default) and its
loading from the YAML files under ``configs/`` (Hydra composes, pydantic validates). The sampling settings
(:mod:`~serve_app.config.sampling`) import nothing else, so that the sampler and a Ray-free client read them
without Hydra: this package's names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    **dict.fromkeys(("ConfigError", "config_to_yaml", "default_config_dir"), "serve_app.config.loader"),
    **dict.fromkeys(("AdvantageConfig", "AggregatorConfig", "AutoscalingConfig", "IngressConfig", "ModelConfig",
                     "ReplicaConfig", "RewardConfig", "RolloutConfig", "Section", "ValidationConfig", "WeightsConfig",
                     "load_config"), "serve_app.config.schema"),
    **dict.fromkeys(("SamplingOverrides", "SamplingParams"), "serve_app.config.sampling"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'serve_app.config' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
