"""Version pinning: a request pinned to v is served with v's weights, also while versions are being
published and other requests switch the replica's weights back and forth."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from serve_app.config import IngressConfig
from serve_app.serving.engine import DiffusersEngine
from serve_app.errors import PolicyVersionError
from serve_app.serving.ingress import RolloutPlanner
from serve_app.schemas import RolloutRequest, SamplingParams
from serve_app.weights import LoraSpec, WeightStore

from tests.collect import collect

SAMPLING = SamplingParams(height=32, width=32, num_steps=3, guidance_scale=1.0, noise_level=1.0,
                          sde_window_size=None)
LORA = LoraSpec(rank=2, alpha=2.0, target_modules=["proj_out"])


def lora_tensors(transformer, version: int) -> dict[str, torch.Tensor]:
    """A distinct, non-zero adapter per version (so versions give different log-probs)."""
    g = torch.Generator().manual_seed(version)
    inner, outer = transformer.proj_out.in_features, transformer.proj_out.out_features
    return {
        "proj_out.lora_A.weight": torch.randn(LORA.rank, inner, generator=g) * 0.3,
        "proj_out.lora_B.weight": torch.randn(outer, LORA.rank, generator=g) * 0.3,
    }


@pytest.fixture()
def setup(tmp_path, tiny_qwen_dir):
    from serve_app.policies import load_policy

    policy = load_policy(tiny_qwen_dir)  # its own copy: versions add an adapter to the transformer
    store = WeightStore(tmp_path / "weights")
    engine = DiffusersEngine(policy, store)
    planner = RolloutPlanner(
        policy.text_processor(), IngressConfig(chunk_size=2), SAMPLING, policy.geometry, max_work=2**22, store=store
    )
    return policy, store, engine, planner


# A sampled transition's own log-prob depends only on its noise and std, not on the weights; the
# weights show in the latents, so versions are compared by latents.
def run(engine, planner, version, seed=3):
    plan = planner.plan(RolloutRequest(prompts=["a cat"], group_size=2, seed=seed, policy_version=version))
    trajectories, _ = engine.generate(plan.chunks)
    return trajectories[0]


def test_published_versions_change_the_policy_and_back(setup):
    policy, store, engine, planner = setup
    base = run(engine, planner, 0)
    store.publish(1, lora_tensors(policy.transformer, 1), kind="lora", lora=LORA)
    v1 = run(engine, planner, 1)
    assert v1.policy_version == 1 and engine.versions.current == 1
    assert (v1.latents[:, -1] - base.latents[:, -1]).abs().max() > 1e-3
    again = run(engine, planner, 0)
    torch.testing.assert_close(again.latents, base.latents, atol=1e-6, rtol=0)
    assert run(engine, planner, None).policy_version == 1  # unpinned: the newest published
    with pytest.raises(PolicyVersionError, match="version 9"):
        run(engine, planner, 9)


def test_concurrent_rollouts_and_pushes_never_mix_versions(setup):
    policy, store, engine, planner = setup
    reference = {0: run(engine, planner, 0).latents}
    for v in (1, 2):
        store.publish(v, lora_tensors(policy.transformer, v), kind="lora", lora=LORA)
        reference[v] = run(engine, planner, v).latents
    published = [1, 2]
    lock = threading.Lock()

    def pusher() -> None:
        for v in (3, 4, 5):
            store.publish(v, lora_tensors(policy.transformer, v), kind="lora", lora=LORA)
            with lock:
                published.append(v)

    def roller(i: int) -> tuple[int, int, torch.Tensor]:
        with lock:
            version = published[i % len(published)] if i % 3 else 0
        t = run(engine, planner, version)
        return version, t.policy_version, t.latents

    with ThreadPoolExecutor(4) as pool:
        push = pool.submit(pusher)
        results = list(pool.map(roller, range(24)))
        push.result()
    for asked, stamped, latents in results:
        assert stamped == asked
        if asked in reference:
            torch.testing.assert_close(latents, reference[asked], atol=1e-6, rtol=0)
    # Versions published during the run are served exactly too, when asked afterwards.
    for v in (3, 4, 5):
        t = run(engine, planner, v)
        assert t.policy_version == v
        assert all((t.latents - reference[u]).abs().max() > 1e-3 for u in reference)


def test_a_version_published_for_another_model_is_refused(tmp_path):
    from serve_app.config import load_config
    from serve_app.weights import model_identity, open_weight_store, weights_dir

    tiny = load_config("diffusion_rollout", [f"replica.weights_dir={tmp_path}"])
    small = load_config("diffusion_rollout", [f"replica.weights_dir={tmp_path}", "model=small_qwen_image"])
    open_weight_store(tiny).publish(1, {"x": torch.zeros(1)}, kind="full")
    with pytest.raises(PolicyVersionError, match="published for model 'tiny-qwen-image'"):
        open_weight_store(small).load(1)
    assert open_weight_store(tiny).load(1).version == 1
    # Without an explicit weights_dir, each base model gets its own folder.
    default_tiny = load_config("diffusion_rollout")
    default_small = load_config("diffusion_rollout", ["model=small_qwen_image"])
    assert weights_dir(default_tiny) != weights_dir(default_small)
    assert model_identity(load_config("diffusion_rollout", ["model.path=/models/Qwen-Image"])).startswith("Qwen-Image-")


def test_content_hash_names_the_weights_not_their_layout():
    from serve_app.weights import content_hash

    a = {"x.weight": torch.arange(6.0).view(2, 3), "y.bias": torch.ones(2, dtype=torch.bfloat16)}
    assert content_hash(a, LORA) == content_hash(dict(reversed(list(a.items()))), LORA)  # order of names
    assert content_hash(a, LORA) == content_hash({k: v.clone() for k, v in a.items()}, LORA)
    changed = {**a, "x.weight": a["x.weight"].clone().index_fill_(1, torch.tensor([2]), 9.0)}
    assert content_hash(changed, LORA) != content_hash(a, LORA)
    assert content_hash(a, LoraSpec(rank=4, alpha=2.0, target_modules=["proj_out"])) != content_hash(a, LORA)
    assert content_hash({"x.weight": a["x.weight"].double()}, LORA) != content_hash({"x.weight": a["x.weight"]}, LORA)


def test_replicas_stamp_the_published_hash_of_what_they_hold(setup):
    from serve_app.weights import BASE_HASH

    policy, store, engine, planner = setup
    assert run(engine, planner, 0).weights_hash == BASE_HASH
    store.publish(1, lora_tensors(policy.transformer, 1), kind="lora", lora=LORA)
    trajectory = run(engine, planner, 1)
    assert trajectory.weights_hash == store.published_hash(1) == store.load(1).content_hash
    assert run(engine, planner, 0).weights_hash == BASE_HASH  # back to the base, stamped as such


def test_the_aggregator_refuses_a_stamp_the_store_did_not_publish(setup):
    import dataclasses

    from serve_app.serving.aggregator import TrajectoryAssembler
    from serve_app.config import AdvantageConfig
    from serve_app.errors import WeightMismatchError
    from serve_app.rewards import CompositeReward, RewardSpec

    policy, store, engine, planner = setup
    store.publish(1, lora_tensors(policy.transformer, 1), kind="lora", lora=LORA)
    plan = planner.plan(RolloutRequest(prompts=["a cat"], group_size=2, seed=3, policy_version=1))
    chunks, _ = engine.generate(plan.chunks)
    assembler = TrajectoryAssembler(CompositeReward([RewardSpec(name="brightness")]), AdvantageConfig(), store=store)
    assert collect(assembler, chunks, plan.prompts, 2, request_id="ok").policy_version == 1
    forged = [dataclasses.replace(c, weights_hash="0" * 64) for c in chunks]
    with pytest.raises(WeightMismatchError, match="policy version 1 was sampled with weights 000000000000"):
        collect(assembler, forged, plan.prompts, 2, request_id="forged")


def test_a_lora_version_after_a_full_one_applies_to_the_base_weights(setup, tiny_qwen_dir):
    """A replica that held a full version and then serves a LoRA version runs base + adapter, exactly
    what a replica that never held the full version runs (the adapter's hash alone could not tell)."""
    from serve_app.policies import load_policy

    policy, store, engine, planner = setup
    full = {k: v + 0.05 * torch.randn_like(v) for k, v in policy.transformer.state_dict().items()}
    store.publish(1, full, kind="full")
    store.publish(2, lora_tensors(policy.transformer, 2), kind="lora", lora=LORA)
    base = run(engine, planner, 0)
    assert (run(engine, planner, 1).latents[:, -1] - base.latents[:, -1]).abs().max() > 1e-3
    after_full = run(engine, planner, 2)
    fresh = DiffusersEngine(load_policy(tiny_qwen_dir), store)  # never held version 1
    torch.testing.assert_close(after_full.latents, run(fresh, planner, 2).latents, atol=1e-6, rtol=0)
    torch.testing.assert_close(run(engine, planner, 0).latents, base.latents, atol=1e-6, rtol=0)
