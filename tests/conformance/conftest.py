"""The conformance suite's matrix: which engines, on which checkpoints, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family, or a new layout of one (Wan2.2's two experts, its per-token timesteps), by adding its embedded
checkpoint to CHECKPOINTS (its policy's ``stock_call`` is the stock pipeline).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from serve_app.serving.engine import DiffusersEngine
from serve_app.policies.base import DiffusionPolicy
from serve_app.schemas import SamplingParams

from tests.conformance.fake_engine import fake_bf16_engine

# Engines that must fulfil the contract, and engines the suite must catch.
ENGINES: dict[str, Callable] = {"diffusers": DiffusersEngine}
FLAGGED_ENGINES: dict[str, Callable] = {"fake_bf16": fake_bf16_engine}

# Embedded checkpoint -> its family. tiny-wan22's 3-step schedule crosses its boundary after step 0, so
# the suite's window (steps 0-1) lies across it and its noise-0 run uses both experts.
CHECKPOINTS = {
    "tiny-qwen-image": "qwen_image",
    "tiny-sd3": "sd3",
    "tiny-flux": "flux",
    "tiny-wan": "wan",
    "tiny-wan22": "wan",
    "tiny-wan22-ti2v": "wan",
}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {"wan": {"num_frames": 5}}


def checkpoint_sampling(checkpoint: str, params: SamplingParams) -> SamplingParams:
    """`params` with what the checkpoint's family needs on top (FAMILY_SAMPLING)."""
    return params.model_copy(update=FAMILY_SAMPLING.get(CHECKPOINTS[checkpoint], {}))


@pytest.fixture(scope="session")
def conformance_policies(flowgrpo_home):
    """checkpoint -> a policy of its own (weight versions change it; no other test shares it), loaded once."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    loaded: dict[str, DiffusionPolicy] = {}

    def get(checkpoint: str) -> DiffusionPolicy:
        if checkpoint not in loaded:
            loaded[checkpoint] = load_policy(ensure_embedded_model(checkpoint), family=CHECKPOINTS[checkpoint])
        return loaded[checkpoint]

    return get
