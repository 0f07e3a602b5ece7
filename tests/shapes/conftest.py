"""Helpers of the shapes tests that are modules of their own."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def independent_renderer() -> ModuleType:
    """tests/shapes/independent_renderer.py (test folders are not packages: --import-mode=importlib)."""
    path = Path(__file__).with_name("independent_renderer.py")
    spec = importlib.util.spec_from_file_location("independent_renderer", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
