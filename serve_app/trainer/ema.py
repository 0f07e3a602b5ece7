"""An exponential moving average of trained weights (diffusers' EMAModel), evaluated in their place.

EMAModel's default decay warms up as min(decay, (1 + step) / (10 + step)), so early on the average
follows the weights instead of holding the initialisation for thousands of steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from diffusers.training_utils import EMAModel

__all__ = ["EMAModel", "averaged_weights"]


@contextlib.contextmanager
def averaged_weights(ema: EMAModel, parameters: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """The EMA values copied into ``parameters`` for the block, the trained values restored after it."""
    ema.store(parameters)
    ema.copy_to(parameters)
    try:
        yield
    finally:
        ema.restore(parameters)
