"""The plain classes under the deployments, without Ray: planner -> engine -> assembler."""

import dataclasses

import pytest
import torch

from serve_app.serving.aggregator import TrajectoryAssembler, batch_order
from serve_app.serving.coordinator import RolloutCoordinator, engine_sample_call
from serve_app.config import AdvantageConfig, IngressConfig
from serve_app.serving.engine import DiffusersEngine
from serve_app.errors import (
    GroupIncompleteError,
    InvalidRequestError,
    NumericalError,
    PolicyVersionError,
    RequestTooLargeError,
)
from serve_app.flowgrpo.sampler import sample_group
from serve_app.serving.ingress import RolloutPlanner
from serve_app.policies.base import ImageGeometry
from serve_app.rewards import CompositeReward, RewardError, RewardSpec
from serve_app.schemas import ChunkHeader, RolloutRequest, SamplingParams, Trajectory
from serve_app.weights import LoraSpec, WeightStore

from tests.collect import collect

SAMPLING = SamplingParams(height=32, width=32, num_steps=4, guidance_scale=4.0, noise_level=1.0,
                          sde_window_size=2, sde_window_range=(0, 2))


@pytest.fixture(scope="module")
def planner(tiny_policy):
    limits = IngressConfig(max_prompts=4, max_prompt_chars=50, max_group_size=8, max_samples=16, chunk_size=3)
    return RolloutPlanner(tiny_policy.text_processor(), limits, SAMPLING, tiny_policy.geometry, max_work=2**22)


@pytest.fixture(scope="module")
def engine(tiny_policy, tmp_path_factory):
    return DiffusersEngine(tiny_policy, WeightStore(tmp_path_factory.mktemp("weights")))


@pytest.fixture(scope="module")
def assembler():
    return TrajectoryAssembler(CompositeReward([RewardSpec(name="brightness", args={"target": 0.8})]), AdvantageConfig())


def test_plan_chunks_cover_every_sample_once_with_derived_seeds(planner):
    plan = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=4, seed=3))
    assert [len(c) for c in plan.chunks] == [3, 3, 2]
    pairs = [(int(p), int(s)) for c in plan.chunks for p, s in zip(c.prompt_index, c.sample_index)]
    assert sorted(pairs) == [(p, s) for p in range(2) for s in range(4)]
    again = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=4, seed=3))
    assert torch.equal(torch.cat([c.seeds for c in plan.chunks]), torch.cat([c.seeds for c in again.chunks]))
    # The chunk that straddles two groups carries both prompts, each once.
    middle = plan.chunks[1]
    assert [p.text for p in middle.prompts] == ["a cat", "a dog"]
    assert middle.prompt_slot.tolist() == [0, 1, 1]
    assert {c.window_start for c in plan.chunks} == {plan.chunks[0].window_start}
    # Config defaults fill what the request left unset.
    assert middle.sampling.num_steps == 4 and middle.sampling.seed == 3


def test_request_sampling_overrides_config_defaults(planner):
    plan = planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"noise_level": 0.5}))
    assert plan.chunks[0].sampling.noise_level == 0.5 and plan.chunks[0].sampling.num_steps == 4


@pytest.mark.parametrize(
    ("request_kwargs", "error", "field"),
    [
        ({"prompts": ["  "], "group_size": 2}, InvalidRequestError, "prompts[0]"),
        ({"prompts": ["x" * 51], "group_size": 2}, InvalidRequestError, "prompts[0]"),
        ({"prompts": ["a"] * 5, "group_size": 2}, RequestTooLargeError, "prompts"),
        ({"prompts": ["a"], "group_size": 9}, InvalidRequestError, "group_size"),
        ({"prompts": ["a", "b", "c"], "group_size": 8}, RequestTooLargeError, "group_size"),
    ],
)
def test_plan_rejects_bad_requests_naming_the_field(planner, request_kwargs, error, field):
    with pytest.raises(error) as info:
        planner.plan(RolloutRequest(**request_kwargs))
    assert info.value.field == field


def test_threads_tokenize_concurrently_without_errors(planner):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"prompt number {i} " + "word " * (i % 13) for i in range(200)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: planner.text_processor.tokenize([p])[0].token_ids["tokenizer"], prompts))
    single = [planner.text_processor.tokenize([p])[0].token_ids["tokenizer"] for p in prompts]
    assert all(torch.equal(a, b) for a, b in zip(results, single))


def test_engine_and_assembler_reproduce_the_in_process_rollout(planner, engine, assembler, tiny_policy):
    request = RolloutRequest(prompts=["a cat", "a dog"], group_size=4, seed=11)
    plan = planner.plan(request)
    coordinator = RolloutCoordinator.in_process(assembler, sample=engine_sample_call(engine))
    batch = coordinator.run_sync(plan.chunks, plan.prompts, plan.group_size, request_id=plan.request_id)
    reference = sample_group(
        tiny_policy, planner.text_processor.tokenize(plan.prompts), 4, plan.chunks[0].sampling, policy_version=0
    )
    t = batch.trajectory
    assert t.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(t.seeds, reference.seeds)
    # Different batch composition changes fp32 matmul blocking: differences of a few ulp, not more.
    torch.testing.assert_close(t.latents, reference.latents, atol=1e-5, rtol=0)
    torch.testing.assert_close(t.log_probs, reference.log_probs, atol=1e-6, rtol=0)
    assert len(t.prompt_embeds) == 2 and t.embed_row.tolist() == t.prompt_index.tolist()
    # Advantages are group-relative: zero mean per group.
    assert batch.advantages.view(2, 4).mean(dim=1).abs().max() < 1e-5
    assert set(batch.rewards) == {"brightness", "total"}
    assert batch.metrics["num_samples"] == 8.0


def test_engine_fuses_chunks_into_one_batch_with_identical_results(planner, engine):
    plan = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=3, seed=5))
    fused, stats = engine.generate(plan.chunks)
    assert len(stats) == 1 and stats[0].images == 6
    separate = [engine.generate([c])[0][0] for c in plan.chunks]
    for a, b in zip(fused, separate):
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=0)
        assert torch.equal(a.seeds, b.seeds)


def test_chunks_of_requests_with_other_seeds_fuse_and_keep_their_own_sampling(planner, engine):
    # Two requests alike but for their seed share a forward batch; each chunk's trajectory must still
    # carry its own request's params, or merging a request's chunks (some fused with the other
    # request, some not) fails as "different sampling".
    first = planner.plan(RolloutRequest(prompts=["a cat"], group_size=2, seed=1)).chunks[0]
    second = planner.plan(RolloutRequest(prompts=["a dog"], group_size=4, seed=2)).chunks  # chunks of 3 and 1
    head, tail = (dataclasses.replace(c, window_start=first.window_start) for c in second)  # drawn per request
    results, stats = engine.generate([first, head])
    assert len(stats) == 1 and stats[0].images == 5
    assert [r.sampling.seed for r in results] == [1, 2]
    (rest,), _ = engine.generate([tail])
    merged = Trajectory.cat([results[1], rest])  # raises if the chunks' stamps or sampling differ
    header, rows = batch_order([ChunkHeader.of(results[1]), ChunkHeader.of(rest)], 1, 4)
    assert merged.sampling == head.sampling and header.sample_index[rows].tolist() == [0, 1, 2, 3]


def test_planner_and_engine_reject_an_unpublished_version(planner, engine):
    # The planner checks before fan-out; the engine still refuses a chunk that names a missing version.
    with pytest.raises(PolicyVersionError, match="policy version 7 does not exist; available: 0"):
        planner.plan(RolloutRequest(prompts=["a"], group_size=1, policy_version=7))
    chunk = planner.plan(RolloutRequest(prompts=["a"], group_size=1)).chunks[0]
    (result,), _ = engine.generate([dataclasses.replace(chunk, policy_version=7)])
    assert isinstance(result, PolicyVersionError) and "version 7" in str(result)


def test_a_failing_chunk_in_a_fused_batch_fails_alone(planner, engine):
    good = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=3, seed=5)).chunks
    bad = planner.plan(RolloutRequest(prompts=["a red house"], group_size=2, seed=6)).chunks[0]
    # Token ids without the model's prompt template: this chunk's encoding raises, the others' does not.
    broken_tokens = dataclasses.replace(bad.prompts[0], token_ids={"tokenizer": torch.tensor([1, 2, 3])})
    bad = dataclasses.replace(bad, prompts=[broken_tokens])
    results, _ = engine.generate([good[0], bad, good[1]])
    assert isinstance(results[1], ValueError) and "prompt template" in str(results[1])
    alone = [engine.generate([c])[0][0] for c in good]
    for fused, reference in zip((results[0], results[2]), alone):
        # Another batch composition changes fp32 matmul blocking: a few ulp, as in the fusing test above.
        torch.testing.assert_close(fused.latents, reference.latents, atol=1e-5, rtol=0)


def test_non_finite_samples_are_a_typed_error(planner, own_policy):
    engine = DiffusersEngine(own_policy)
    weight = next(p for n, p in own_policy.transformer.named_parameters() if n.endswith("proj_out.weight"))
    with torch.no_grad():
        weight.fill_(float("inf"))
    (result,), _ = engine.generate(planner.plan(RolloutRequest(prompts=["a"], group_size=2, seed=1)).chunks)
    assert isinstance(result, NumericalError) and "non-finite" in str(result)


def test_sizes_the_model_cannot_take_and_work_over_budget_fail_before_fan_out(planner, tiny_policy):
    for sampling, field in (({"height": 36}, "sampling.height"), ({"width": 100000}, "sampling.width"),
                            ({"height": 2**63}, "sampling.height")):
        with pytest.raises(InvalidRequestError) as info:
            planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling=sampling))
        assert info.value.field == field, (sampling, info.value)
    assert tiny_policy.geometry.max_side == 4096 * 8  # the RoPE table's 4096 positions x 8 px each
    with pytest.raises(InvalidRequestError, match="at most 32768 px"):
        tiny_policy.geometry.check(32768 + 8, 32)
    narrow = RolloutPlanner(tiny_policy.text_processor(), IngressConfig(), SAMPLING,
                            ImageGeometry("qwen_image", 8, 256), max_work=2**22)
    with pytest.raises(InvalidRequestError, match="at most 256 px for qwen_image") as info:
        narrow.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"width": 264}))
    assert info.value.field == "sampling.width"
    # Work: 2 x 8 samples x 4 steps x 1024 tokens (256 px) x 2 (CFG) = 131072 <= 2^22; 16x that is not.
    small = RolloutPlanner(tiny_policy.text_processor(), IngressConfig(max_group_size=64, max_samples=1024),
                           SAMPLING, tiny_policy.geometry, max_work=131072)
    small.check_work(RolloutRequest(prompts=["a", "b"], group_size=8), SAMPLING.model_copy(update={"height": 256, "width": 256}))
    with pytest.raises(RequestTooLargeError, match="exceeds the model's budget of 131072") as info:
        small.plan(RolloutRequest(prompts=["a", "b"], group_size=8, sampling={"height": 256, "width": 512}))
    assert info.value.field == "sampling" and info.value.http_status == 413


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({"prompts": ["a \ud800 circle"], "group_size": 1}, "prompts[0]"),
        ({"prompts": ["a"], "group_size": 1, "sampling": {"negative_prompt": "bad \udfff"}}, "sampling.negative_prompt"),
        ({"prompts": ["a"], "group_size": 1, "sampling": {"guidance_scale": float("inf")}}, "sampling.guidance_scale"),
        ({"prompts": ["a"], "group_size": 1, "sampling": {"guidance_scale": 1e308}}, "sampling.guidance_scale"),
        ({"prompts": ["a"], "group_size": 1, "sampling": {"noise_level": float("nan")}}, "sampling.noise_level"),
    ],
)
def test_unusable_text_and_floats_are_rejected_naming_the_field(planner, request_kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        planner.plan(RolloutRequest(**request_kwargs))
    assert info.value.field == field


def test_merge_rejects_missing_and_duplicated_samples(planner, engine):
    plan = planner.plan(RolloutRequest(prompts=["a", "b"], group_size=3, seed=1))
    chunks = engine.generate(plan.chunks)[0]
    headers = [ChunkHeader.of(c) for c in chunks]
    with pytest.raises(GroupIncompleteError, match="missing"):
        batch_order(headers[:-1], 2, 3)
    with pytest.raises(GroupIncompleteError, match="duplicated"):
        batch_order([*headers, headers[0]], 2, 3)


def test_failing_reward_names_reward_and_prompt(planner, engine):
    def broken(images, prompts):
        raise RuntimeError("reward server down")

    import sys
    import types

    module = types.ModuleType("broken_reward_mod")
    module.broken = broken
    sys.modules["broken_reward_mod"] = module
    try:
        failing = TrajectoryAssembler(CompositeReward([RewardSpec(name="broken_reward_mod:broken")]), AdvantageConfig())
        plan = planner.plan(RolloutRequest(prompts=["a red cube"], group_size=2, seed=1))
        with pytest.raises(RewardError, match="a red cube") as info:
            collect(failing, engine.generate(plan.chunks)[0], plan.prompts, 2)
        assert "broken" in str(info.value)
    finally:
        del sys.modules["broken_reward_mod"]


def test_request_sampling_is_validated_after_the_app_defaults_are_merged(tiny_policy):
    # The app's window range [0, 2) allows 4 steps; the class default (0, 5) would not.
    app_sampling = SAMPLING.model_copy(update={"num_steps": 10})
    planner = RolloutPlanner(tiny_policy.text_processor(), IngressConfig(), app_sampling, tiny_policy.geometry, max_work=2**22)
    plan = planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"num_steps": 4}))
    assert plan.chunks[0].sampling.num_steps == 4 and plan.chunks[0].sampling.sde_window_range == (0, 2)
    with pytest.raises(InvalidRequestError) as info:
        planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"num_steps": 2}))
    # The error names the field and the merged values it compared.
    assert info.value.field == "sampling"
    assert "sde_window_range=(0, 2)" in info.value.message and "got num_steps=2" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"noise_level": -1}))
    assert info.value.field == "sampling.noise_level" and "(got -1" in info.value.message
    # A step noise too small for the float32 log-density (non-finite from about 1e-30) is the request's error.
    with pytest.raises(InvalidRequestError) as info:
        planner.plan(RolloutRequest(prompts=["a"], group_size=1, sampling={"noise_level": 1.7e-247}))
    assert info.value.field == "sampling.noise_level" and "at least 1e-06" in info.value.message


@pytest.fixture
def own_policy(tiny_qwen_dir):
    """A policy of its own: these tests install adapters, which must not leak into the shared one."""
    from serve_app.policies import load_policy

    return load_policy(tiny_qwen_dir, family="qwen_image")


def test_latest_is_resolved_once_per_request(own_policy, assembler, tmp_path):
    tiny_policy = own_policy
    store = WeightStore(tmp_path / "weights")
    planner = RolloutPlanner(
        tiny_policy.text_processor(), IngressConfig(chunk_size=2), SAMPLING, tiny_policy.geometry, max_work=2**22, store=store
    )
    assert planner.plan(RolloutRequest(prompts=["a"], group_size=1)).policy_version == 0
    lora = {k: v for k, v in _lora_state(tiny_policy).items()}
    store.publish(1, lora, kind="lora", lora=_SPEC)
    plan = planner.plan(RolloutRequest(prompts=["a cat", "a dog"], group_size=2, seed=4))
    assert plan.policy_version == 1 and {c.policy_version for c in plan.chunks} == {1}
    # A version published while the request runs does not split it: every chunk runs at 1.
    versions_engine = DiffusersEngine(tiny_policy, store)
    first = versions_engine.generate(plan.chunks[:1])[0]
    store.publish(2, lora, kind="lora", lora=_SPEC)
    rest = versions_engine.generate(plan.chunks[1:])[0]
    batch = collect(assembler, [*first, *rest], plan.prompts, plan.group_size)
    assert batch.policy_version == 1


_SPEC = LoraSpec(rank=2, alpha=2.0, target_modules=["to_q"])


def _lora_state(policy) -> dict[str, torch.Tensor]:
    """The tensors of a nonzero rank-2 adapter on to_q, as the trainer would publish them."""
    import copy

    from peft import get_peft_model_state_dict

    transformer = copy.deepcopy(policy.transformer)
    transformer.add_adapter(_SPEC.peft_config(), adapter_name="published")
    state = get_peft_model_state_dict(transformer, adapter_name="published")
    return {k: torch.full_like(v, 0.01) for k, v in state.items()}


def test_health_check_runs_a_forward_and_fails_on_a_broken_replica(own_policy, tmp_path):
    tiny_policy = own_policy
    store = WeightStore(tmp_path / "weights")
    engine = DiffusersEngine(tiny_policy, store)
    engine.check_health()  # a one-step forward of the smallest image: finite
    store.publish(1, _lora_state(tiny_policy), kind="lora", lora=_SPEC)
    engine.prefetch(1)
    engine.check_health()
    # The version it holds disappears from the store: the replica can no longer be trusted to serve it.
    import shutil

    shutil.rmtree(store.root / "v00000001")
    with pytest.raises(RuntimeError, match="version 1 is loaded but gone"):
        engine.check_health()
    engine.versions.ensure(0)
    # Weights that compute NaN fail the probe.
    weight = next(p for n, p in tiny_policy.transformer.named_parameters() if n.endswith("proj_out.weight"))
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.fill_(float("nan"))
        with pytest.raises(RuntimeError, match="non-finite"):
            engine.check_health()
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    engine.check_health()


@pytest.mark.parametrize("config", ["tiny_qwen_image_edit", "tiny_qwen_image_edit_plus", "tiny_flux_kontext"])
def test_the_health_probe_of_an_image_conditioned_family_conditions_on_gray_input_images(config, tmp_path):
    """The probe encodes the fewest input images the family takes (and, for Edit-Plus, their encoder copies)."""
    from serve_app.config import load_config
    from serve_app.policies import load_configured_policy

    policy = load_configured_policy(load_config("diffusion_rollout", [f"model={config}"]).model)
    engine = DiffusersEngine(policy, WeightStore(tmp_path / "weights"))
    engine.check_health()
    assert engine._probe_conditioning is not None and engine._probe_conditioning.has_images
