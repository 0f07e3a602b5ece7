"""Weight versions through Ray's object store: the registry's bookkeeping without Ray, and the
transport on the session's shared cluster (tests/conftest.py: ray_cluster): publish in one process,
fetch in another, evict, refuse foreign models."""

import pytest
import torch

from serve_app.errors import PolicyVersionError
from serve_app.weights.registry import RegistryEntry, WeightRegistry
from serve_app.weights import LoraSpec

LORA = LoraSpec(rank=2, alpha=2.0, target_modules=["proj_out"])


def _entry(version: int) -> RegistryEntry:
    return RegistryEntry(version, "lora", LORA, f"hash{version}", "tiny", tensors_ref=[])


def test_the_registry_keeps_the_last_versions_and_names_what_it_has():
    registry = WeightRegistry(keep=2)
    for version in (1, 2, 3):
        registry.register(_entry(version))
    assert registry.versions() == [2, 3]
    assert registry.entry(3).content_hash == "hash3"
    with pytest.raises(PolicyVersionError, match=r"policy version 1 does not exist; available: 0 \(base\), 2\.\.3"):
        registry.entry(1)
    with pytest.raises(PolicyVersionError, match="already published"):
        registry.register(_entry(3))


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"proj_out.lora_A.weight": torch.randn(2, 32, generator=g), "proj_out.lora_B.weight": torch.randn(16, 2, generator=g)}


@pytest.mark.cluster
def test_versions_travel_through_the_object_store_and_outlive_their_publisher(ray_cluster):
    import ray

    from serve_app.weights.registry import RegistryStore
    from serve_app.weights import content_hash

    @ray.remote(num_cpus=0)
    def publish(version: int) -> None:  # a process of its own, gone once it returns
        RegistryStore("test/outlive", model="tiny", keep=3).publish(version, _tensors(version), kind="lora", lora=LORA)

    @ray.remote(num_cpus=0)
    def fetch(version: int) -> dict[str, torch.Tensor]:
        return RegistryStore("test/outlive", model="tiny", keep=3).load(version).tensors

    for version in (1, 2, 3, 4):
        ray.get(publish.remote(version))
    store = RegistryStore("test/outlive", model="tiny", keep=3)
    assert store.versions() == [2, 3, 4] and store.latest_version() == 4
    fetched = ray.get(fetch.remote(4))
    assert fetched.keys() == _tensors(4).keys() and all(torch.equal(fetched[k], _tensors(4)[k]) for k in fetched)
    assert store.published_hash(4) == content_hash(_tensors(4), LORA) == store.load(4).content_hash
    with pytest.raises(PolicyVersionError, match="policy version 1 does not exist"):
        store.load(1)  # evicted
    with pytest.raises(PolicyVersionError, match="published for model 'tiny', not 'small'"):
        RegistryStore("test/outlive", model="small", keep=3).load(4)


@pytest.mark.cluster
def test_publishers_at_once_get_distinct_ordered_versions_from_the_registry(ray_cluster):
    from concurrent.futures import ThreadPoolExecutor

    from serve_app.weights import content_hash
    from serve_app.weights.registry import RegistryStore

    store = RegistryStore("test/next", model="tiny", keep=None)
    with ThreadPoolExecutor(6) as pool:
        published = list(pool.map(lambda s: (s, *store.publish_next(_tensors(s), kind="lora", lora=LORA)), range(6)))
    assert sorted(v for _, v, _ in published) == [1, 2, 3, 4, 5, 6] == store.versions()
    for seed, version, digest in published:  # each number holds the content its publisher sent
        assert digest == content_hash(_tensors(seed), LORA) == store.published_hash(version)
        assert store.describe(version).tensors == 2


@pytest.mark.cluster
def test_the_app_and_trainer_share_versions_without_a_shared_folder(ray_cluster, tmp_path):
    """On the session's shared cluster (tests/conftest.py: ray_cluster)."""
    import httpx
    from ray import serve

    from serve_app.app import AppArgs, build_app
    from serve_app.client import RolloutClient
    from serve_app.trainer.config import load_trainer_config
    from serve_app.trainer.loop import FlowGRPOTrainer

    overrides = ["app_name=flowgrpo-objects", "weights.transport=object_store", "weights.keep_versions=2",
                 "sampling.num_steps=4", "sampling.guidance_scale=1.0", "sampling.sde_window_size=null"]
    serve.run(build_app(AppArgs(overrides=overrides)), name="flowgrpo-objects", route_prefix="/objects")
    try:
        config = load_trainer_config("trainer/flowgrpo", [
            *overrides, "trainer.prompts_per_step=2", "trainer.group_size=4", "trainer.micro_batch_size=8",
            "trainer.inner_epochs=1", "trainer.eval_every=0", "trainer.image_every=0", "trainer.checkpoint_every=0",
            "trainer.lr=1e-2",
        ])
        trainer = FlowGRPOTrainer(config, RolloutClient("flowgrpo-objects"), tmp_path / "out", progress=False)
        rows = [trainer.train_step() for _ in range(3)]
        # Each step after the first ran on the version the previous one published through the registry,
        # stamped with its content hash (checked by the trainer and the aggregator) and exactly on-policy.
        assert [int(r["policy_version"]) for r in rows] == [0, 1, 2]
        assert all(r["onpolicy_ratio_dev"] < 1e-6 for r in rows)
        assert trainer.store.versions() == [2, 3]  # keep_versions = 2
        evicted = httpx.post(f"{ray_cluster.url}/objects/v1/rollouts", timeout=60,
                             json={"prompts": ["a cat"], "group_size": 2, "policy_version": 1})
        assert evicted.status_code == 409 and "policy version 1 does not exist" in evicted.json()["message"]
        trainer.finish()
    finally:
        serve.delete("flowgrpo-objects")
