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


@pytest.fixture(scope="session")
def add_second_blob():
    """Paints a 5x5 red square into every frame of a uint8 [F, 3, H, W] video, in place, where no frame
    shows its subject (with a pixel of margin): a second object beside the one that moves."""
    import torch

    from serve_app.worlds.motion.scene import BACKGROUND, COLOURS

    def add(video: torch.Tensor) -> None:
        occupied = (video != torch.tensor(BACKGROUND, dtype=torch.uint8)[:, None, None]).any(1).any(0)
        side = video.shape[-1]
        for y in (1, side - 6):
            for x in (1, side - 6):
                if not occupied[y - 1:y + 6, x - 1:x + 6].any():
                    video[:, :, y:y + 5, x:x + 5] = torch.tensor(COLOURS["red"], dtype=torch.uint8)[:, None, None]
                    return
        raise AssertionError("the subject touches every corner of the frame")

    return add
