"""The conformance suite's matrix: which engines, on which families, and each family's stock pipeline.

A new engine joins by adding its factory to ENGINES (it must then pass every test unchanged); a new
family by adding its embedded checkpoint to FAMILIES (its policy's ``stock_call`` is the stock pipeline).
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

FAMILIES = {
    "qwen_image": "tiny-qwen-image",
    "sd3": "tiny-sd3",
    "flux": "tiny-flux",
    "wan": "tiny-wan",
}

# Sampling a family needs beyond the suite's common settings: video families sample a few frames.
FAMILY_SAMPLING = {"wan": {"num_frames": 5}}


def family_sampling(family: str, params: SamplingParams) -> SamplingParams:
    """`params` with what `family` needs on top (FAMILY_SAMPLING)."""
    return params.model_copy(update=FAMILY_SAMPLING.get(family, {}))


@pytest.fixture(scope="session")
def conformance_policies(flowgrpo_home):
    """family -> a policy of its own (weight versions change it; no other test shares it), loaded once."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_policy

    loaded: dict[str, DiffusionPolicy] = {}

    def get(family: str) -> DiffusionPolicy:
        if family not in loaded:
            loaded[family] = load_policy(ensure_embedded_model(FAMILIES[family]), family=family)
        return loaded[family]

    return get
