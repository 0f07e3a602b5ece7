"""Named embedded checkpoints, built on first use into a shared cache directory.

Several Ray replicas may ask for the same model at once. Builds therefore run under a
``filelock.FileLock`` and write into a temporary sibling directory that is renamed into
place in one step, so no process ever sees a half-written model directory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from filelock import FileLock

from serve_app.families import FAMILIES, EmbeddedCheckpoint, FamilyName
from serve_app.imports import import_object, is_import_path

__all__ = [
    "EMBEDDED_MODELS",
    "BUILD_VERSION",
    "EmbeddedModel",
    "ensure_embedded_model",
    "ensure_qwen2_tokenizer",
    "flowgrpo_home",
]

# Part of every cache path: bump it whenever a builder's output changes so stale caches
# are not reused.
BUILD_VERSION = "v1"



class Builder(Protocol):
    def __call__(self, out_dir: Path, *, tokenizer_dir: Path) -> Path: ...


@dataclass(frozen=True)
class EmbeddedModel:
    """A model built from code on first use (`build`), or a trained one committed to the repo (`shipped`)."""

    family: FamilyName  # type: ignore[valid-type]
    build: Builder | None = None
    shipped: Path | None = None


def _table_builder(checkpoint: EmbeddedCheckpoint) -> Builder:
    """The builder of a family table row's checkpoint, imported when it first builds: importing this module
    (e.g. just for flowgrpo_home) must stay cheap, while the builders' diffusers imports take seconds."""

    def build(out_dir: Path, *, tokenizer_dir: Path) -> Path:
        builder = import_object(checkpoint.builder, what=f"the builder of {checkpoint.name}")
        return builder(out_dir, seed=0, tokenizer_dir=tokenizer_dir, **dict(checkpoint.options))

    return build


def _qwen2_tokenizer(out_dir: Path) -> Path:
    from .tokenizer import build_qwen2_tokenizer

    return build_qwen2_tokenizer(out_dir)


# Every family's embedded checkpoints (serve_app.families); worlds ship their own by import path.
EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    checkpoint.name: EmbeddedModel(row.name, build=_table_builder(checkpoint))
    for row in FAMILIES.values() for checkpoint in row.checkpoints
}


def flowgrpo_home() -> Path:
    """Cache root: ``$FLOWGRPO_HOME`` or ``~/.cache/flowgrpo-serve``."""
    return Path(os.environ.get("FLOWGRPO_HOME", "~/.cache/flowgrpo-serve")).expanduser()


def _build_once(target: Path, build: Callable[[Path], object]) -> Path:
    """Runs ``build(tmp_dir)`` and renames ``tmp_dir`` to ``target`` unless ``target`` exists."""
    if target.is_dir():
        return target
    with FileLock(target.parent / f".{target.name}.lock"):
        # Another process may have finished the build while this one waited for the lock.
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it owner-only
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def ensure_qwen2_tokenizer() -> Path:
    """The shared Qwen2 tokenizer directory, ``flowgrpo_home()/tokenizers/qwen2``."""
    target = flowgrpo_home() / "tokenizers" / "qwen2"
    target.parent.mkdir(parents=True, exist_ok=True)
    return _build_once(target, _qwen2_tokenizer)


def ensure_embedded_model(name: str) -> Path:
    """Directory of the embedded model ``name``, building it on first use.

    ``name`` is a key of EMBEDDED_MODELS or a ``"package.module:attr"`` path to an EmbeddedModel
    (how a world outside the core ships its own model). The result is
    ``flowgrpo_home()/models/<name>-<BUILD_VERSION>`` (a shipped checkpoint: its directory in its
    package) and loads with the matching diffusers pipeline's ``from_pretrained(path, local_files_only=True)``.
    """
    model = _embedded(name)
    if model.shipped is not None:
        if not (model.shipped / "model_index.json").is_file():
            raise FileNotFoundError(f"the shipped checkpoint {name!r} is missing from {model.shipped}")
        return model.shipped
    target = flowgrpo_home() / "models" / f"{name.replace(':', '.')}-{BUILD_VERSION}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = ensure_qwen2_tokenizer()
    build = model.build
    assert build is not None  # an EmbeddedModel has a builder or a shipped directory
    return _build_once(target, lambda tmp: build(tmp, tokenizer_dir=tokenizer_dir))


def _embedded(name: str) -> EmbeddedModel:
    if is_import_path(name):
        model = import_object(name, what="embedded model")
        if not isinstance(model, EmbeddedModel):
            raise ValueError(f"{name!r} is a {type(model).__name__}, not an EmbeddedModel")
        return model
    try:
        return EMBEDDED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown embedded model {name!r}; known: {', '.join(sorted(EMBEDDED_MODELS))} "
            "(or a 'package.module:attr' path to an EmbeddedModel)"
        ) from None
