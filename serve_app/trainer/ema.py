"""An exponential moving average of trained weights (diffusers' EMAModel), evaluated in their place.

EMAModel's default decay warms up as min(decay, (1 + step) / (10 + step)), so early on the average
follows the weights instead of holding the initialisation for thousands of steps. It is imported only by a
run that keeps an average (`new_ema`): diffusers.training_utils imports diffusers' UNet models, which no
trainer here uses (0.4-0.6 CPU-s of a trainer process's start with the tiny policy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from diffusers.training_utils import EMAModel

__all__ = ["averaged_weights", "new_ema"]


def new_ema(parameters: Sequence[torch.nn.Parameter], decay: float) -> EMAModel:
    """An EMAModel over ``parameters`` (a copy of them, updated by its ``step``)."""
    from diffusers.training_utils import EMAModel

    return EMAModel(parameters, decay=decay)


@contextlib.contextmanager
def averaged_weights(ema: EMAModel, parameters: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """The EMA values copied into ``parameters`` for the block, the trained values restored after it."""
    ema.store(parameters)
    ema.copy_to(parameters)
    try:
        yield
    finally:
        ema.restore(parameters)
