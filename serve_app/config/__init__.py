"""The rollout service's settings: the typed schema (every setting's one home and default) and its
loading from the YAML files under ``configs/`` (Hydra composes, pydantic validates)."""

from serve_app.config.loader import ConfigError, config_to_yaml, default_config_dir
from serve_app.config.schema import (
    AdvantageConfig,
    AggregatorConfig,
    AutoscalingConfig,
    IngressConfig,
    ModelConfig,
    ReplicaConfig,
    RewardConfig,
    RolloutConfig,
    Section,
    ValidationConfig,
    WeightsConfig,
    load_config,
)

__all__ = [
    "AdvantageConfig",
    "AggregatorConfig",
    "AutoscalingConfig",
    "ConfigError",
    "IngressConfig",
    "ModelConfig",
    "ReplicaConfig",
    "RewardConfig",
    "RolloutConfig",
    "Section",
    "ValidationConfig",
    "WeightsConfig",
    "config_to_yaml",
    "default_config_dir",
    "load_config",
]
