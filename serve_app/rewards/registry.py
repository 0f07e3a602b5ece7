"""Reward registry: names and import paths to reward callables.

A *reward* is a callable ``(images, prompts) -> rewards`` with ``images`` a uint8 tensor
``[B, 3, H, W]``, ``prompts`` a sequence of ``B`` strings and ``rewards`` a float tensor ``[B]``.
A *factory* takes keyword arguments (the ``args`` of a reward spec) and returns a reward, so that
configuration stays plain data that can travel to any Ray worker.

What a reward takes is declared too: ``"images"`` (the default: uint8 ``[B, 3, H, W]``), ``"videos"``
(uint8 ``[B, F, 3, H, W]``, one value per video) or ``"any"`` (both): ``@register_reward(name,
takes="videos")``, or :func:`takes` on a reward named by import path. The config refuses a reward
that cannot take what the model family produces.

A reward of an image-conditioned family (editing) may compare each sample with its prompt's input images:
it declares so (:func:`sees_input_images`) and is then called as ``reward(images, prompts, input_images=...)``,
with ``input_images`` one list per sample of its prompt's input images (uint8 ``[3, h, w]``, at the size the
model conditions on; empty lists for a text-to-image family). Such a reward runs in the aggregator's
process (``placement: in_process``).

A *groupwise* reward (a ranking, a diversity bonus) scores a whole group at once: it is called with
all ``G`` samples of one prompt, in sample order, and never with a part of a group. A factory
declares it (``@register_reward(name, groupwise=True)``), as can a plain callable or class with a
``groupwise = True`` attribute; a reward spec's ``groupwise`` overrides the declaration.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Literal, Protocol, Sequence, TypeVar

import torch

from serve_app.imports import import_object, is_import_path


class RewardFn(Protocol):
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


RewardFactory = Callable[..., RewardFn]
F = TypeVar("F", bound=Callable[..., Any])
Takes = Literal["images", "videos", "any"]

_REGISTRY: dict[str, RewardFactory] = {}
# Marks a factory so that an import path to a decorated function is called with its kwargs
# instead of being mistaken for a plain reward.
_FACTORY_MARK = "__reward_factory__"


def register_reward(name: str, *, groupwise: bool = False, takes: Takes = "images") -> Callable[[F], F]:
    """Decorator registering a reward factory under ``name``; ``groupwise``: its rewards score whole groups;
    ``takes``: what its rewards score."""
    if not name or ":" in name:
        raise ValueError(f"invalid reward name {name!r}: must be non-empty and contain no ':'")

    def deco(factory: F) -> F:
        old = _REGISTRY.get(name)
        # Re-running the same definition (module reload) replaces it; a different one is a clash.
        if old is not None and _qualname(old) != _qualname(factory):
            raise ValueError(f"reward {name!r} is already registered to {_qualname(old)}")
        setattr(factory, _FACTORY_MARK, True)
        factory.groupwise = groupwise  # type: ignore[attr-defined]
        factory.takes = takes  # type: ignore[attr-defined]
        _REGISTRY[name] = factory
        return factory

    return deco


def registered_rewards() -> tuple[str, ...]:
    """Sorted names of the registered rewards (built-ins included)."""
    _load_builtins()
    return tuple(sorted(_REGISTRY))


def build_reward(name: str, **kwargs: Any) -> RewardFn:
    """Resolve a registered name or an import path ``"package.module:attribute"`` to a reward.

    For an import path, the attribute (dots allowed: ``"mod:Cls.method"``) may be a class, a
    factory or a plain reward callable. Classes and factories are called with ``kwargs``; a plain
    reward (two or more required positional parameters) is used as is and takes no ``kwargs``.

    Raises:
        ValueError: unknown name, unimportable path, bad arguments or a non-callable result.
    """
    _load_builtins()
    if is_import_path(name):
        target = import_object(name, what="reward")
        if _is_plain_reward(target):
            if kwargs:
                raise ValueError(f"reward {name!r} is a plain reward callable and takes no args, got {sorted(kwargs)}")
            return target
        return _call_factory(name, target, kwargs)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY))}. "
            f"An import path 'package.module:attribute' is also accepted."
        )
    return _call_factory(name, _REGISTRY[name], kwargs)


def takes(kind: Takes) -> Callable[[F], F]:
    """Declare what a reward (or reward factory) named by import path scores: "images", "videos" or "any"."""

    def deco(target: F) -> F:
        target.takes = kind  # type: ignore[attr-defined]
        return target

    return deco


def declares_groupwise(name: str) -> bool:
    """Whether the reward named ``name`` (registered name or import path) declares itself groupwise.

    Raises:
        ValueError: unknown name or unimportable path.
    """
    return bool(getattr(_declaring(name), "groupwise", False))


def declared_input(name: str) -> Takes:
    """What the reward named ``name`` scores: "images" unless it declares "videos" or "any".

    Raises:
        ValueError: unknown name or unimportable path.
    """
    return getattr(_declaring(name), "takes", "images")


def sees_input_images(target: F) -> F:
    """Declare that a reward (or reward factory) named by import path is called with its prompts' input images."""
    target.sees_input_images = True  # type: ignore[attr-defined]
    return target


def declares_input_images(name: str) -> bool:
    """Whether the reward named ``name`` is called with its prompts' input images (:func:`sees_input_images`).

    Raises:
        ValueError: unknown name or unimportable path.
    """
    return bool(getattr(_declaring(name), "sees_input_images", False))


def _declaring(name: str) -> Any:
    """The registered factory or the import path's object: what carries a reward's declarations."""
    _load_builtins()
    if is_import_path(name):
        return import_object(name, what="reward")
    if name in _REGISTRY:
        return _REGISTRY[name]
    raise ValueError(f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REGISTRY))}")


def _load_builtins() -> None:
    # Imported here, not at module top, because builtin.py imports this module to register.
    importlib.import_module(f"{__package__}.builtin")


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def _is_plain_reward(obj: Any) -> bool:
    if inspect.isclass(obj) or getattr(obj, _FACTORY_MARK, False) or not callable(obj):
        return False
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is inspect.Parameter.empty]
    return len(required) >= 2


def _call_factory(name: str, factory: Any, kwargs: dict[str, Any]) -> RewardFn:
    if not callable(factory):
        raise ValueError(f"reward {name!r} resolves to a non-callable {type(factory).__name__}")
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad args for reward {name!r}: {e}") from e
    except ValueError:
        pass  # no introspectable signature (some builtins); let the call itself decide
    reward = factory(**kwargs)
    if not callable(reward):
        raise ValueError(f"factory of reward {name!r} returned a non-callable {type(reward).__name__}")
    return reward


def check_image_batch(images: torch.Tensor, prompts: Sequence[str]) -> None:
    """Raise ValueError unless ``images`` is uint8 ``[B, 3, H, W]`` and there are ``B`` prompts."""
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
        desc = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must be a uint8 tensor [B, 3, H, W], got {desc}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        n = "a str" if isinstance(prompts, str) else len(prompts)
        raise ValueError(f"expected {images.shape[0]} prompts, one per image, got {n}")
