"""Helpers of the moving-shapes tests that are modules of their own."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


def load_module(name: str, path: Path) -> ModuleType:
    """A test helper module by path (test folders are not packages: --import-mode=importlib)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def independent_video_renderer() -> ModuleType:
    """tests/motion/independent_renderer.py."""
    return load_module("motion_independent_renderer", Path(__file__).with_name("independent_renderer.py"))
