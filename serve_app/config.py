"""Typed settings of the rollout service and their loader for the YAML files under ``configs/``.

The schema is a tree of pydantic models (``RolloutConfig`` at the root); the loader composes YAML
files Hydra-style and validates the result against it::

    cfg = load_config("diffusion_rollout", ["sampling.num_steps=4", "model=tiny_sd3"])

A file's ``defaults:`` list names what goes under it, in merge order (later wins, lists replace):

- ``rollout``               another config (``configs/rollout.yaml``), merged;
- ``{model: tiny_sd3}``     a group file (``configs/model/tiny_sd3.yaml``) holding the *content* of
                            section ``model``; it replaces that section, so there is one selection
                            per group and a later one does not inherit keys from an earlier one;
- ``_self_``                this file's own keys (implicitly last when not listed).

Every key of every file and override must exist in the schema; unknown keys are rejected before
merging, so the error names the file (or override) that holds the typo.
"""

from __future__ import annotations

import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .flowgrpo.advantages import StdMode
from .rewards import RewardSpec, registered_rewards
from .schemas import SamplingParams

# ---------------------------------------------------------------------------------------------
# Schema


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Section):
    """Which diffusion model the replicas load."""

    family: Literal["qwen_image", "sd3"] = Field("qwen_image", description="Model family (selects the policy adapter).")
    path: str | None = Field(
        None, description="Local diffusers pipeline directory; None uses the embedded checkpoint `embedded`."
    )
    embedded: str = Field(
        "tiny-qwen-image",
        description="Embedded checkpoint (serve_app.models.EMBEDDED_MODELS: random-weight miniatures, or the pretrained shapes-world model); used when path is None.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and compute dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' picks cuda when the replica has a GPU.")


class IngressConfig(_Section):
    """The HTTP/handle entry point: request limits and how requests are cut into chunks."""

    max_prompts: int = Field(64, ge=1, description="Most prompts (groups) in one request.")
    max_prompt_chars: int = Field(2000, ge=1, description="Longest accepted prompt, in characters.")
    max_group_size: int = Field(64, ge=1, description="Most samples per prompt.")
    max_samples: int = Field(1024, ge=1, description="Most prompts * group_size in one request; above: HTTP 413.")
    chunk_size: int = Field(8, ge=1, description="Samples per replica call; requests fan out in chunks of this size.")
    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved per ingress replica.")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests one ingress replica handles at once.")
    max_queued_requests: int = Field(128, ge=-1, description="Requests queued before HTTP 503; -1 = unbounded.")


class AutoscalingConfig(_Section):
    """Ray Serve autoscaling of the sampling replicas (field names as in Ray Serve's AutoscalingConfig)."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas kept running.")
    max_replicas: int = Field(2, ge=1, description="Most replicas autoscaling may start.")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time; None = min_replicas.")
    target_ongoing_requests: float = Field(2, gt=0, description="Ongoing chunk calls per replica autoscaling aims for.")
    upscale_delay_s: float = Field(5, ge=0, description="Seconds demand must stay high before scaling up.")
    downscale_delay_s: float = Field(60, ge=0, description="Seconds demand must stay low before scaling down.")
    look_back_period_s: float = Field(15, gt=0, description="Window over which ongoing requests are averaged.")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        initial = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"need min_replicas <= initial_replicas <= max_replicas; got {self.min_replicas}, "
                f"{self.initial_replicas}, {self.max_replicas}"
            )
        return self


class ReplicaConfig(_Section):
    """The sampling replicas: backend, batching, resources and where weight versions come from."""

    backend: Literal["diffusers", "vllm_omni"] = Field("diffusers", description="Sampling backend.")
    max_batch_size: int = Field(4, ge=1, description="Chunks fused into one forward batch.")
    batch_wait_timeout_s: float = Field(0.01, ge=0, description="How long a batch waits to fill before running.")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs reserved per replica.")
    num_gpus: float = Field(0, ge=0, description="Ray GPUs reserved per replica (fractions share a GPU).")
    max_ongoing_requests: int = Field(8, ge=1, description="Chunk calls a replica takes at once; >= max_batch_size.")
    max_queued_requests: int = Field(-1, ge=-1, description="Chunk calls queued per deployment handle; -1 = unbounded.")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig, description="Replica autoscaling.")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch intra-op threads per replica; None keeps Ray's default (OMP_NUM_THREADS = int(num_cpus), at least 1).",
    )
    weights_dir: str | None = Field(
        None, description="Where the trainer publishes weight versions; None = a folder under FLOWGRPO_HOME."
    )

    @model_validator(mode="after")
    def _check_batching(self) -> ReplicaConfig:
        # With fewer ongoing calls than the batch size, a batch could never fill.
        if self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must be >= max_batch_size ({self.max_batch_size})"
            )
        return self


class AdvantageConfig(_Section):
    """Group-relative advantages (serve_app.flowgrpo.advantages.group_advantages)."""

    std_mode: StdMode = Field("group", description="Divide by each group's std ('group') or the batch's ('global').")
    eps: float = Field(1e-4, gt=0, description="Added to the std so a tied group gives zeros, not NaNs.")
    clip: float | None = Field(5.0, gt=0, description="Clamp advantages to +-clip; None = no clipping.")


class AggregatorConfig(_Section):
    """The deployment that gathers chunks into whole groups and scores them."""

    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs reserved for the aggregator.")
    reward_threads: int = Field(2, ge=1, description="Threads scoring groups concurrently.")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage computation.")


class RewardConfig(_Section):
    """The reward: a weighted sum of registered rewards (or 'module:attr' import paths)."""

    components: list[RewardSpec] = Field(min_length=1, description="Reward components, summed with their weights.")

    @field_validator("components")
    @classmethod
    def _check_names(cls, components: list[RewardSpec]) -> list[RewardSpec]:
        known = registered_rewards()
        for spec in components:
            # Import paths are resolved where the reward is built; registered names can be checked now.
            if ":" not in spec.name and spec.name not in known:
                raise ValueError(
                    f"unknown reward {spec.name!r}; registered: {', '.join(known)} (or a 'package.module:attr' path)"
                )
        return components


class ValidationConfig(_Section):
    """Evaluation sampling (SamplingParams.for_validation)."""

    num_steps: int = Field(20, ge=1, description="Denoising steps for evaluation.")
    seed: int = Field(1234, ge=0, description="Fixed seed, so evaluations of different versions are comparable.")
    noise_level: float = Field(0.0, ge=0, description="0 samples the deterministic ODE (the usual evaluation).")


class RolloutConfig(_Section):
    """Everything the rollout application needs; trainer configs subclass it and add sections."""

    app_name: str = Field("flowgrpo", min_length=1, description="Ray Serve application name.")
    route_prefix: str = Field("/", description="HTTP route prefix of the ingress.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The diffusion model.")
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Default sampling of a request.")
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Evaluation sampling.")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="Ingress deployment.")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig, description="Sampling replicas.")
    aggregator: AggregatorConfig = Field(default_factory=AggregatorConfig, description="Aggregator deployment.")
    reward: RewardConfig = Field(description="The reward.")

    @field_validator("route_prefix")
    @classmethod
    def _check_route(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"route_prefix must start with '/', got {value!r}")
        return value


# ---------------------------------------------------------------------------------------------
# Loader


class ConfigError(ValueError):
    """A config file, defaults list or override is wrong; the message names where and why."""


C = TypeVar("C", bound=BaseModel)
_CONFIG_DIR_ENV = "FLOWGRPO_CONFIG_DIR"


def default_config_dir() -> Path:
    """$FLOWGRPO_CONFIG_DIR, else the repository's ``configs/``."""
    env = os.environ.get(_CONFIG_DIR_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "configs"


def load_config(
    name: str = "diffusion_rollout",
    overrides: Sequence[str] = (),
    *,
    config_dir: str | Path | None = None,
    schema: type[C] = RolloutConfig,  # type: ignore[assignment]
) -> C:
    """Compose config ``name``, apply ``overrides`` and validate it against ``schema``.

    Args:
        name: a config name relative to the config dir ("diffusion_rollout", "trainer/flowgrpo")
            or a path to a .yaml file (its defaults still resolve in the config dir).
        overrides: dotlist entries, "sampling.num_steps=4"; "model=tiny_sd3" selects a group file
            (replacing the section). Group selections apply before value overrides.
        config_dir: where names resolve; default $FLOWGRPO_CONFIG_DIR, else the repo's configs/.
        schema: the pydantic model to validate against (a subclass of RolloutConfig adds sections).

    Raises:
        ConfigError: missing file, unknown key, bad defaults list, cycle, or invalid value.
    """
    loader = _Loader(Path(config_dir) if config_dir is not None else default_config_dir(), schema)
    cfg = loader.compose(loader.primary_path(name), package=(), stack=())
    cfg = loader.apply_overrides(cfg, overrides)
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve config {name!r}: {e}") from e
    try:
        return schema.model_validate(container)
    except ValidationError as e:
        where = f"config {name!r}" + (f" with overrides {list(overrides)}" if overrides else "")
        raise ConfigError(f"invalid {where}:\n{_format_errors(e)}") from e


def config_to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (for logs and run directories)."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))


def _format_errors(error: ValidationError) -> str:
    """One line per error: dotted field path, message, and the offending value if it is a scalar."""
    lines = []
    for err in error.errors():
        path = ".".join(str(part) for part in err["loc"]) or "(root)"
        value = err.get("input", {})
        # Inputs of section-level errors are whole mappings: too long to help in the message.
        got = f" (got {value!r})" if value is None or isinstance(value, (str, int, float, bool)) else ""
        lines.append(f"  {path}: {err['msg']}{got}")
    return "\n".join(lines)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds (``X`` or ``X | None``), or None for leaves, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _describe_keys(model: type[BaseModel], prefix: str) -> str:
    under = f"under {prefix!r}" if prefix else "at the top level"
    return f"known keys {under}: {', '.join(sorted(model.model_fields))}"


def check_keys(data: Mapping[str, Any], model: type[BaseModel], *, source: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key of ``data`` that ``model``'s field tree lacks.

    Nested BaseModel fields are checked recursively; dict- and list-typed fields are left to
    pydantic. ``source`` names where ``data`` came from; ``prefix`` is its dotted position.
    """
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        field = model.model_fields.get(str(key))
        if field is None:
            close = difflib.get_close_matches(str(key), list(model.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {dotted!r} in {source}; {_describe_keys(model, prefix)}{hint}")
        sub = _section_model(field.annotation)
        if sub is None or value is None:
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(f"{dotted!r} in {source} must be a mapping of {sub.__name__} keys, got {value!r}")
        check_keys(value, sub, source=source, prefix=dotted)


class _Loader:
    def __init__(self, config_dir: Path, schema: type[BaseModel]) -> None:
        if not config_dir.is_dir():
            raise ConfigError(f"config dir {config_dir} does not exist (set {_CONFIG_DIR_ENV} or pass config_dir)")
        self.config_dir = config_dir
        self.schema = schema

    # -- files

    def primary_path(self, name: str) -> Path:
        if name.endswith((".yaml", ".yml")):
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"config file {path} does not exist")
            return path.resolve()
        return self._named(name, group=None)

    def _named(self, name: str, *, group: str | None) -> Path:
        base = self.config_dir / group if group else self.config_dir
        path = base / f"{name}.yaml"
        if path.is_file():
            return path.resolve()
        if group and not base.is_dir():
            key = group.replace("/", ".")
            raise ConfigError(
                f"{key!r} has no group files (no folder {base}); set its keys instead, e.g. '{key}.<key>=...'"
            )
        names = sorted(str(p.relative_to(base).with_suffix("")) for p in base.rglob("*.yaml")) if base.is_dir() else []
        what = f"option {name!r} of group {group!r}" if group else f"config {name!r}"
        raise ConfigError(f"{what} not found: no file {path}; available: {', '.join(names) or '(none)'}")

    def _section(self, package: tuple[str, ...], source: str) -> type[BaseModel] | None:
        """The schema model at ``package`` (None where pydantic checks the content instead)."""
        model: type[BaseModel] | None = self.schema
        for i, key in enumerate(package):
            if model is None:
                return None
            field = model.model_fields.get(key)
            if field is None:
                prefix = ".".join(package[:i])
                raise ConfigError(f"unknown group {'.'.join(package)!r} in {source}; {_describe_keys(model, prefix)}")
            model = _section_model(field.annotation)
        return model

    def _is_section(self, package: tuple[str, ...]) -> bool:
        try:
            return self._section(package, "") is not None
        except ConfigError:
            return False

    # -- composition

    def compose(self, path: Path, *, package: tuple[str, ...], stack: tuple[Path, ...]) -> DictConfig:
        """The merged content of ``path`` and its defaults, relative to ``package``."""
        if path in stack:
            chain = " -> ".join(str(p) for p in (*stack, path))
            raise ConfigError(f"cycle in defaults: {chain}")
        stack = (*stack, path)
        own, defaults = self._read(path, package)
        result = OmegaConf.create({})
        for entry in self._entries(defaults, path):
            try:
                if entry == "_self_":
                    result = OmegaConf.merge(result, own)
                elif isinstance(entry, str):
                    other = self.compose(self._named(entry, group=None), package=package, stack=stack)
                    result = OmegaConf.merge(result, other)
                else:
                    group, option = entry
                    sub_package = (*package, *group.split("/"))
                    content = self.compose(self._named(option, group=group), package=sub_package, stack=stack)
                    OmegaConf.update(result, group.replace("/", "."), content, merge=False)
            except OmegaConfBaseException as e:
                raise ConfigError(f"cannot merge defaults entry {entry!r} of {path}: {e}") from e
        return result  # type: ignore[return-value]

    def _read(self, path: Path, package: tuple[str, ...]) -> tuple[DictConfig, list[Any]]:
        try:
            node = OmegaConf.load(path)
        except Exception as e:  # YAML syntax errors come in several types
            raise ConfigError(f"cannot parse {path}: {e}") from e
        if not isinstance(node, DictConfig):
            raise ConfigError(f"{path} must hold a mapping at the top level, got a list")
        data = OmegaConf.to_container(node, resolve=False)
        assert isinstance(data, dict)
        defaults = data.pop("defaults", [])
        if not isinstance(defaults, list):
            raise ConfigError(f"'defaults' in {path} must be a list, got {defaults!r}")
        model = self._section(package, str(path))
        if model is not None:
            check_keys(data, model, source=str(path), prefix=".".join(package))
        return OmegaConf.create(data), defaults

    @staticmethod
    def _entries(defaults: list[Any], path: Path) -> list[str | tuple[str, str]]:
        entries: list[str | tuple[str, str]] = []
        for item in defaults:
            if isinstance(item, str):
                entries.append(item)
            elif isinstance(item, dict) and len(item) == 1:
                (group, option), = item.items()
                if option is None:  # `{group: null}`: select nothing
                    continue
                if not isinstance(option, str):
                    raise ConfigError(f"defaults entry {item!r} in {path}: the option must be a file name")
                entries.append((str(group), option))
            else:
                raise ConfigError(
                    f"bad defaults entry {item!r} in {path}; expected a config name, '_self_' or {{group: option}}"
                )
        if entries.count("_self_") > 1:
            raise ConfigError(f"'_self_' appears more than once in the defaults of {path}")
        if "_self_" not in entries:
            entries.append("_self_")
        return entries

    # -- overrides

    def apply_overrides(self, cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
        values: list[tuple[str, str, Any]] = []
        for override in overrides:
            key, sep, raw = override.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ConfigError(f"override {override!r} must look like 'key=value' (e.g. 'sampling.num_steps=4')")
            source = f"override {override!r}"
            try:
                parsed = OmegaConf.from_dotlist([override])
            except OmegaConfBaseException as e:
                raise ConfigError(f"cannot parse {source}: {e}") from e
            value = OmegaConf.select(parsed, key)
            package = tuple(key.split("."))
            if not isinstance(value, DictConfig) and self._is_section(package):
                # `model=tiny_sd3`: a section set to a name selects a group file.
                group = "/".join(package)
                content = self.compose(self._named(str(raw).strip(), group=group), package=package, stack=())
                OmegaConf.update(cfg, key, content, merge=False)
            else:
                data = OmegaConf.to_container(parsed, resolve=False)
                check_keys(data, self.schema, source=source)  # type: ignore[arg-type]
                values.append((key, source, value))
        for key, source, value in values:
            try:
                OmegaConf.update(cfg, key, value, merge=True)
            except OmegaConfBaseException as e:
                raise ConfigError(f"cannot apply {source}: {e}") from e
        return cfg
