"""Shared fixtures: one embedded-model cache per test session, loopback-only Ray."""

import os

import pytest

from serve_app.local_ray import loopback_ray_env

# Every Ray process a test starts stays on 127.0.0.1 and requires this session's token (CLI and API alike).
loopback_ray_env()
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def flowgrpo_home(tmp_path_factory):
    """A FLOWGRPO_HOME for the whole session (embedded models build once, ~15 s)."""
    home = os.environ.get("FLOWGRPO_TEST_HOME") or str(tmp_path_factory.mktemp("flowgrpo_home"))
    os.environ["FLOWGRPO_HOME"] = home
    return home


@pytest.fixture(scope="session")
def tiny_qwen_dir(flowgrpo_home):
    from serve_app.models import ensure_embedded_model

    return ensure_embedded_model("tiny-qwen-image")


@pytest.fixture(scope="session")
def ode_sample():
    """Our sampler at noise 0 from given initial latents: (images [B, 3, H, W] float, log_probs).

    What every policy family must match against its stock diffusers pipeline; `images` are an image-conditioned
    family's input images as sent (resized here as the ingress does).
    """
    from dataclasses import replace

    import torch

    from serve_app.flowgrpo.sampler import denoise, encode_conditioning

    def run(policy, prompt, params, latents, generators, *, images=()):
        resized = [policy.geometry.resize_input_image(image) for image in images]
        tokens = [replace(t, images=resized) for t in policy.text_processor().tokenize([prompt])]
        conditioning = encode_conditioning(policy, tokens, torch.zeros(1, dtype=torch.long), None, params)
        assert (conditioning.negative is not None) == (params.guidance_scale > 1)
        sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width)
        steps = list(range(params.num_steps - 1))
        result = denoise(policy, conditioning, latents, sigmas, steps, params, generators)
        return policy.decode(result.final_latents, height=params.height, width=params.width), result.log_probs

    return run


@pytest.fixture(scope="session")
def tiny_policy(tiny_qwen_dir):
    from serve_app.policies import load_policy

    return load_policy(tiny_qwen_dir, family="qwen_image")


@pytest.fixture(scope="session")
def start_local_app(flowgrpo_home):
    """start_local_app(config, overrides, name=...) -> the ingress handle of the whole app in Serve's
    local testing mode (serve_app.app.run_local: one process, no cluster)."""
    from serve_app.app import AppArgs, run_local

    def start(config: str = "diffusion_rollout", overrides=(), *, name: str):
        return run_local(AppArgs(config=config, overrides=list(overrides)), name=name)

    return start


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need a CUDA device: skipped, with the reason, on machines without one."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
