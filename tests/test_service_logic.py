"""The plain classes under the deployments, without Ray: planner -> engine -> assembler."""

import pytest
import torch

from serve_app.assembler import TrajectoryAssembler, merge_chunks
from serve_app.config import AdvantageConfig, IngressConfig
from serve_app.engine import RolloutEngine
from serve_app.errors import GroupIncompleteError, InvalidRequestError, PolicyVersionError, RequestTooLargeError
from serve_app.flowgrpo.sampler import sample_group
from serve_app.planner import RolloutPlanner
from serve_app.rewards import CompositeReward, RewardError, RewardSpec
from serve_app.schemas import RolloutRequest, SamplingParams
from serve_app.weights import WeightStore

SAMPLING = SamplingParams(height=32, width=32, num_steps=4, guidance_scale=4.0, noise_level=1.0,
                          sde_window_size=2, sde_window_range=(0, 2))


@pytest.fixture(scope="module")
def planner(tiny_policy):
    limits = IngressConfig(max_prompts=4, max_prompt_chars=50, max_group_size=8, max_samples=16, chunk_size=3)
    return RolloutPlanner(tiny_policy.text_processor(), limits, SAMPLING)


@pytest.fixture(scope="module")
def engine(tiny_policy, tmp_path_factory):
    return RolloutEngine(tiny_policy, WeightStore(tmp_path_factory.mktemp("weights")))


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
    chunk_trajectories = [t for c in plan.chunks for t in engine.generate([c])[0]]
    batch = assembler.assemble(chunk_trajectories, plan.prompts, plan.group_size)
    reference = sample_group(
        tiny_policy, planner.text_processor.tokenize(plan.prompts), 4, plan.chunks[0].sampling
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


def test_engine_rejects_an_unpublished_version(planner, engine):
    plan = planner.plan(RolloutRequest(prompts=["a"], group_size=1, policy_version=7))
    with pytest.raises(PolicyVersionError, match="version 7"):
        engine.generate(plan.chunks)


def test_merge_rejects_missing_and_duplicated_samples(planner, engine):
    plan = planner.plan(RolloutRequest(prompts=["a", "b"], group_size=3, seed=1))
    chunks = engine.generate(plan.chunks)[0]
    with pytest.raises(GroupIncompleteError, match="missing"):
        merge_chunks(chunks[:-1], 2, 3)
    with pytest.raises(GroupIncompleteError, match="duplicated"):
        merge_chunks([*chunks, chunks[0]], 2, 3)


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
            failing.assemble(engine.generate(plan.chunks)[0], plan.prompts, 2)
        assert "broken" in str(info.value)
    finally:
        del sys.modules["broken_reward_mod"]
