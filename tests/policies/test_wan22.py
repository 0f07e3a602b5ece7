"""Wan2.2 through the Wan adapter, on the embedded tiny checkpoints: the two-expert layout (tiny-wan22: the
expert and guidance scale of each step as the stock loop picks them, a window across the boundary replayed with
ratio 1, LoRA versions of either expert or both, read back and hashed) and the per-token-timestep layout
(tiny-wan22-ti2v: its timesteps and its 48-channel, factor-16 geometry in chunks and the work budget), and the
checkouts refused at load. (Noise 0 == the stock pipeline, seeds, pinned versions: tests/conformance.)"""

import dataclasses

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from pydantic import ValidationError

from serve_app.config import IngressConfig
from serve_app.errors import InvalidRequestError, RequestTooLargeError, WeightMismatchError
from serve_app.flowgrpo.sampler import replay_step, sample_group
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.policies import load_policy
from serve_app.policies.wan import WanPolicy, expert_at
from serve_app.schemas import RolloutRequest, SamplingParams
from serve_app.serving.ingress import RolloutPlanner
from serve_app.trainer.config import LoraSection
from serve_app.trainer.lora import TrainableTransformer, trained_experts
from serve_app.weights import WeightStore, content_hash
from serve_app.weights.replica import PolicyVersions, check_held

PROMPT = "a red circle moving left to right"
# 3 steps: step 0 on the high-noise expert, steps 1-2 on the low-noise one.
PARAMS = SamplingParams(height=32, width=32, num_frames=5, num_steps=3, guidance_scale=4.0, guidance_scale_2=2.0,
                        noise_level=1.0, sde_window_size=None, seed=7)
ODE = PARAMS.model_copy(update={"noise_level": 0.0})


def _load(name: str) -> WanPolicy:
    from serve_app.models import ensure_embedded_model

    return load_policy(ensure_embedded_model(name))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def a14b(flowgrpo_home):
    return _load("tiny-wan22")


@pytest.fixture(scope="module")
def ti2v(flowgrpo_home):
    return _load("tiny-wan22-ti2v")


def _record_calls(policy):
    """Forward pre-hooks on every expert: a list that fills with (expert, timestep) per transformer call."""
    calls, handles = [], []
    for name, module in policy.experts.items():
        def hook(_module, _args, kwargs, name=name):
            calls.append((name, kwargs["timestep"].detach().clone()))
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, handles


def _ode_video(policy, params, seed=123):
    from serve_app.flowgrpo.sampler import denoise, encode_conditioning, initial_latents

    generators = sample_generators(torch.tensor([seed]))
    latents = initial_latents(policy, params, generators)
    conditioning = encode_conditioning(policy, policy.text_processor().tokenize([PROMPT]),
                                       torch.zeros(1, dtype=torch.long), None, params)
    sigmas = policy.sigma_schedule(params.num_steps, params.height, params.width)
    result = denoise(policy, conditioning, latents, sigmas, list(range(params.num_steps - 1)), params, generators)
    return latents, policy.decode(result.final_latents, height=params.height, width=params.width)


def test_the_expert_of_a_step_is_a_function_of_its_timestep(a14b):
    assert isinstance(a14b, WanPolicy) and a14b.family == "wan"
    assert list(a14b.experts) == ["transformer", "transformer_2"] and a14b.boundary_timestep == 875.0
    assert a14b.geometry.experts == 2
    high, low = (dict(m.named_parameters())["proj_out.weight"] for m in a14b.experts.values())
    assert not torch.equal(high, low)  # two experts of their own weights
    # The stock rule: t >= boundary -> the high-noise expert, the boundary itself included.
    assert expert_at(torch.tensor(875.0), 875.0) == "transformer"
    assert expert_at(torch.tensor(874.99), 875.0) == "transformer_2"
    assert expert_at(torch.tensor(0.0), None) == "transformer"  # one-transformer checkouts
    sigmas = a14b.sigma_schedule(3, 32, 32)
    assert [a14b.expert_at_sigma(s) for s in sigmas[:-1]] == ["transformer", "transformer_2", "transformer_2"]


def test_each_step_runs_the_expert_timestep_and_guidance_of_the_stock_loop(a14b):
    calls, handles = _record_calls(a14b)
    try:
        latents, ours = _ode_video(a14b, ODE)
        our_calls = list(calls)
        calls.clear()
        stock = a14b.stock_call(PROMPT, ODE, latents)
    finally:
        for handle in handles:
            handle.remove()
    # The stock loop runs cond and uncond apart, ours as one batch of 2 rows: the same expert and timestep a step.
    stock_steps = [(name, float(t[0])) for i, (name, t) in enumerate(calls) if i % 2 == 0]
    assert [(name, float(t[0])) for name, t in our_calls] == stock_steps
    assert [name for name, _ in stock_steps] == ["transformer", "transformer_2", "transformer_2"]
    assert all(t.shape == (2,) for _, t in our_calls)  # Wan2.1-style [B] timesteps without expand_timesteps
    torch.testing.assert_close(ours, stock, atol=1e-5, rtol=0)
    # guidance_scale_2 is what the low-noise steps use: without it they run at guidance_scale.
    _, same_scale = _ode_video(a14b, ODE.model_copy(update={"guidance_scale_2": None}))
    assert float((same_scale - ours).abs().max()) > 1e-3


def test_a_window_across_the_boundary_replays_with_ratio_one(a14b):
    group = sample_group(a14b, a14b.text_processor().tokenize(["a cat", "a dog"]), 2, PARAMS, policy_version=0)
    steps = group.step_indices.tolist()
    assert steps == [0, 1]
    assert [a14b.expert_at_sigma(group.sigmas[i]) for i in steps] == ["transformer", "transformer_2"]
    for k in range(len(steps)):
        ratio = torch.exp(replay_step(a14b, group, k).log_prob - group.log_probs[:, k])
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
    # The replay reads guidance_scale_2 from the trajectory: another low-noise scale moves step 1 only.
    other = dataclasses.replace(group, sampling=PARAMS.model_copy(update={"guidance_scale_2": 6.0}))
    assert torch.equal(replay_step(a14b, other, 0).log_prob, replay_step(a14b, group, 0).log_prob)
    assert float((replay_step(a14b, other, 1).log_prob - group.log_probs[:, 1]).abs().max()) > 1e-4


def _velocities(policy, sigmas):
    """The raw prediction at each sigma for fixed latents and prompt (one step per expert)."""
    latents = torch.randn(1, *policy.latent_shape(32, 32, 5), generator=torch.Generator().manual_seed(0))
    cond = policy.encode_prompts(policy.text_processor().tokenize([PROMPT]))
    with torch.no_grad():
        return [policy.predict(latents, torch.tensor([s]), cond, height=32, width=32) for s in sigmas]


def test_lora_versions_target_either_expert_or_both_and_are_checked_on_each(a14b, tmp_path):
    trainer = TrainableTransformer(_load("tiny-wan22"), LoraSection(rank=2, alpha=4.0))  # experts: None = both
    pipe = trainer.policy.pipeline
    assert set(pipe.transformer.peft_config) == {"flowgrpo"}
    assert set(pipe.transformer_2.peft_config) == {"flowgrpo_transformer_2"}  # peft names kept apart
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in trainer.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=g))
    both = trainer.publishable_state()
    low = {k: v for k, v in both.items() if k.startswith("transformer_2.")}
    high = {k: v for k, v in both.items() if not k.startswith("transformer_2.")}
    assert low and high and len(low) == len(high)  # one adapter per expert, its names prefixed
    store = WeightStore(tmp_path / "weights")
    for version, tensors in ((1, low), (2, both), (3, high)):
        store.publish(version, tensors, kind="lora", lora=trainer.spec)
    assert len({store.published_hash(v) for v in (1, 2, 3)}) == 3

    sigma_high, sigma_low = 1.0, float(a14b.sigma_schedule(3, 32, 32)[1])
    versions = PolicyVersions(a14b, store)
    try:
        base = _velocities(a14b, (sigma_high, sigma_low))
        for version, moved in ((1, (False, True)), (2, (True, True)), (3, (True, False)), (0, (False, False))):
            versions.ensure(version)
            assert versions.current_hash == store.published_hash(version)
            now = _velocities(a14b, (sigma_high, sigma_low))
            assert [not torch.equal(a, b) for a, b in zip(now, base)] == list(moved), version
        # The read-back check and the content hash cover the low-noise expert's adapter too.
        versions.ensure(2)
        weights = store.load(2)
        assert check_held(a14b.experts, weights, replica="test") == store.published_hash(2)
        lora_a = next(p for n, p in a14b.pipeline.transformer_2.named_parameters() if "flowgrpo_transformer_2" in n)
        with torch.no_grad():
            lora_a.add_(1.0)
        with pytest.raises(WeightMismatchError, match=r"transformer_2\."):
            check_held(a14b.experts, weights, replica="test")
        with torch.no_grad():
            lora_a.sub_(1.0)
        changed = {**both, next(iter(low)): next(iter(low.values())) + 1.0}
        assert content_hash(changed, trainer.spec) != store.published_hash(2)
    finally:
        versions.ensure(0)


def test_trainer_lora_experts_is_validated(a14b, ti2v):
    from serve_app.trainer.config import load_trainer_config

    assert list(trained_experts(a14b, LoraSection(experts=["transformer_2"]))) == ["transformer_2"]
    assert list(trained_experts(a14b, LoraSection())) == ["transformer", "transformer_2"]
    with pytest.raises(ValueError, match=r"\['transformer_2'\], which this wan checkpoint lacks; it has "
                                         r"\['transformer'\]"):
        trained_experts(ti2v, LoraSection(experts=["transformer_2"]))
    for bad, message in ((["transformer", "transformer"], "must not repeat"), (["high"], "transformer_2"),
                         ([], "at least 1")):
        with pytest.raises(ValidationError, match=message):
            LoraSection(experts=bad)
    cfg = load_trainer_config("trainer/flowgrpo", ["model=tiny_wan22", "reward=video_brightness",
                                                   "sampling.num_frames=5", "trainer.lora.experts=[transformer_2]"])
    assert cfg.model.embedded == "tiny-wan22" and cfg.trainer.lora.experts == ["transformer_2"]


def test_per_token_timesteps_are_the_stock_pipelines(ti2v):
    assert list(ti2v.experts) == ["transformer"] and ti2v.expand_timesteps and ti2v.boundary_timestep is None
    calls, handles = _record_calls(ti2v)
    params = ODE.model_copy(update={"guidance_scale_2": None})
    try:
        latents, _ = _ode_video(ti2v, params)
        ours = list(calls)
        calls.clear()
        ti2v.stock_call(PROMPT, params, latents)
    finally:
        for handle in handles:
            handle.remove()
    # [rows, tokens]: 2 latent frames of one 2x2-patch token each; every token at the step's timestep.
    assert [t.shape for _, t in ours] == [(2, 2)] * 3 and [t.shape for _, t in calls] == [(1, 2)] * 6
    for i, (_, t) in enumerate(ours):
        assert torch.equal(t, calls[2 * i][1].expand(2, -1))
    with pytest.raises(InvalidRequestError, match="two-expert") as info:
        sample_group(ti2v, ti2v.text_processor().tokenize(["a cat"]), 1, PARAMS, policy_version=0)
    assert info.value.field == "sampling.guidance_scale_2"


def test_the_ti2v_geometry_counts_its_latent_frames_in_chunks_and_work(ti2v):
    pipe = ti2v.pipeline
    assert (pipe.vae_scale_factor_spatial, pipe.vae.config.z_dim, pipe.vae.config.patch_size) == (16, 48, 2)
    geometry = ti2v.geometry
    assert geometry.spatial_multiple == 32  # VAE factor 16 x patch 2
    assert ti2v.latent_shape(32, 32, 5) == (48, 2, 2, 2) and ti2v.latent_shape(64, 32, 9) == (48, 3, 4, 2)
    assert geometry.tokens(64, 32, 9) == 3 * 2 * 1
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        ti2v.check_size(48, 32, 5)
    planner = RolloutPlanner(ti2v.text_processor(), IngressConfig(chunk_size=4), SamplingParams(num_steps=3,
                             sde_window_range=(0, 1)), geometry, max_work=100)
    assert planner.samples_per_chunk(SamplingParams(num_frames=9, num_steps=3, sde_window_range=(0, 1))) == 1
    plan = planner.plan(RolloutRequest(prompts=["a", "b"], group_size=2, seed=1, sampling={"num_frames": 5}))
    assert [len(c) for c in plan.chunks] == [2, 2]  # 2 samples of 2 latent frames fill a chunk of 4
    assert geometry.experts == 1
    with pytest.raises(InvalidRequestError, match="two-expert") as info:  # refused before any replica sees it
        planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"num_frames": 5, "guidance_scale_2": 2.0}))
    assert info.value.field == "sampling.guidance_scale_2"
    # 4 samples x 3 steps x 8 tokens (2 latent frames of 2x2 tokens at 64 px) x 2 (CFG) = 192 > 100.
    with pytest.raises(RequestTooLargeError, match=r"8 latent tokens \(2 latent frames of 5\) x 2 \(true CFG\) = 192"):
        planner.plan(RolloutRequest(prompts=["a", "b"], group_size=2, sampling={"num_frames": 5, "height": 64,
                                                                                  "width": 64}))


def test_image_to_video_and_incomplete_two_expert_checkouts_are_refused_naming_what_is_missing(a14b):
    parts = a14b.pipeline.components

    def refused(match, **changes):
        ratio = changes.pop("boundary_ratio", 0.875)
        pipe = WanPipeline(**{**parts, **changes}, boundary_ratio=ratio)
        with pytest.raises(ValueError, match=match):
            WanPolicy(pipe, device=a14b.device, dtype=a14b.dtype)

    refused(r"no `transformer_2`: the low-noise expert", transformer_2=None)
    refused(r"no boundary_ratio in model_index.json", boundary_ratio=None)
    config = dict(a14b.pipeline.transformer.config)
    refused(r"transformer.config.image_dim = 16: .*image-to-video",
            transformer=WanTransformer3DModel.from_config({**config, "image_dim": 16}))
    refused(r"transformer_2.config in_channels/out_channels = 36/4, the VAE's z_dim 4",
            transformer_2=WanTransformer3DModel.from_config({**config, "in_channels": 36}))


def test_the_health_probe_runs_both_experts(a14b):
    from serve_app.serving.engine import DiffusersEngine

    assert [a14b.expert_at_sigma(s) for s in a14b.probe_sigmas] == ["transformer", "transformer_2"]
    engine = DiffusersEngine(a14b)
    engine.check_health()
    bias = a14b.pipeline.transformer_2.proj_out.bias
    kept = bias.detach().clone()
    with torch.no_grad():
        bias.fill_(float("nan"))  # a broken low-noise expert: the high-noise one alone would pass
    try:
        with pytest.raises(RuntimeError, match="non-finite"):
            engine.check_health()
    finally:
        with torch.no_grad():
            bias.copy_(kept)
