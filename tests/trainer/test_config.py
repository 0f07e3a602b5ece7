"""Trainer configs fail on bad keys and values, naming them, before any cluster is touched."""

import pytest

from serve_app.config import ConfigError
from serve_app.trainer.__main__ import main
from serve_app.trainer.config import TrainerRunConfig, load_trainer_config


def test_default_trainer_config_composes_the_app_config():
    cfg = load_trainer_config()
    assert isinstance(cfg, TrainerRunConfig)
    assert cfg.app_name == "flowgrpo" and cfg.model.embedded == "tiny-qwen-image"
    assert cfg.trainer.lora.target_modules == ["proj_out", "norm_out.linear", "img_mod.1"]
    assert cfg.aggregator.advantage.clip == 5.0 and cfg.trainer.inner_epochs >= 1  # one advantage clip: the app's


def test_unknown_trainer_key_is_named():
    with pytest.raises(ConfigError, match="trainer.lrr"):
        load_trainer_config("trainer/flowgrpo", ["trainer.lrr=1e-3"])


def test_bad_value_is_named():
    with pytest.raises(ConfigError, match="clip_range"):
        load_trainer_config("trainer/flowgrpo", ["trainer.clip_range=-1"])
    with pytest.raises(ConfigError, match="prompts_per_step"):
        load_trainer_config("trainer/flowgrpo", ["trainer.prompts_per_step=9"])


def test_cli_rejects_the_config_before_ray_starts(monkeypatch, capsys):
    import ray

    def no_cluster(*args, **kwargs):
        raise AssertionError("ray.init must not run for an invalid config")

    monkeypatch.setattr(ray, "init", no_cluster)
    assert main(["--out", "/tmp/never", "trainer.group_sise=4"]) == 2
    assert "trainer.group_sise" in capsys.readouterr().err
