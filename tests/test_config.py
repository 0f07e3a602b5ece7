"""Loading configs/: defaults inheritance, groups, overrides, and errors that name the culprit."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field

from serve_app.config.schema import VIDEO_FAMILIES
from serve_app.config import (
    ConfigError,
    ReplicaConfig,
    RewardConfig,
    RolloutConfig,
    config_to_yaml,
    default_config_dir,
    load_config,
)
from serve_app.rewards import RewardSpec, declared_input


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


BASE = """
reward:
  components: [{name: brightness}]
sampling:
  num_steps: 10
"""


# --------------------------------------------------------------------------------------------
# The shipped configs


def test_the_base_config_is_the_schema_defaults_and_a_reward():
    expected = RolloutConfig(reward=RewardConfig(components=[RewardSpec(name="brightness", args={"target": 0.8})]))
    assert load_config("rollout") == expected


# Keys a model group file states even at their default value: they say which checkpoint it is.
IDENTITY_KEYS = {("model", "family"), ("model", "embedded")}


def _field_default(model: type[BaseModel], key: str) -> tuple[bool, Any, type[BaseModel] | None]:
    """(whether `key` has a plain default, that default, the section or list-item model it holds)."""
    field = model.model_fields[key]
    annotation = field.annotation
    item = typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation
    section = item if isinstance(item, type) and issubclass(item, BaseModel) else None
    if field.is_required() or (section is not None and typing.get_origin(annotation) is not list):
        return False, None, section
    return True, field.get_default(call_default_factory=True), section


def _restated(data: Any, model: type[BaseModel], path: tuple) -> list[tuple[tuple, Any]]:
    """(path, value) of every leaf of `data` equal to the schema default at its path."""
    found = []
    for key, value in data.items():
        if key == "defaults" or key not in model.model_fields:
            continue
        plain, default, section = _field_default(model, key)
        here = (*path, key)
        if section is not None and isinstance(value, dict):
            found += _restated(value, section, here)
        elif section is not None and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found += _restated(item, section, (*here, i))
        elif plain and _same(value, default):
            found.append((here, value))
    return found


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, BaseModel):
        default = default.model_dump()
    if isinstance(default, tuple):
        default = list(default)
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    if isinstance(value, (int, float)) and isinstance(default, (int, float)):
        return float(value) == float(default)
    return value == default


def _config_files() -> list[tuple[str, Path]]:
    root = default_config_dir()
    return [(str(p.relative_to(root).with_suffix("")), p) for p in sorted(root.rglob("*.yaml"))
            if p.relative_to(root).parts[0] not in ("shapes", "motion")]  # pretraining configs: tests/*/test_pretrain


@pytest.mark.parametrize(("name", "path"), _config_files(), ids=[n for n, _ in _config_files()])
def test_a_config_file_states_only_what_differs_from_the_schema(name, path):
    """Every default has one home, the schema: a file that restated one would hold a second copy that
    drifts. A value equal to the default is allowed only where a file merged before it set another."""
    from serve_app.config.loader import _compose

    from serve_app.trainer.config import TrainerRunConfig

    group = name.split("/")[0] if name.split("/")[0] in ("model", "reward") else None
    schema = TrainerRunConfig if name.startswith("trainer/") else RolloutConfig
    data = yaml.safe_load(path.read_text()) or {}
    earlier: list[tuple[Path, str]] = []
    root = default_config_dir()
    if name.startswith("algorithm/"):
        # A preset merges after the trainer config that selects it: what any of them set before it counts.
        for trainer in sorted((root / "trainer").glob("*.yaml")):
            _, sources = _compose(f"trainer/{trainer.stem}", root, root, [f"algorithm={path.stem}"], name)
            earlier += sources[: [s for s, _ in sources].index(path)]
    elif group is None:
        _, sources = _compose(name, root, root, [], name)
        earlier = sources[: [s for s, _ in sources].index(path)]
    restated = [(p, v) for p, v in _restated({group: data} if group else data, schema, ())
                if p[:2] not in IDENTITY_KEYS and not _set_before(p, earlier)]
    assert restated == [], f"{path} restates schema defaults: " + ", ".join(
        f"{'.'.join(map(str, p))} = {v!r}" for p, v in restated)


def _set_before(path: tuple, earlier: list[tuple[Path, str]]) -> bool:
    """Whether a file merged earlier sets `path` (then restating the default there undoes it)."""
    for file, package in earlier:
        data: Any = yaml.safe_load(file.read_text()) or {}
        for part in [p for p in package.split(".") if p]:
            data = {part: data}
        for key in path:
            if isinstance(data, dict) and key in data:
                data = data[key]
            elif isinstance(data, list) and isinstance(key, int) and key < len(data):
                data = data[key]
            else:
                break
        else:
            return True
    return False


def test_diffusion_rollout_inherits_and_overrides():
    cfg = load_config("diffusion_rollout")
    assert cfg.sampling.noise_level == 1.2  # the schema's default, through rollout.yaml
    assert cfg.sampling.sde_window_range == (0, 5)
    assert cfg.replica.autoscaling.downscale_delay_s == 60
    assert cfg.ingress.chunk_size == 4  # diffusion_rollout overrides the schema's 8
    assert cfg.replica.max_batch_size == 2  # ... and its 4
    assert cfg.model.embedded == "tiny-qwen-image"  # group model/tiny_qwen_image
    assert [c.name for c in cfg.reward.components] == ["brightness"]  # group reward/brightness


def test_dotlist_overrides():
    cfg = load_config(
        "diffusion_rollout",
        ["sampling.num_steps=12", "replica.autoscaling.max_replicas=3", "sampling.sde_window_range=[1,3]"],
    )
    assert cfg.sampling.num_steps == 12
    assert cfg.sampling.sde_window_range == (1, 3)
    assert cfg.replica.autoscaling.max_replicas == 3
    assert cfg.replica.autoscaling.min_replicas == 1  # siblings kept


def test_group_override_replaces_section():
    cfg = load_config("diffusion_rollout", ["model.dtype=float16", "model=tiny_sd3", "reward=brightness_and_jpeg"])
    assert (cfg.model.family, cfg.model.embedded) == ("sd3", "tiny-sd3")
    assert cfg.model.dtype == "float16"  # value overrides apply after group selections, whatever the order
    assert [(c.name, c.weight) for c in cfg.reward.components] == [("brightness", 1.0), ("jpeg_compressibility", 2.0)]


def test_gpu_rollout():
    cfg = load_config("gpu_rollout")
    assert cfg.replica.num_gpus == 1
    assert (cfg.sampling.height, cfg.sampling.width, cfg.sampling.num_steps) == (512, 512, 10)
    assert cfg.replica.autoscaling.max_replicas == 8
    assert (cfg.ingress.chunk_size, cfg.replica.max_batch_size) == (16, 2)
    assert (cfg.model.family, cfg.model.dtype, cfg.model.device) == ("qwen_image", "bfloat16", "cuda")
    assert cfg.model.path is not None
    assert cfg.sampling.noise_level == 1.2  # still inherited from rollout.yaml


def test_every_group_file_loads():
    # Each with a partner of its kind: a video model with a video reward, a video reward with a video model.
    configs = Path(__file__).resolve().parents[1] / "configs"
    for path in sorted((configs / "model").glob("*.yaml")):
        video = yaml.safe_load(path.read_text())["family"] in VIDEO_FAMILIES
        load_config("diffusion_rollout", [f"model={path.stem}", *(["reward=video_brightness"] if video else [])])
    for path in sorted((configs / "reward").glob("*.yaml")):
        names = [c["name"] for c in yaml.safe_load(path.read_text())["components"]]
        video = "videos" in {declared_input(name) for name in names}
        load_config("diffusion_rollout", [f"reward={path.stem}", *(["model=tiny_wan"] if video else [])])


def test_config_to_yaml_round_trips(tmp_path):
    cfg = load_config("diffusion_rollout", ["model=tiny_sd3"])
    path = write(tmp_path, "resolved.yaml", config_to_yaml(cfg))
    assert load_config(str(path)) == cfg


def test_env_config_dir(tmp_path, monkeypatch):
    write(tmp_path, "diffusion_rollout.yaml", BASE + "app_name: from-env\n")
    monkeypatch.setenv("FLOWGRPO_CONFIG_DIR", str(tmp_path))
    assert load_config().app_name == "from-env"


# --------------------------------------------------------------------------------------------
# Composition rules, on temporary config dirs


def test_self_position_and_override_of_a_group_selection(tmp_path):
    write(tmp_path, "base.yaml", BASE + "app_name: base\n")
    write(tmp_path, "model/a.yaml", "embedded: a\ndtype: float16\n")
    write(tmp_path, "model/b.yaml", "embedded: b\n")
    write(tmp_path, "mid.yaml", "defaults: [base, {model: a}, _self_]\napp_name: mid\n")
    # _self_ first: the defaults after it win over this file's own keys; `override` replaces a selection.
    write(tmp_path, "top.yaml", "defaults: [_self_, mid, {override model: b}]\napp_name: top\n")
    cfg = load_config("top", config_dir=tmp_path)
    assert cfg.app_name == "mid"
    assert cfg.model.embedded == "b"
    assert cfg.model.dtype == "float32"  # b replaced a; a's dtype does not leak through


def test_a_second_selection_of_a_group_needs_override(tmp_path):
    write(tmp_path, "base.yaml", "defaults: [{model: a}]\n" + BASE)
    write(tmp_path, "model/a.yaml", "embedded: a\n")
    write(tmp_path, "top.yaml", "defaults: [base, {model: a}]\n")
    with pytest.raises(ConfigError, match="model appears more than once"):
        load_config("top", config_dir=tmp_path)


def test_subfolder_config_is_global_and_resolves_absolute_defaults(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    write(tmp_path, "trainer/run.yaml", "# @package _global_\ndefaults: [/base]\napp_name: run\n")
    cfg = load_config("trainer/run", config_dir=tmp_path)
    assert (cfg.app_name, cfg.sampling.num_steps) == ("run", 10)


def test_subclass_schema_adds_a_section(tmp_path):
    class TrainerSection(BaseModel):
        model_config = ConfigDict(extra="forbid")
        lr: float = Field(1e-4, description="Learning rate.")
        epochs: int = Field(1, description="Epochs.")

    class TrainerRunConfig(RolloutConfig):
        trainer: TrainerSection = Field(default_factory=TrainerSection, description="Trainer.")

    write(tmp_path, "base.yaml", BASE)
    write(tmp_path, "trainer/flowgrpo.yaml", "# @package _global_\ndefaults: [/base]\ntrainer:\n  lr: 3.0e-4\n")
    cfg = load_config("trainer/flowgrpo", ["trainer.epochs=2"], config_dir=tmp_path, schema=TrainerRunConfig)
    assert isinstance(cfg, TrainerRunConfig)
    assert (cfg.trainer.lr, cfg.trainer.epochs, cfg.sampling.num_steps) == (3e-4, 2, 10)
    with pytest.raises(ConfigError, match="trainer.lrr"):
        load_config("trainer/flowgrpo", ["trainer.lrr=1"], config_dir=tmp_path, schema=TrainerRunConfig)
    with pytest.raises(ConfigError, match="unknown key 'trainer' in .*trainer/flowgrpo.yaml"):
        load_config("trainer/flowgrpo", config_dir=tmp_path)  # the plain schema has no trainer section


# --------------------------------------------------------------------------------------------
# Errors


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    bad = write(tmp_path, "bad.yaml", "defaults: [base]\nsampling:\n  nosie_level: 0.5\n")
    write(tmp_path, "base.yaml", BASE)
    with pytest.raises(ConfigError) as info:
        load_config("bad", config_dir=tmp_path)
    msg = str(info.value)
    assert "'sampling.nosie_level'" in msg and str(bad) in msg
    assert "noise_level" in msg  # lists the known keys


def test_unknown_key_in_group_file_names_its_path(tmp_path):
    write(tmp_path, "base.yaml", "defaults: [{model: x}]\n" + BASE)
    bad = write(tmp_path, "model/x.yaml", "familly: sd3\n")
    with pytest.raises(ConfigError, match="'model.familly'") as info:
        load_config("base", config_dir=tmp_path)
    assert str(bad) in str(info.value)


def test_unknown_top_level_key_in_shipped_dir():
    with pytest.raises(ConfigError, match=r"unknown key 'samplng' in override 'samplng.num_steps=4'"):
        load_config("diffusion_rollout", ["samplng.num_steps=4"])


def test_unknown_override_key():
    with pytest.raises(ConfigError) as info:
        load_config("diffusion_rollout", ["replica.autoscaling.max_replica=3"])
    msg = str(info.value)
    assert "'replica.autoscaling.max_replica'" in msg and "override 'replica.autoscaling.max_replica=3'" in msg
    assert "max_replicas" in msg


def test_bad_value_names_field_path():
    with pytest.raises(ConfigError, match=r"sampling\.num_steps: .*integer") as info:
        load_config("diffusion_rollout", ["sampling.num_steps=many"])
    assert "diffusion_rollout" in str(info.value)


def test_cross_field_validators():
    with pytest.raises(ConfigError, match=r"replica: .*max_ongoing_requests"):
        load_config("diffusion_rollout", ["replica.max_batch_size=16"])
    with pytest.raises(ConfigError, match=r"autoscaling: .*initial_replicas"):
        load_config("diffusion_rollout", ["replica.autoscaling.initial_replicas=5"])
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        load_config("diffusion_rollout", ["reward.components.0.name=nope"])
    with pytest.raises(ValueError, match="max_batch_size"):
        ReplicaConfig(max_batch_size=9)


def test_missing_default_file_is_named(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    write(tmp_path, "top.yaml", "defaults: [bsae]\n")
    with pytest.raises(ConfigError, match=r"In 'top': Could not load 'bsae'"):
        load_config("top", config_dir=tmp_path)


def test_missing_group_option_lists_options():
    with pytest.raises(ConfigError, match=r"Could not find 'model/tiny_sdxl'(.|\n)*tiny_qwen_image(.|\n)*tiny_sd3"):
        load_config("diffusion_rollout", ["model=tiny_sdxl"])


def test_missing_config_name_lists_available():
    with pytest.raises(ConfigError, match=r"config 'nope' not found.*diffusion_rollout"):
        load_config("nope")


def test_cycle_in_defaults(tmp_path):
    write(tmp_path, "a.yaml", "defaults: [b]\n")
    write(tmp_path, "b.yaml", "defaults: [a]\n")
    with pytest.raises(ConfigError, match="cycle in the defaults"):
        load_config("a", config_dir=tmp_path)


@pytest.mark.parametrize(
    "text, match",
    [
        ("defaults: [{model: [a]}]\n", "Could not load 'model/a'"),
        ("defaults: [_self_, _self_]\n", "Duplicate _self_"),
        ("defaults: base\n", "defaults must be a list"),
        ("- a\n- b\n", "must be a DictConfig"),
        ("sampling: 3\n", r"sampling: Input should be a valid dictionary"),
        ("sampling: {height: [1\n", "expected ',' or ']'"),
    ],
)
def test_malformed_files(tmp_path, text, match):
    write(tmp_path, "c.yaml", text)
    with pytest.raises(ConfigError, match=match):
        load_config("c", config_dir=tmp_path)


def test_malformed_override():
    with pytest.raises(ConfigError, match="key=value"):
        load_config("diffusion_rollout", ["sampling.num_steps"])
    with pytest.raises(ConfigError, match="has no group files"):
        load_config("diffusion_rollout", ["replica=big"])
    with pytest.raises(ConfigError, match="sampling.sde_window_range"):
        load_config("diffusion_rollout", ["sampling.sde_window_range=[0,"])


def test_override_of_a_key_no_file_sets():
    # The schema, not the files, says which keys exist: a default-only key takes a plain override.
    cfg = load_config("diffusion_rollout", ["model.components={vae: my.module:MyVAE}"])
    assert cfg.model.components == {"vae": "my.module:MyVAE"}


def test_vllm_omni_backend_fails_at_validation():
    with pytest.raises(ConfigError, match="replica.backend: the vllm_omni backend is not implemented"):
        load_config("diffusion_rollout", ["replica.backend=vllm_omni"])


def test_the_config_command_prints_every_setting_resolved(capsys):
    from serve_app.config.__main__ import main

    assert main(["shapes_rollout", "sampling.num_steps=12"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["sampling"]["num_steps"] == 12 and printed["sampling"]["noise_level"] == 0.7
    # Defaults no file states are printed too.
    assert printed["replica"]["health_check_timeout_s"] == 30 and printed["ingress"]["chunk_retry"]["attempts"] == 3
    assert main(["trainer/shapes"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["steps"] == 400
    assert main(["shapes_rollout", "sampling.num_stepz=1"]) == 2
    assert "unknown key 'sampling.num_stepz'" in capsys.readouterr().err


def test_a_reward_that_cannot_take_the_familys_samples_fails_the_config_naming_the_fix():
    # An image reward on a video family: every request would fail at scoring after a fine-looking deploy.
    with pytest.raises(ConfigError, match=r"'brightness' scores images, but model family 'wan' samples videos: "
                                          r"score each frame with \{name: frames.*reward=video_brightness"):
        load_config("diffusion_rollout", ["model=tiny_wan"])
    with pytest.raises(ConfigError, match="motion_strict' scores videos, but model family 'qwen_image' samples images"):
        load_config("diffusion_rollout", ["reward=motion"])
    # What the message proposes works, and rewards that take either pass with both.
    load_config("diffusion_rollout", ["model=tiny_wan", "reward=video_brightness"])
    frames = "reward.components=[{name: frames, args: {reward: brightness, reduce: mean, target: 0.5}}]"
    assert load_config("diffusion_rollout", ["model=tiny_wan", frames]).reward.components[0].name == "frames"
    remote = "reward.components=[{name: remote_score, args: {url: 'http://127.0.0.1:9/score'}}]"
    load_config("diffusion_rollout", ["model=tiny_wan", remote])
    load_config("diffusion_rollout", [remote])
