"""Streaming scoring, groupwise rewards and fail-closed errors in the plain classes (no Ray, no model):
ScoreStream -> TrajectoryAssembler.score -> finish, on hand-made trajectories, and the coordinator's
whole flow over them in one process (tests/collect.py)."""

import asyncio
import random
import time

import pytest
import torch
from pydantic import ValidationError

from serve_app.serving.aggregator import ScoreStream, TrajectoryAssembler
from serve_app.config import AdvantageConfig
from serve_app.errors import GroupIncompleteError
from serve_app.flowgrpo.advantages import group_advantages
from serve_app.serving.options import reward_server_options
from serve_app.rewards import register_reward
from serve_app.rewards.composite import CompositeReward, RewardError, RewardSpec, score_fused
from serve_app.schemas import ChunkHeader, PromptEmbeds, SampledChunk, SamplingParams, Trajectory

from tests.collect import collect

# --- rewards of these tests (registered names, so specs can use them) ---------------------------

CALLS: list[tuple[str, list[int]]] = []  # (reward, the image means it was called with)


def _means(images: torch.Tensor) -> torch.Tensor:
    return images.float().mean(dim=(1, 2, 3))


@register_reward("test_mean")
def mean_reward():
    def reward(images, prompts):
        CALLS.append(("test_mean", _means(images).int().tolist()))
        return _means(images) / 255.0

    return reward


@register_reward("test_rank", groupwise=True)
def rank_reward():
    """Groupwise: each sample's rank of brightness within its group, in [0, 1]."""

    def reward(images, prompts):
        assert len(set(prompts)) == 1, "a groupwise reward sees one group"
        CALLS.append(("test_rank", _means(images).int().tolist()))
        ranks = torch.argsort(torch.argsort(_means(images))).float()
        return ranks / max(len(ranks) - 1, 1)

    return reward


@register_reward("test_fails_on")
def fails_on(word: str = "bad", times: int = -1, value: float = 1.0):
    """Raises on prompts containing ``word`` (the first ``times`` calls; -1: always); else ``value``."""
    seen = {"n": 0}

    def reward(images, prompts):
        if word in prompts[0] and (times < 0 or seen["n"] < times):
            seen["n"] += 1
            raise ConnectionError(f"scorer answered 503 for {prompts[0]!r}")
        return torch.full((len(prompts),), value)

    return reward


@register_reward("test_slow")
def slow(seconds: float = 0.3):
    def reward(images, prompts):
        time.sleep(seconds)
        return torch.ones(len(prompts))

    return reward


# --- hand-made trajectories ---------------------------------------------------------------------


def fake_chunk(prompt_index, sample_index) -> Trajectory:
    """A chunk whose image of (p, s) is one grey level, 10 p + 3 s + 7 (distinct, known)."""
    p = torch.tensor(prompt_index)
    s = torch.tensor(sample_index)
    n = len(p)
    levels = (10 * p + 3 * s + 7).to(torch.uint8)
    prompts, slot = torch.unique(p, return_inverse=True)
    return Trajectory(
        latents=torch.randn(n, 2, 4), log_probs=torch.zeros(n, 1), sigmas=torch.linspace(1, 0, 3),
        step_indices=torch.tensor([0]), images=levels.view(n, 1, 1, 1).expand(n, 3, 4, 4).contiguous(),
        seeds=torch.arange(n), prompt_embeds=PromptEmbeds(torch.randn(len(prompts), 2, 4), torch.ones(len(prompts), 2, dtype=torch.bool)),
        embed_row=slot, negative_embeds=None, sampling=SamplingParams(), prompt_index=p, sample_index=s,
        policy_version=0, weights_hash="base",
    )


def chunks_of(num_prompts: int, group_size: int, chunk_size: int) -> list[Trajectory]:
    """The planner's layout: samples in (prompt, sample) order cut every chunk_size."""
    pairs = [(p, s) for p in range(num_prompts) for s in range(group_size)]
    return [fake_chunk([p for p, _ in pairs[i : i + chunk_size]], [s for _, s in pairs[i : i + chunk_size]])
            for i in range(0, len(pairs), chunk_size)]


PROMPTS = ["a cat", "a dog", "a bad owl"]


def assembler(*specs: dict, threads: int = 4, observer=None) -> TrajectoryAssembler:
    return TrajectoryAssembler(CompositeReward([RewardSpec(**s) for s in specs]), AdvantageConfig(),
                               reward_threads=threads, observer=observer)


def score_all(asm: TrajectoryAssembler, jobs) -> list:
    async def run():
        return await asyncio.wait_for(asyncio.gather(*(asm.score(j) for j in jobs)), 10)

    return asyncio.run(run())


class Events:
    def __init__(self):
        self.events = []

    def record(self, key, outcome, seconds):
        self.events.append((key, outcome))


# --- streaming ------------------------------------------------------------------------------------


def test_stream_scores_chunk_parts_at_once_and_groups_when_whole():
    # group 4, chunk 3: chunk 1 holds the end of group 0 and the start of group 1.
    chunks = chunks_of(2, 4, 3)
    stream = ScoreStream(PROMPTS[:2], 4, per_sample=True, groupwise=True)
    # Arrival out of order: the last chunk first.
    jobs = stream.add(SampledChunk.of(chunks[2]))
    assert [(j.prompt_index, j.whole_group, j.sample_index.tolist()) for j in jobs] == [(1, False, [2, 3])]
    jobs = stream.add(SampledChunk.of(chunks[0]))
    assert [(j.prompt_index, j.whole_group, j.sample_index.tolist()) for j in jobs] == [(0, False, [0, 1, 2])]
    jobs = stream.add(SampledChunk.of(chunks[1]))  # completes both groups
    assert [(j.prompt_index, j.whole_group, j.sample_index.tolist()) for j in jobs] == [
        (0, False, [3]), (0, True, [0, 1, 2, 3]), (1, False, [0, 1]), (1, True, [0, 1, 2, 3])]
    whole = jobs[3]
    assert _means(asyncio.run(whole.images())).int().tolist() == [17, 20, 23, 26]  # group 1's images, in sample order
    assert whole.prompt == "a dog"


def test_a_chunk_of_several_whole_groups_gives_a_job_per_group():
    (chunk,) = chunks_of(3, 2, 6)
    jobs = ScoreStream(PROMPTS, 2, per_sample=False, groupwise=True).add(SampledChunk.of(chunk))
    assert [(j.prompt_index, j.whole_group, len(j.sample_index)) for j in jobs] == [(0, True, 2), (1, True, 2), (2, True, 2)]


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 12])
def test_streamed_scores_equal_scoring_each_whole_group(chunk_size):
    """Per-sample and groupwise rewards, whatever the chunking and arrival order, give exactly the
    values of scoring each whole group in one call (the old after-the-merge path)."""
    specs = ({"name": "test_mean", "weight": 2.0}, {"name": "test_rank", "weight": 0.5})
    asm = assembler(*specs)
    chunks = chunks_of(3, 4, chunk_size)
    order = list(range(len(chunks)))
    random.Random(chunk_size).shuffle(order)
    stream = ScoreStream(PROMPTS, 4, per_sample=asm.reward.has_per_sample, groupwise=asm.reward.has_groupwise)
    jobs = [job for i in order for job in stream.add(SampledChunk.of(chunks[i]))]
    assert sum(j.whole_group for j in jobs) == 3
    scores = score_all(asm, jobs)
    batch = asm.finish([ChunkHeader.of(chunks[i]) for i in order], scores, PROMPTS, 4)
    prompt_index = torch.cat([chunks[i].prompt_index for i in order])[batch.rows]
    reference = CompositeReward([RewardSpec(**s) for s in specs])
    whole = chunks_of(3, 4, 12)[0]
    for g in range(3):
        expected = reference.score(whole.images[g * 4 : (g + 1) * 4], [PROMPTS[g]] * 4)
        for key in ("test_mean", "test_rank", "total"):
            torch.testing.assert_close(batch.rewards[key][g * 4 : (g + 1) * 4], expected[key], rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.rewards["test_rank"].view(3, 4), torch.tensor([[0, 1 / 3, 2 / 3, 1]] * 3))
    torch.testing.assert_close(batch.advantages, group_advantages(batch.rewards["total"], prompt_index,
                                                                  std_mode="group", eps=1e-4, clip=5.0))
    assert batch.dropped_groups == {}


def test_groupwise_reward_is_called_with_whole_groups_only():
    CALLS.clear()
    asm = assembler({"name": "test_rank"})
    collect(asm, chunks_of(2, 4, 3), PROMPTS[:2], 4)
    assert sorted(c for _, c in CALLS) == [[7, 10, 13, 16], [17, 20, 23, 26]]
    assert {name for name, _ in CALLS} == {"test_rank"}  # no per-sample job was made: nothing to score there


# --- fail closed ----------------------------------------------------------------------------------


def test_drop_group_removes_the_failed_group_and_reports_it():
    events = Events()
    asm = assembler({"name": "test_mean"}, {"name": "test_fails_on", "on_error": "drop_group", "retry": {"attempts": 2, "backoff_s": 0.0}}, observer=events)
    batch = collect(asm, chunks_of(3, 4, 3), PROMPTS, 4)
    assert list(batch.dropped_groups) == [2]
    assert "'test_fails_on' failed on prompt 'a bad owl'" in batch.dropped_groups[2]
    assert "ConnectionError: scorer answered 503" in batch.dropped_groups[2] and "after 2 attempts" in batch.dropped_groups[2]
    assert batch.trajectory.prompt_index.tolist() == [0] * 4 + [1] * 4
    assert batch.metrics["dropped_groups"] == 1.0 and batch.metrics["num_samples"] == 8.0
    # Advantages over the kept groups are what those groups give alone.
    kept = collect(assembler({"name": "test_mean"}, {"name": "test_fails_on"}), chunks_of(2, 4, 3), PROMPTS[:2], 4, request_id="k")
    torch.testing.assert_close(batch.advantages, kept.advantages)
    torch.testing.assert_close(batch.rewards["total"], kept.rewards["total"])
    # Chunks of 3 over groups of 4 put group 2 (rows 8..11) in chunks 2 and 3: both parts fail,
    # each after one retry.
    outcomes = [o for k, o in events.events if k == "test_fails_on"]
    assert outcomes.count("retry") == 2 and outcomes.count("failed") == 2


def test_retries_recover_a_transient_failure():
    events = Events()
    asm = assembler({"name": "test_fails_on", "args": {"times": 2, "value": 3.0}, "retry": {"attempts": 3, "backoff_s": 0.0}},
                    observer=events)
    batch = collect(asm, chunks_of(3, 2, 6), PROMPTS, 2)
    assert batch.rewards["test_fails_on"].tolist() == [3.0] * 6 and batch.dropped_groups == {}
    assert [o for _, o in events.events].count("retry") == 2


def test_fail_raises_a_reward_error_naming_reward_prompt_and_cause():
    asm = assembler({"name": "test_mean"}, {"name": "test_fails_on", "retry": {"attempts": 3, "backoff_s": 0.0}})
    with pytest.raises(RewardError) as info:
        collect(asm, chunks_of(3, 2, 2), PROMPTS, 2)
    error = info.value
    assert error.reward_name == "test_fails_on" and error.prompt == "a bad owl"
    assert error.detail == "ConnectionError: scorer answered 503 for 'a bad owl' (after 3 attempts)"


def test_every_group_dropped_is_an_error():
    asm = assembler({"name": "test_fails_on", "args": {"word": "a"}, "on_error": "drop_group"})
    with pytest.raises(RewardError, match="every group of the request was dropped"):
        collect(asm, chunks_of(2, 2, 2), PROMPTS[:2], 2)


def test_non_finite_values_and_timeouts_fail_closed():
    import sys
    import types

    module = types.ModuleType("nan_reward_mod")
    module.nan_reward = lambda images, prompts: torch.full((len(prompts),), float("nan"))
    sys.modules["nan_reward_mod"] = module
    try:
        with pytest.raises(RewardError, match="non-finite value nan"):
            collect(assembler({"name": "nan_reward_mod:nan_reward"}), chunks_of(1, 2, 2), PROMPTS[:1], 2)
    finally:
        del sys.modules["nan_reward_mod"]
    started = time.perf_counter()
    with pytest.raises(RewardError, match=r"'test_slow' failed on prompt 'a cat': timed out after 0.05 s"):
        collect(assembler({"name": "test_slow", "timeout_s": 0.05}), chunks_of(1, 2, 2), PROMPTS[:1], 2)
    assert time.perf_counter() - started < 0.3 + 0.25  # the wait ended at the timeout (the thread runs out its sleep)


def test_missing_scores_are_never_filled_in():
    asm = assembler({"name": "test_mean"})
    chunks = chunks_of(2, 2, 2)
    stream = ScoreStream(PROMPTS[:2], 2, per_sample=asm.reward.has_per_sample, groupwise=asm.reward.has_groupwise)
    jobs = [j for c in chunks for j in stream.add(SampledChunk.of(c))]
    scores = score_all(asm, jobs[:-1])
    with pytest.raises(GroupIncompleteError, match="reward 'test_mean' scored sample 0 of prompt 1 0 times"):
        asm.finish([ChunkHeader.of(c) for c in chunks], scores, PROMPTS[:2], 2)


# --- the RewardServer's batching, and the config -------------------------------------------------


def test_fused_scoring_equals_call_by_call_and_isolates_a_failing_call():
    calls_made = []

    def reward(images, prompts):
        calls_made.append(len(prompts))
        if "boom" in prompts:
            raise ValueError("boom")
        return _means(images)

    chunk = chunks_of(2, 3, 6)[0]
    calls = [(chunk.images[:2], ["a", "a"]), (chunk.images[2:5], ["b"] * 3), (chunk.images[5:], ["c"])]
    results = score_fused(reward, calls, groupwise=False)
    assert calls_made == [6]  # one fused call
    assert [r.tolist() for r in results] == [[7.0, 10.0], [13.0, 17.0, 20.0], [23.0]]
    calls_made.clear()
    results = score_fused(reward, [calls[0], (chunk.images[2:5], ["boom"] * 3)], groupwise=False)
    assert calls_made == [5, 2, 3]  # the fused call failed: each call alone
    assert results[0].tolist() == [7.0, 10.0] and isinstance(results[1], ValueError)
    calls_made.clear()
    score_fused(reward, calls, groupwise=True)
    assert calls_made == [2, 3, 1]  # a groupwise reward never sees two groups in one call


def test_spec_validation_and_server_options():
    with pytest.raises(ValidationError, match="placement is 'in_process'"):
        RewardSpec(name="brightness", server={"num_gpus": 1})
    with pytest.raises(ValidationError, match=r"max_ongoing_requests \(4\) must be >= max_batch_size \(8\)"):
        RewardSpec(name="brightness", placement="deployment", server={"max_ongoing_requests": 4})
    with pytest.raises(ValidationError, match="on_error"):
        RewardSpec(name="brightness", on_error="zero")
    fixed = reward_server_options(RewardSpec(name="brightness", placement="deployment", server={
        "num_gpus": 0.5, "min_replicas": 2, "runtime_env": {"pip": ["open_clip_torch"], "env_vars": {"A": "1"}}}))
    assert fixed == {"ray_actor_options": {"num_cpus": 0.1, "num_gpus": 0.5,
                                           "runtime_env": {"pip": ["open_clip_torch"], "env_vars": {"A": "1"}}},
                     "max_ongoing_requests": 16, "num_replicas": 2}
    scaled = reward_server_options(RewardSpec(name="brightness", placement="deployment", server={"max_replicas": 4}))
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 2}
    assert "num_replicas" not in scaled and "runtime_env" not in scaled["ray_actor_options"]
    # groupwise: declared by the factory, overridden by the spec.
    assert CompositeReward([RewardSpec(name="test_rank")]).has_groupwise
    assert not CompositeReward([RewardSpec(name="test_rank", groupwise=False)]).has_groupwise
    with pytest.raises(ValueError, match="no RewardServer handle"):
        CompositeReward([RewardSpec(name="brightness", placement="deployment")])
