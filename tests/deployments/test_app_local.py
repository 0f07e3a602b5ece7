"""The whole graph in Serve's local testing mode: one process, no cluster, milliseconds per call."""

import pytest
import torch
from pydantic import ValidationError
from serve_app.app import AppArgs, build_app
from serve_app.config import ConfigError
from serve_app.errors import InvalidRequestError, RequestTooLargeError
from serve_app.schemas import RolloutRequest, TrajectoryBatch

OVERRIDES = ["sampling.num_steps=4", "sampling.sde_window_range=[0,2]", "ingress.chunk_size=3", "ingress.max_samples=12"]


@pytest.fixture(scope="module")
def handle(start_local_app):
    # Local testing mode runs in this process and ends with it. No serve.shutdown() here: with no
    # Ray initialized it would connect to (and so start) a Ray instance.
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-local")


def test_rollout_by_handle_returns_whole_groups(handle):
    batch: TrajectoryBatch = handle.rollout.remote(
        RolloutRequest(prompts=["a cat", "a red house"], group_size=4, seed=1)
    ).result()
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert t.sample_index.tolist() == [0, 1, 2, 3] * 2
    assert t.log_probs.shape == (8, 2) and torch.isfinite(t.log_probs).all()
    assert t.images.shape == (8, 3, 32, 32)
    assert batch.advantages.shape == (8,) and batch.rewards["total"].shape == (8,)
    assert batch.policy_version == 0
    assert batch.metrics["rollout_seconds"] > 0


def test_same_seed_reproduces_the_request(handle):
    request = RolloutRequest(prompts=["a cat"], group_size=3, seed=42)
    a = handle.rollout.remote(request).result().trajectory
    b = handle.rollout.remote(request).result().trajectory
    assert torch.equal(a.seeds, b.seeds)
    torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=0)


def test_dict_requests_are_validated(handle):
    with pytest.raises(InvalidRequestError, match="group_size"):
        handle.rollout.remote({"prompts": ["a"], "group_size": 0}).result()
    with pytest.raises(RequestTooLargeError):
        handle.rollout.remote({"prompts": ["a", "b"], "group_size": 7}).result()


def test_build_app_rejects_unknown_args_and_keys():
    with pytest.raises(ConfigError, match="sampling.nosie_level"):
        build_app(AppArgs(overrides=["sampling.nosie_level=1"]))
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        AppArgs.model_validate({"config": "diffusion_rollout", "bogus": 1})


class _DiesOnce:
    """A handle method whose first call meets a replica that died; later calls answer `value`."""

    def __init__(self, value) -> None:
        self.value, self.calls = value, 0

    def remote(self):
        from ray.exceptions import ActorDiedError

        self.calls += 1

        async def answer():
            if self.calls == 1:
                raise ActorDiedError()
            return self.value

        return answer()


@pytest.mark.parametrize(("attempts", "status"), [(2, None), (1, 503)])
def test_a_replica_dying_while_reporting_its_geometry_costs_a_retry_not_the_request(attempts, status):
    """The ingress's first call to a replica (its geometry) is re-run on another replica like a chunk;
    without retries left it is a 503 (ReplicaUnavailableError), never a 500."""
    import asyncio
    from types import SimpleNamespace

    from deployments.tokenizer_ingress import TokenizerIngress
    from serve_app.config import load_config
    from serve_app.errors import ReplicaUnavailableError, http_error

    config = load_config("diffusion_rollout", [f"ingress.chunk_retry.attempts={attempts}",
                                               "ingress.chunk_retry.backoff_s=0"])
    geometry = _DiesOnce("geometry")
    ingress = SimpleNamespace(config=config)  # the method's logic only, outside a Serve replica
    ask = TokenizerIngress._on_a_replica(ingress, geometry.remote, "reporting its geometry")
    if status is None:
        assert asyncio.run(ask) == "geometry" and geometry.calls == 2
    else:
        with pytest.raises(ReplicaUnavailableError, match="reporting its geometry died 1 times") as raised:
            asyncio.run(ask)
        assert http_error(raised.value)[0] == status and geometry.calls == 1
