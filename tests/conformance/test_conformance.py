"""The engine contract's invariants (serve_app/serving/engine_contract.py), checked for every engine x checkpoint
(each family, and Wan2.2's layouts) on CPU: seed-only noise, noise 0 == the stock pipeline, replay ratio 1,
version pinning. A future engine is added to conftest.ENGINES and must pass this file unchanged;
FLAGGED_ENGINES must fail it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from serve_app.config import IngressConfig
from serve_app.serving.engine_contract import REPLAY_TOLERANCE, EmbeddedChunk, SamplingEngine, replay_verdict
from serve_app.errors import PolicyVersionError
from serve_app.flowgrpo.sampler import encode_conditioning, initial_latents
from serve_app.flowgrpo.seeding import sample_generators
from serve_app.serving.ingress import RolloutPlanner
from serve_app.media import to_uint8
from serve_app.schemas import RolloutRequest, SamplingParams
from serve_app.weights import BASE_HASH, LoraSpec, WeightStore
from serve_app.weights.versions import content_hash

from tests.conformance.conftest import (
    CHECKPOINTS,
    ENGINES,
    FLAGGED_ENGINES,
    checkpoint_inputs,
    checkpoint_sampling,
    family_request,
)

# True CFG on, a 2-step SDE window that always starts at step 0 (so chunks of different requests fuse).
SAMPLING = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=4.0, noise_level=1.0,
                          sde_window_size=2, sde_window_range=(0, 1))
PROMPT = "a red circle on a blue square"
PAIRS = [(engine, checkpoint) for engine in ENGINES for checkpoint in CHECKPOINTS]


def _planner(engine_policy, sampling: SamplingParams, store=None) -> RolloutPlanner:
    # Two samples a chunk (one group): chunk_size counts latent frames, so a video's count as several.
    chunk_size = 2 * engine_policy.geometry.latent_frames(sampling.num_frames)
    return RolloutPlanner(engine_policy.text_processor(), IngressConfig(chunk_size=chunk_size), sampling,
                          engine_policy.geometry, max_work=2**22, store=store)


def _chunks(planner: RolloutPlanner, prompts: list[str], seed: int, version: int | None = 0):
    request = RolloutRequest(prompts=prompts, group_size=2, seed=seed, policy_version=version,
                             **family_request(planner.geometry.family, len(prompts)))
    return planner.plan(request).chunks


def _one(engine, chunk):
    (result,), _ = engine.generate([chunk])
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_the_ingress_text_processor_is_the_policys_and_tokenizes_alike(conformance_policies, checkpoint):
    """The ingress loads a family's text side by its row (serve_app.families: text_processor), without weights or
    pipeline code: the same class as the policy's own, the same token ids."""
    from serve_app.models import ensure_embedded_model
    from serve_app.policies import load_text_processor

    policy = conformance_policies(checkpoint)
    alone = load_text_processor(ensure_embedded_model(checkpoint), family=CHECKPOINTS[checkpoint])
    assert type(alone) is type(policy.text_processor())
    prompts = [PROMPT, "  two &amp; dogs  ", "a cat " * 40]
    for a, b in zip(alone.tokenize(prompts), policy.text_processor().tokenize(prompts)):
        assert a.token_ids.keys() == b.token_ids.keys()
        assert all(torch.equal(a.token_ids[k], b.token_ids[k]) for k in a.token_ids)


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_a_samples_noise_depends_on_its_seed_only(conformance_policies, engine_name, checkpoint):
    policy = conformance_policies(checkpoint)
    engine = ENGINES[engine_name](policy)
    assert isinstance(engine, SamplingEngine) and engine.family == CHECKPOINTS[checkpoint]
    assert engine.geometry == policy.geometry
    planner = _planner(policy, checkpoint_sampling(checkpoint, SAMPLING))
    cat, dog = _chunks(planner, ["a cat", "a dog"], seed=5)
    (house,) = _chunks(planner, ["a red house"], seed=9)
    alone = _one(engine, dog)
    fused, stats = engine.generate([house, cat, dog])
    assert len(stats) == 1 and stats[0].images == 6  # one forward batch of three requests' samples
    within = fused[2]
    assert torch.equal(within.seeds, alone.seeds)
    # Another batch composition changes fp32 matmul blocking: a few ulp, never the noise.
    torch.testing.assert_close(within.latents, alone.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(within.log_probs, alone.log_probs, atol=1e-6, rtol=0)
    assert int((within.images.int() - alone.images.int()).abs().max()) <= 1
    # ... and the seed does matter: two samples of one prompt differ by their seeds alone.
    assert float((alone.latents[0] - alone.latents[1]).abs().max()) > 1e-2
    # The embeddings entry samples exactly what the token-ids entry does.
    conditioning = encode_conditioning(policy, dog.prompts, dog.prompt_slot, dog.negative_prompt, dog.sampling)
    embedded = engine.generate_embedded(EmbeddedChunk(
        conditioning, dog.sampling, dog.seeds, dog.window_start, dog.policy_version, dog.prompt_index, dog.sample_index,
    ))
    torch.testing.assert_close(embedded.latents, alone.latents, atol=1e-6, rtol=0)
    torch.testing.assert_close(embedded.log_probs, alone.log_probs, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def noise_zero_case(conformance_policies):
    """(checkpoint, guidance) -> (params, a one-sample chunk at noise 0, the stock pipeline's float images from the
    initial latents the contract derives from its seed), computed once per module."""
    cases = {}

    def get(checkpoint: str, guidance_scale: float):
        if (checkpoint, guidance_scale) not in cases:
            policy = conformance_policies(checkpoint)
            params = checkpoint_sampling(checkpoint, SAMPLING).model_copy(
                update={"noise_level": 0.0, "guidance_scale": guidance_scale, "sde_window_size": None})
            planner = _planner(policy, params)
            (chunk,) = planner.plan(RolloutRequest(prompts=[PROMPT], group_size=1, seed=11, policy_version=0,
                                                   **family_request(CHECKPOINTS[checkpoint], 1))).chunks
            latents = initial_latents(policy, params, sample_generators(chunk.seeds))
            stock = policy.stock_call(PROMPT, params, latents, **checkpoint_inputs(checkpoint))
            frames = () if params.num_frames == 1 else (params.num_frames,)
            assert stock.shape == (1, *frames, 3, 32, 32) and float(stock.std()) > 1e-3  # not a blank image
            cases[checkpoint, guidance_scale] = (params, chunk, latents, stock)
        return cases[checkpoint, guidance_scale]

    return get


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_noise_zero_is_the_stock_pipeline(conformance_policies, noise_zero_case, engine_name, checkpoint,
                                          guidance_scale):
    params, chunk, _, stock = noise_zero_case(checkpoint, guidance_scale)
    trajectory = _one(ENGINES[engine_name](conformance_policies(checkpoint)), chunk)
    assert torch.equal(trajectory.log_probs, torch.zeros(1, params.num_steps - 1))
    # uint8 images: equal, except where the stock value sits on a rounding boundary (a 1e-5 difference
    # may round either way there).
    scaled = stock.float().clamp(0, 1) * 255.0
    differs = trajectory.images != to_uint8(stock)
    on_boundary = ((scaled - scaled.floor()) - 0.5).abs() < 1e-3
    assert not bool((differs & ~on_boundary).any()), f"{int(differs.sum())} pixels differ from the stock pipeline"


@pytest.mark.parametrize("guidance_scale", [1.0, 4.0])
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_the_family_sampler_at_noise_zero_is_the_stock_pipeline_in_float(conformance_policies, noise_zero_case,
                                                                          ode_sample, checkpoint, guidance_scale):
    """What the diffusers engine runs, before the uint8 cast: equal to the stock `__call__` to 1e-5."""
    policy = conformance_policies(checkpoint)
    params, chunk, latents, stock = noise_zero_case(checkpoint, guidance_scale)
    image, log_probs = ode_sample(policy, PROMPT, params, latents, sample_generators(chunk.seeds),
                                  **checkpoint_inputs(checkpoint))
    torch.testing.assert_close(image, stock, atol=1e-5, rtol=0)
    assert torch.equal(log_probs, torch.zeros(1, params.num_steps - 1))


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_the_trainers_replay_gives_ratio_one(conformance_policies, engine_name, checkpoint):
    policy = conformance_policies(checkpoint)
    planner = _planner(policy, checkpoint_sampling(checkpoint, SAMPLING))
    fused, _ = ENGINES[engine_name](policy).generate(_chunks(planner, ["a cat", "a dog"], seed=3))
    for trajectory in fused:
        verdict = replay_verdict(policy, trajectory)
        assert verdict.ok, verdict.message
        assert verdict.summary.count == 2 * 2 and verdict.summary.max <= REPLAY_TOLERANCE


@pytest.mark.parametrize("flagged", list(FLAGGED_ENGINES))
@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
def test_the_suite_flags_an_engine_whose_replay_differs(conformance_policies, flagged, checkpoint):
    policy = conformance_policies(checkpoint)
    (chunk,) = _chunks(_planner(policy, checkpoint_sampling(checkpoint, SAMPLING)), ["a cat"], seed=3)
    real = replay_verdict(policy, _one(ENGINES["diffusers"](policy), chunk))
    fake = replay_verdict(policy, _one(FLAGGED_ENGINES[flagged](policy), chunk))
    assert real.ok, real.message
    assert not fake.ok and "does NOT reproduce" in fake.message and "tolerance 1e-06" in fake.message
    # Flagged by a wide margin, not by noise at the tolerance.
    assert fake.summary.max > 10 * REPLAY_TOLERANCE and fake.summary.max > 10 * real.summary.max


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_versions_are_pinned_and_stamped(conformance_policies, engine_name, checkpoint, tmp_path):
    policy = conformance_policies(checkpoint)
    store = WeightStore(tmp_path / "weights")
    engine = ENGINES[engine_name](policy, store)
    planner = _planner(policy, checkpoint_sampling(checkpoint, SAMPLING), store)
    try:
        base = _one(engine, _chunks(planner, ["a cat"], seed=4)[0])
        assert base.policy_version == 0 and base.weights_hash == BASE_HASH
        g = torch.Generator().manual_seed(1)
        perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in policy.transformer.state_dict().items()}
        store.publish(1, perturbed, kind="full")
        v1 = _one(engine, _chunks(planner, ["a cat"], seed=4, version=1)[0])
        assert v1.policy_version == 1 and v1.weights_hash == store.published_hash(1) != BASE_HASH
        assert float((v1.latents[:, -1] - base.latents[:, -1]).abs().max()) > 1e-3
        assert replay_verdict(policy, v1).ok  # ratio 1 at a published version too
        again = _one(engine, _chunks(planner, ["a cat"], seed=4, version=0)[0])
        torch.testing.assert_close(again.latents, base.latents, atol=1e-6, rtol=0)
        unpublished = dataclasses.replace(_chunks(planner, ["a cat"], seed=4)[0], policy_version=5)
        (result,), _ = engine.generate([unpublished])
        assert isinstance(result, PolicyVersionError) and "5" in str(result)
    finally:
        engine.prefetch(0)  # the session's policy goes back to the base weights


def _lora_version(transformer: torch.nn.Module) -> tuple[LoraSpec, dict[str, torch.Tensor]]:
    """A rank-2 adapter of the transformer's last linear layer (every family has one, whatever its names), with
    non-zero A and B so the version changes what the model samples."""
    name, layer = [(n, m) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    g = torch.Generator().manual_seed(1)
    return LoraSpec(rank=2, alpha=2.0, target_modules=[name]), {
        f"{name}.lora_A.weight": 0.3 * torch.randn(2, layer.in_features, generator=g),
        f"{name}.lora_B.weight": 0.3 * torch.randn(layer.out_features, 2, generator=g),
    }


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_lora_versions_are_read_back_pinned_and_stamped(conformance_policies, engine_name, checkpoint, tmp_path):
    policy = conformance_policies(checkpoint)
    store = WeightStore(tmp_path / "weights")
    engine = ENGINES[engine_name](policy, store)
    planner = _planner(policy, checkpoint_sampling(checkpoint, SAMPLING), store)
    spec, tensors = _lora_version(policy.transformer)
    try:
        base = _one(engine, _chunks(planner, ["a cat"], seed=4)[0])
        store.publish(1, tensors, kind="lora", lora=spec)
        stored = store.load(1)  # read back as published, under the hash of its content
        assert stored.kind == "lora" and stored.lora == spec and stored.tensors.keys() == tensors.keys()
        assert all(torch.equal(stored.tensors[k], tensors[k]) for k in tensors)
        assert stored.content_hash == content_hash(tensors, spec) == store.published_hash(1) != BASE_HASH
        v1 = _one(engine, _chunks(planner, ["a cat"], seed=4, version=1)[0])
        assert v1.policy_version == 1 and v1.weights_hash == stored.content_hash
        assert float((v1.latents[:, -1] - base.latents[:, -1]).abs().max()) > 1e-3
        assert replay_verdict(policy, v1).ok  # ratio 1 with the adapter too
        again = _one(engine, _chunks(planner, ["a cat"], seed=4, version=0)[0])
        torch.testing.assert_close(again.latents, base.latents, atol=1e-6, rtol=0)
    finally:
        engine.prefetch(0)  # the session's policy goes back to the base weights


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_dance_steps_replay_to_ratio_one(conformance_policies, engine_name, checkpoint):
    policy = conformance_policies(checkpoint)
    dance = checkpoint_sampling(checkpoint, SAMPLING).model_copy(update={"sde_type": "dance", "noise_level": 0.5})
    fused, _ = ENGINES[engine_name](policy).generate(_chunks(_planner(policy, dance), ["a cat", "a dog"], seed=3))
    for trajectory in fused:
        verdict = replay_verdict(policy, trajectory)
        assert verdict.ok, verdict.message
        assert verdict.summary.count == 2 * 2 and verdict.summary.max <= REPLAY_TOLERANCE


@pytest.mark.parametrize(("engine_name", "checkpoint"), PAIRS)
def test_final_latents_alone_are_the_images_and_depend_on_the_seed_only(conformance_policies, engine_name, checkpoint):
    # DiffusionNFT's rollouts: the ODE by DPM-Solver++(2M) (5 steps: two of them second order), the latents after
    # its first step and the final ones only.
    policy = conformance_policies(checkpoint)
    final = checkpoint_sampling(checkpoint, SAMPLING).model_copy(update={
        "num_steps": 5, "noise_level": 0.0, "ode_solver": "dpm2m", "record": "final", "sde_window_size": None})
    engine = ENGINES[engine_name](policy)
    planner = _planner(policy, final)
    cat, dog = _chunks(planner, ["a cat", "a dog"], seed=5)
    alone = _one(engine, dog)
    fused, _ = engine.generate([cat, dog])
    assert alone.latents.shape[:2] == (len(dog.seeds), 2) and alone.log_probs.shape == (len(dog.seeds), 0)
    assert alone.step_indices.tolist() == []
    torch.testing.assert_close(fused[1].latents, alone.latents, atol=1e-5, rtol=0)
    params = dog.sampling
    conditioning = encode_conditioning(policy, dog.prompts, dog.prompt_slot, dog.negative_prompt, params)
    decoded = to_uint8(policy.decode(alone.latents[:, 1].to(policy.device), height=params.height, width=params.width,
                                     cond=conditioning.prompts.select(conditioning.embed_row)))
    assert torch.equal(decoded.cpu(), alone.images)
