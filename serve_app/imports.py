"""Objects named by import path, ``"package.module:attr"``: how configs name rewards, evaluators,
prompt sources, embedded models and pipeline components that live outside the core (a world such
as serve_app.worlds.shapes, or the user's own package), so the core never imports them by name."""

from __future__ import annotations

import importlib
from typing import Any


def is_import_path(name: str) -> bool:
    return ":" in name


def import_object(path: str, *, what: str = "object") -> Any:
    """The attribute ``attr`` (dots allowed: ``"mod:Cls.method"``) of module ``package.module``.

    Raises:
        ValueError: the path is malformed, the module does not import, or it lacks the attribute;
            the message names ``what`` was being looked up.
    """
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"invalid import path {path!r} for the {what}; expected 'package.module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for the {what} {path!r}: {exc}") from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr_path!r} (the {what} {path!r})") from None
    return obj
