"""FLUX.2 [dev] through the whole graph (Serve's local testing mode), the recipe docs/models.md gives:
model=tiny_flux2. Reference images by handle and over HTTP (a request may carry none, one or several a prompt),
the same batch both ways bitwise, and the trainer's replay at ratio 1."""

import pytest
import torch

from serve_app.http_client import HttpRolloutClient
from serve_app.schemas import RolloutRequest
from tests.http_server import assert_same_batch, serve_http

OVERRIDES = ["model=tiny_flux2", "sampling.num_steps=3", "sampling.sde_window_range=[0,1]"]
PROMPTS = ["a red circle", "a blue square"]


def _image(seed: int, height: int = 70, width: int = 90) -> torch.Tensor:
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def handle(start_local_app):
    return start_local_app("diffusion_rollout", OVERRIDES, name="flowgrpo-flux2-local")


def test_reference_images_condition_their_prompt_by_handle_and_over_http(handle):
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy
    from serve_app.serving.engine_contract import replay_verdict

    images = [[_image(0)], [_image(1), _image(2, 64, 128)]]  # one, and two of another size
    batch = handle.rollout.remote(RolloutRequest(prompts=PROMPTS, group_size=2, seed=1, images=images)).result()
    batch.fetch()
    other = handle.rollout.remote(RolloutRequest(prompts=PROMPTS, group_size=2, seed=1,
                                                 images=[[_image(7)], images[1]])).result().transitions
    assert float((other.latents[:2, -1] - batch.transitions.latents[:2, -1]).abs().max()) > 1e-3
    torch.testing.assert_close(other.latents[2:], batch.transitions.latents[2:], atol=1e-5, rtol=0)
    plain = handle.rollout.remote(RolloutRequest(prompts=PROMPTS, group_size=2, seed=1)).result().transitions
    assert float((plain.latents[:, -1] - batch.transitions.latents[:, -1]).abs().max()) > 1e-3
    verdict = replay_verdict(load_configured_policy(load_config("diffusion_rollout", OVERRIDES).model), batch.transitions)
    assert verdict.ok, verdict.message
    with serve_http(handle) as url:
        got = HttpRolloutClient(url).rollout(PROMPTS, group_size=2, seed=1, images=images)
    assert_same_batch(got, batch)
