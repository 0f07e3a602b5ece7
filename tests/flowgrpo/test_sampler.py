"""The sampler over the embedded tiny Qwen-Image: stock-pipeline parity, replay, determinism, errors."""

import pytest
import torch

from serve_app.flowgrpo.sampler import (
    Conditioning,
    conditioned_velocity,
    denoise,
    encode_conditioning,
    initial_latents,
    replay_step,
    rollout,
    sample_group,
)
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.media import to_uint8
from serve_app.schemas import SamplingParams


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy


@pytest.fixture(scope="module")
def text(policy):
    return policy.text_processor()


PARAMS = SamplingParams(height=32, width=32, num_steps=6, guidance_scale=4.0, noise_level=1.0,
                        sde_window_size=2, sde_window_range=(0, 3), seed=7)


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
def test_noise_zero_reproduces_the_stock_pipeline(policy, ode_sample, guidance_scale):
    params = PARAMS.model_copy(update={"noise_level": 0.0, "guidance_scale": guidance_scale, "sde_window_size": None})
    prompt = "a red circle on a blue square"
    generators = sample_generators(torch.tensor([123]))
    latents = initial_latents(policy, params, generators)
    stock = policy.pipeline(
        prompt=prompt,
        negative_prompt=" " if guidance_scale > 1 else None,
        true_cfg_scale=guidance_scale,
        height=32, width=32, num_inference_steps=params.num_steps,
        latents=latents.clone(), output_type="pt",
    ).images
    image, log_probs = ode_sample(policy, prompt, params, latents, generators)
    assert image.shape == stock.shape == (1, 3, 32, 32)
    torch.testing.assert_close(image, stock, atol=1e-5, rtol=0)
    assert torch.equal(log_probs, torch.zeros(1, params.num_steps - 1))


def test_trajectory_shapes_and_window(policy, text):
    traj = sample_group(policy, text.tokenize(["a cat", "two green triangles"]), 3, PARAMS, policy_version=0)
    B, K = 6, 2
    assert traj.log_probs.shape == (B, K) and traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all()
    assert traj.latents.shape == (B, K + 1, *policy.latent_shape(32, 32))
    assert traj.images.shape == (B, 3, 32, 32) and traj.images.dtype == torch.uint8
    assert traj.sigmas.shape == (PARAMS.num_steps + 1,) and float(traj.sigmas[-1]) == 0.0
    start = int(traj.step_indices[0])
    assert traj.step_indices.tolist() == [start, start + 1] and 0 <= start < 3
    # Embeddings travel once per prompt, each padded only to the longest prompt of the set.
    assert len(traj.prompt_embeds) == 2
    assert traj.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]  # AABB
    assert traj.embed_row.tolist() == traj.prompt_index.tolist()
    assert traj.sample_index.tolist() == [0, 1, 2, 0, 1, 2]
    assert len(set(traj.seeds.tolist())) == B


def test_full_sde_window_covers_all_steps_but_the_last(policy, text):
    params = PARAMS.model_copy(update={"sde_window_size": None})
    traj = sample_group(policy, text.tokenize(["a cat"]), 2, params, policy_version=0)
    assert traj.step_indices.tolist() == list(range(params.num_steps - 1))
    assert traj.log_probs.shape == (2, params.num_steps - 1)


@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance"])
def test_replay_gives_ratio_one(policy, text, sde_type):
    params = PARAMS.model_copy(update={"sde_type": sde_type})
    traj = sample_group(policy, text.tokenize(["a cat", "a dog on grass"]), 2, params, policy_version=0)
    for k in range(traj.log_probs.shape[1]):
        replayed = replay_step(policy, traj, k)
        torch.testing.assert_close(replayed.log_prob, traj.log_probs[:, k], atol=1e-6, rtol=0)
        ratio = torch.exp(replayed.log_prob - traj.log_probs[:, k])
        torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-6, rtol=0)
    # A replay over a different batch composition (the second sample alone) agrees as well.
    alone = replay_step(policy, traj, 0, rows=torch.tensor([1]))
    torch.testing.assert_close(alone.log_prob, traj.log_probs[1:2, 0], atol=1e-6, rtol=0)


def test_same_seed_same_trajectory_alone_or_in_a_larger_batch(policy, text):
    prompts = text.tokenize(["a cat", "a much longer prompt about a yellow house by the sea"])
    params = PARAMS
    conditioning = encode_conditioning(policy, prompts, torch.tensor([0, 1, 1, 0]), None, params)
    seeds = torch.tensor([11, 22, 33, 44])
    index = torch.arange(4)
    big = rollout(policy, conditioning, seeds, params, window_start=1, prompt_index=index, sample_index=index, policy_version=0, weights_hash="base")
    again = rollout(policy, conditioning, seeds, params, window_start=1, prompt_index=index, sample_index=index, policy_version=0, weights_hash="base")
    assert torch.equal(big.latents, again.latents) and torch.equal(big.log_probs, again.log_probs)

    alone_cond = encode_conditioning(policy, prompts[:1], torch.tensor([0]), None, params)
    one = torch.tensor([0])
    alone = rollout(policy, alone_cond, torch.tensor([44]), params, window_start=1, prompt_index=one, sample_index=one, policy_version=0, weights_hash="base")
    torch.testing.assert_close(alone.latents[0], big.latents[3], atol=1e-6, rtol=0)
    torch.testing.assert_close(alone.log_probs[0], big.log_probs[3], atol=1e-6, rtol=0)
    assert torch.equal(alone.images[0], big.images[3])


def test_different_seeds_differ(policy, text):
    a = sample_group(policy, text.tokenize(["a cat"]), 2, PARAMS, policy_version=0)
    b = sample_group(policy, text.tokenize(["a cat"]), 2, PARAMS.model_copy(update={"seed": 8}), policy_version=0)
    assert not torch.equal(a.latents[:, 0], b.latents[:, 0])
    assert not torch.equal(a.latents[0, 0], a.latents[1, 0])


def test_validation_mode_is_deterministic_ode(policy, text):
    params = PARAMS.for_validation(num_steps=8, seed=5)
    assert params.noise_level == 0.0 and params.num_steps == 8
    traj = sample_group(policy, text.tokenize(["a cat"]), 2, params, policy_version=0)
    assert torch.equal(traj.log_probs, torch.zeros_like(traj.log_probs))
    # Evaluation keeps the rollouts' CFG unless validation.guidance_scale asks for another.
    assert params.guidance_scale == PARAMS.guidance_scale
    guided = PARAMS.for_validation(num_steps=8, seed=5, guidance_scale=2.5)
    assert guided.guidance_scale == 2.5 and guided.model_copy(update={"guidance_scale": params.guidance_scale}) == params


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"num_steps": 0}, "num_steps"),
        ({"sde_window_size": 3, "sde_window_range": (0, 5), "num_steps": 6}, "window"),
        ({"sde_window_range": (3, 2)}, "sde_window_range"),
    ],
)
def test_invalid_sampling_params(update, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{**PARAMS.model_dump(), **update})


def test_size_not_a_multiple_of_the_spatial_factor(policy, text):
    params = PARAMS.model_copy(update={"height": 36})
    with pytest.raises(ValueError, match="multiple of 8"):
        sample_group(policy, text.tokenize(["a cat"]), 1, params, policy_version=0)


def test_group_size_below_one(policy, text):
    with pytest.raises(ValueError, match="group_size"):
        sample_group(policy, text.tokenize(["a cat"]), 0, PARAMS, policy_version=0)


def test_window_start_outside_range(policy, text):
    conditioning = encode_conditioning(policy, text.tokenize(["a cat"]), torch.tensor([0]), None, PARAMS)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="window_start"):
        rollout(policy, conditioning, torch.tensor([1]), PARAMS, window_start=4, prompt_index=one, sample_index=one, policy_version=0, weights_hash="base")


def test_conditioning_rows_pick_each_samples_prompt(policy, text):
    conditioning = encode_conditioning(policy, text.tokenize(["a", "b c d"]), torch.tensor([1, 0]), None, PARAMS)
    assert isinstance(conditioning, Conditioning)
    assert conditioning.negative is not None  # guidance 4 > 1 encodes the default negative prompt once
    assert len(conditioning.negative) == 1


SHARED = PARAMS.model_copy(update={"guidance_scale": 1.0, "sde_window_range": (3, 4), "group_noise": "shared"})


def _count_rows(policy, monkeypatch) -> list[int]:
    """Rows of every transformer forward from here on."""
    rows: list[int] = []
    real = policy.predict

    def counting(latents, *args, **kwargs):
        rows.append(latents.shape[0])
        return real(latents, *args, **kwargs)

    monkeypatch.setattr(policy, "predict", counting)
    return rows


@pytest.mark.parametrize("group_noise", ["independent", "shared"])
def test_shared_group_noise_runs_the_steps_before_the_window_once_per_prompt(policy, text, monkeypatch, group_noise):
    prompts, group_size = text.tokenize(["a cat", "two green triangles"]), 4
    params = SHARED.model_copy(update={"group_noise": group_noise})
    rows = _count_rows(policy, monkeypatch)
    traj = sample_group(policy, prompts, group_size, params, policy_version=0)
    p, g, n, s = len(prompts), group_size, params.num_steps, int(traj.step_indices[0])
    assert s == 3
    assert sum(rows) == (p * s + p * g * (n - s) if group_noise == "shared" else p * g * n)  # 30 vs 48
    at_window = traj.latents[:, 0].view(p, g, -1)
    if group_noise == "shared":  # a group branches at the window: one latent per prompt entering it ...
        assert all(torch.equal(at_window[i, 0], at_window[i, j]) for i in range(p) for j in range(g))
        assert not torch.equal(at_window[0, 0], at_window[1, 0])
        # ... and each sample takes its own step noise from there.
        after = traj.latents[:, 1].view(p, g, -1)
        assert not torch.equal(after[0, 0], after[0, 1])
    else:
        assert not torch.equal(at_window[0, 0], at_window[0, 1])


def test_shared_group_noise_replays_with_ratio_one_and_depends_on_seeds_only(policy, text, tiny_qwen_dir):
    from serve_app.config import IngressConfig
    from serve_app.serving.engine import DiffusersEngine
    from serve_app.serving.ingress import RolloutPlanner
    from serve_app.schemas import RolloutRequest

    reference = sample_group(policy, text.tokenize(["a cat", "a dog"]), 4, SHARED, policy_version=0)
    with torch.no_grad():
        replayed = torch.stack([replay_step(policy, reference, k).log_prob for k in range(reference.log_probs.shape[1])], 1)
    torch.testing.assert_close(replayed, reference.log_probs, atol=1e-6, rtol=0)
    # The service cuts the same request into chunks of 3 (groups split across chunks, fused batches):
    # every sample's trajectory is the in-process one.
    planner = RolloutPlanner(text, IngressConfig(chunk_size=3), SHARED, policy.geometry, max_work=2**22)
    plan = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=4, seed=SHARED.seed))
    chunks, _ = DiffusersEngine(policy).generate(plan.chunks)
    served = torch.cat([c.latents for c in chunks])
    torch.testing.assert_close(served, reference.latents, atol=1e-5, rtol=0)


def test_dpm2m_runs_the_steps_outside_the_window_and_replays_to_ratio_one(policy, text):
    prompts = text.tokenize(["a cat", "two green triangles"])
    late = PARAMS.model_copy(update={"sde_window_range": (3, 4)})  # three deterministic steps before the window
    euler = sample_group(policy, prompts, 2, late, policy_version=0)
    dpm = sample_group(policy, prompts, 2, late.model_copy(update={"ode_solver": "dpm2m"}), policy_version=0)
    assert euler.step_indices.tolist() == dpm.step_indices.tolist() == [3, 4]
    assert not torch.allclose(euler.latents[:, 0], dpm.latents[:, 0], atol=1e-4)
    for k in range(dpm.log_probs.shape[1]):
        torch.testing.assert_close(replay_step(policy, dpm, k).log_prob, dpm.log_probs[:, k], atol=1e-6, rtol=0)


def test_shared_group_noise_runs_the_same_solver_before_the_window(policy, text):
    # The shared prefix (once per group) lands where each sample's own deterministic steps would.
    prompts = text.tokenize(["a cat", "a dog"])
    params = SHARED.model_copy(update={"ode_solver": "dpm2m"})
    shared = sample_group(policy, prompts, 2, params, policy_version=0)
    conditioning = encode_conditioning(policy, prompts, shared.prompt_index, None, params)
    group_seeds = torch.tensor([123, 123, 456, 456])
    prefix_shared = rollout(policy, conditioning, shared.seeds, params, window_start=3, prompt_index=shared.prompt_index,
                            sample_index=shared.sample_index, policy_version=0, weights_hash="base", group_seeds=group_seeds)
    alone = rollout(policy, conditioning, group_seeds, params.model_copy(update={"group_noise": "independent"}),
                    window_start=3, prompt_index=shared.prompt_index, sample_index=shared.sample_index,
                    policy_version=0, weights_hash="base")
    torch.testing.assert_close(prefix_shared.latents[:, 0], alone.latents[:, 0], atol=1e-5, rtol=0)


def test_record_final_keeps_the_first_steps_and_the_final_latents_alone(policy, text):
    prompts = text.tokenize(["a cat", "a dog on grass"])
    ode = PARAMS.model_copy(update={"noise_level": 0.0, "ode_solver": "dpm2m"})
    window = sample_group(policy, prompts, 2, ode, policy_version=0)
    final = sample_group(policy, prompts, 2, ode.model_copy(update={"record": "final"}), policy_version=0)
    assert final.latents.shape == (4, 2, *window.latents.shape[2:])
    assert final.log_probs.shape == (4, 0) and final.step_indices.tolist() == []
    decoded = to_uint8(policy.decode(final.latents[:, 1], height=ode.height, width=ode.width))
    assert torch.equal(decoded, final.images)
    # Every step is the solver's: the same latents after the first step and at the end as a solve by hand.
    conditioning = encode_conditioning(policy, prompts, final.prompt_index, None, ode)
    sigmas = policy.sigma_schedule(ode.num_steps, ode.height, ode.width)
    latents = initial_latents(policy, ode, sample_generators(final.seeds))
    by_hand = denoise(policy, conditioning, latents, sigmas, [], ode, sample_generators(final.seeds)).final_latents
    torch.testing.assert_close(final.latents[:, 1], by_hand, atol=1e-6, rtol=0)
    velocity = conditioned_velocity(policy, latents, sigmas[0], conditioning, ode)  # the first step is Euler's
    torch.testing.assert_close(final.latents[:, 0], latents + (sigmas[1] - sigmas[0]) * velocity, atol=1e-6, rtol=0)
    # With noise, the SDE steps still run, and still nothing but those two latents is kept.
    noisy = sample_group(policy, prompts, 2, PARAMS.model_copy(update={"record": "final"}), policy_version=0)
    assert noisy.latents.shape == final.latents.shape and noisy.log_probs.shape == (4, 0)
    assert not torch.allclose(noisy.latents, final.latents, atol=1e-3)
    # Samples that share their group's noise share their first step (it runs once per group, before the window).
    shared = sample_group(policy, prompts, 2, ode.model_copy(update={"record": "final", "group_noise": "shared"}),
                          policy_version=0)
    assert torch.equal(shared.latents[0, 0], shared.latents[1, 0]) and torch.equal(shared.latents[0, 1], shared.latents[1, 1])
    assert not torch.equal(shared.latents[0, 0], shared.latents[2, 0])


