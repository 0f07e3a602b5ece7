"""Load a config from the YAML files under ``configs/``: Hydra composes, pydantic validates.

    cfg = load_config("diffusion_rollout", ["sampling.num_steps=4", "model=tiny_sd3"])

Composition is Hydra's (its compose API, no app or working-directory change): a file's
``defaults:`` list names what goes under it (``- rollout`` merges another config, ``- model: tiny_sd3``
selects a file of the group folder ``configs/model/``, ``_self_`` places the file's own keys), and
overrides use Hydra's grammar (``model=tiny_sd3`` selects a group option, ``a.b=1`` sets a value,
``a.b=[1,2]`` a list, ``a.b=null`` None). A config inside a group folder that is loaded by name
(``trainer/flowgrpo``) starts with ``# @package _global_``, so its keys sit at the top level.

What Hydra does not know, the schema does: every key of every file and override must be a field of
the pydantic schema, so an unknown key fails naming the key and the file or override that holds it,
and every value is checked by the schema's types and validators.
"""

from __future__ import annotations

import difflib
import os
import threading
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from pydantic import BaseModel, ValidationError

from serve_app.errors import validation_errors

C = TypeVar("C", bound=BaseModel)
CONFIG_DIR_ENV = "FLOWGRPO_CONFIG_DIR"
# Hydra keeps its search path in a process-wide singleton: one composition at a time.
_HYDRA_LOCK = threading.Lock()


class ConfigError(ValueError):
    """A config file, defaults list or override is wrong; the message names where and why."""


def default_config_dir() -> Path:
    """$FLOWGRPO_CONFIG_DIR, else the package's ``configs`` (in a checkout, a link to the repository's
    ``configs/``; in an installed wheel, the copy it ships)."""
    env = os.environ.get(CONFIG_DIR_ENV)
    return Path(env) if env else Path(__file__).parents[1] / "configs"


def load_config(
    name: str,
    overrides: Sequence[str] = (),
    *,
    schema: type[C],
    config_dir: str | Path | None = None,
) -> C:
    """Compose config ``name`` with ``overrides`` and validate the result against ``schema``.

    Args:
        name: a config name relative to the config dir ("diffusion_rollout", "trainer/flowgrpo"),
            or a path to a .yaml file (its defaults still resolve in the config dir).
        overrides: Hydra overrides: "sampling.num_steps=4" sets a value, "model=tiny_sd3" selects
            the file model/tiny_sd3.yaml for the section `model` (replacing it).
        schema: the pydantic model of the result.
        config_dir: where names resolve; default $FLOWGRPO_CONFIG_DIR, else the repo's configs/.

    Raises:
        ConfigError: missing file or option, unknown key, bad override, or invalid value.
    """
    root = Path(config_dir) if config_dir is not None else default_config_dir()
    if not root.is_dir():
        raise ConfigError(f"config dir {root} does not exist (set {CONFIG_DIR_ENV} or pass config_dir)")
    primary, search_path = _primary(name, root)
    hydra_overrides = [_checked_override(o, root, schema) for o in overrides]
    where = f"config {name!r}" + (f" with overrides {list(overrides)}" if overrides else "")
    with _HYDRA_LOCK:
        composed, sources = _compose(primary, search_path, root, hydra_overrides, where)
    try:
        return schema.model_validate(composed)
    except ValidationError as exc:
        _raise_for_unknown_key(exc, sources, schema)
        lines = [f"  {field}: {message}" for field, message in validation_errors(exc)]
        raise ConfigError(f"invalid {where}:\n" + "\n".join(lines)) from None


def config_to_yaml(cfg: BaseModel) -> str:
    """The resolved config as YAML (for logs and run directories); loads back to an equal config."""
    return OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json")))


# ---------------------------------------------------------------------------------------------
# Composition


def _primary(name: str, root: Path) -> tuple[str, Path]:
    """(config name for Hydra, the folder it is found in)."""
    if not name.endswith((".yaml", ".yml")):
        if not (root / f"{name}.yaml").is_file():
            available = sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))
            raise ConfigError(f"config {name!r} not found: no file {root / name}.yaml; available: {', '.join(available)}")
        return name, root
    path = Path(name).resolve()
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    return path.stem, path.parent


def _checked_override(override: str, root: Path, schema: type[BaseModel]) -> str:
    """Check an override's key against the schema; return it in the form Hydra should apply.

    A value override is sent as ``++key=value`` (set, or add when no file set the key), because the
    schema - not the files - says which keys exist; group selections go through unchanged.
    """
    key, sep, _ = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {override!r} must look like 'key=value' (e.g. 'sampling.num_steps=4')")
    if key.startswith(("+", "~")):
        return override  # Hydra's own add/delete forms, for users who need them
    if "." not in key and "@" not in key and (root / key).is_dir():
        return override  # selects a file of the group folder configs/<key>/
    path = key.split(".")
    model = _check_path(path, schema, source=f"override {override!r}")
    if model is not None and "." not in key:
        raise ConfigError(
            f"{key!r} has no group files (no folder {root / key}); set its keys instead, e.g. '{key}.<key>=...'"
        )
    return f"++{override.strip()}"


def _compose(
    primary: str, search_path: Path, root: Path, overrides: list[str], where: str
) -> tuple[dict[str, Any], list[tuple[Path, str]]]:
    """The composed config as plain data, and the (file, package) pairs it merged, in merge order."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from hydra.types import RunMode
    import yaml
    from omegaconf.errors import OmegaConfBaseException

    # A .yaml outside the config dir is the primary config; its defaults still resolve in root.
    extra = [f"hydra.searchpath=[file://{root}]"] if search_path != root else []
    try:
        with initialize_config_dir(config_dir=str(search_path), version_base="1.3"):
            cfg = compose(primary, overrides=[*overrides, *extra])
            loader = GlobalHydra.instance().config_loader()
            defaults = loader.compute_defaults_list(primary, [*overrides, *extra], RunMode.RUN).defaults
            data = OmegaConf.to_container(cfg, resolve=True)
    except RecursionError:
        raise ConfigError(f"cannot compose {where}: a cycle in the defaults lists") from None
    except (HydraException, OmegaConfBaseException, ValueError, yaml.YAMLError) as exc:
        # Hydra's messages already say which file and what is available; its search path is noise.
        message = str(exc).split("\nConfig search path:")[0].strip()
        raise ConfigError(f"cannot compose {where}: {message}") from None
    sources = []
    for entry in defaults:
        if entry.config_path is None or entry.config_path.startswith("hydra/") or entry.config_path == "hydra/config":
            continue
        for folder in (search_path, root):
            path = folder / f"{entry.config_path}.yaml"
            if path.is_file():
                sources.append((path, entry.package or ""))
                break
    assert isinstance(data, dict)
    return data, sources


# ---------------------------------------------------------------------------------------------
# Unknown keys


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The BaseModel a field holds (``X`` or ``X | None``), or None for leaves, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1:
            return models[0]
    return None


def _check_path(path: Sequence[str], schema: type[BaseModel], *, source: str) -> type[BaseModel] | None:
    """Walk ``path`` down the schema's sections; return the section it names (None for a leaf, list
    or dict field, whose content pydantic checks). Raises ConfigError naming an unknown key."""
    model: type[BaseModel] | None = schema
    for depth, key in enumerate(path):
        if model is None:
            return None
        if key not in model.model_fields:
            prefix = ".".join(path[:depth])
            under = f"under {prefix!r}" if prefix else "at the top level"
            close = difflib.get_close_matches(key, list(model.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown key {'.'.join(path[: depth + 1])!r} in {source}; known keys {under}: "
                f"{', '.join(sorted(model.model_fields))}{hint}"
            )
        model = _section_model(model.model_fields[key].annotation)
    return model


def _raise_for_unknown_key(exc: ValidationError, sources: list[tuple[Path, str]], schema: type[BaseModel]) -> None:
    """For a key no schema field has, name the last file that sets it (the one that won the merge)."""
    for error in exc.errors():
        if error["type"] != "extra_forbidden":
            continue
        path = [str(part) for part in error["loc"]]
        source = next((str(file) for file, package in reversed(sources) if _file_sets(file, package, path)),
                      "the composed config")
        _check_path(path, schema, source=source)  # raises, listing the known keys where the schema has them
        raise ConfigError(f"unknown key {'.'.join(path)!r} in {source}: {error['msg']}")


def _file_sets(file: Path, package: str, path: Sequence[str]) -> bool:
    """Whether ``file``, placed at ``package`` (dotted), sets the key at ``path``."""
    prefix = [part for part in package.split(".") if part]
    if list(path[: len(prefix)]) != prefix:
        return False
    content = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    if not isinstance(content, dict):
        return False
    content.pop("defaults", None)
    return _has_path(content, path[len(prefix):])


def _has_path(data: Any, path: Sequence[str]) -> bool:
    for key in path:
        if isinstance(data, Mapping) and key in data:
            data = data[key]
        elif isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        else:
            return False
    return True
