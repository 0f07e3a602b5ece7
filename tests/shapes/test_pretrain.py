"""Pretraining runs end to end on a miniature of the shapes model (the real run is not part of the tests)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from serve_app.config.loader import ConfigError
from serve_app.worlds.shapes.pretrain import load_pretrain_config, pretrain

MINIATURE = [
    "model.layers=1", "model.heads=2", "model.head_dim=16", "model.rope_axes=[4,6,6]", "model.text_dim=16",
    "model.text_heads=2", "model.text_mrope=[1,1,2]", "batch_size=8", "warmup_steps=1", "lr=3e-3",
    "eval.samples_per_prompt=1", "eval.num_steps=2", "ema_decay=0.5",
]


@pytest.fixture(scope="module")
def qwen2_dir(flowgrpo_home):
    from serve_app.models import ensure_qwen2_tokenizer

    return ensure_qwen2_tokenizer()


def test_committed_config_loads_and_unknown_keys_fail():
    config = load_pretrain_config("shapes/pretrain")
    assert config.model.vae_patch_size == 2 and config.model.rope_axes == (8, 12, 12) and config.seed == 0
    assert load_pretrain_config("configs/shapes/pretrain.yaml") == config  # a path loads the same file
    with pytest.raises(ConfigError, match="unknown key 'lr_typo' in override 'lr_typo=1'"):
        load_pretrain_config("shapes/pretrain", ["lr_typo=1"])
    with pytest.raises(ConfigError, match="model.layres"):
        load_pretrain_config("shapes/pretrain", ["model.layres=2"])


@pytest.mark.slow  # a learning run (24 / 16 pretraining steps); the seed test keeps a short run fast
def test_a_few_steps_lower_the_loss_and_save_a_loadable_pipeline(tmp_path, qwen2_dir):
    config = load_pretrain_config("shapes/pretrain", [*MINIATURE, "steps=24", "eval.every=8"])
    entries = pretrain(config, tmp_path / "model", qwen2_dir=qwen2_dir, log=lambda line: None)
    assert [e["step"] for e in entries] == [8, 16, 24]
    assert entries[-1]["loss"] < entries[0]["loss"]
    assert set(entries[-1]["eval"]) == {"train", "held_out"}
    assert 0.0 <= entries[-1]["eval"]["held_out"]["colour_accuracy"] <= 1.0
    logged = [json.loads(line) for line in (tmp_path / "model" / "pretrain_log.jsonl").read_text().splitlines()]
    assert logged == entries

    from serve_app.policies import load_policy
    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.schemas import SamplingParams

    policy = load_policy(tmp_path / "model", family="qwen_image")
    assert policy.transformer.dtype == torch.float32  # saved in bf16, loaded in the asked dtype
    params = SamplingParams(num_steps=2, guidance_scale=1.0, sde_window_size=None, seed=0)
    batch = sample_group(policy, policy.text_processor().tokenize(["a red circle"]), 2, params, policy_version=0)
    assert batch.images.shape == (2, 3, 32, 32)


def test_the_same_seed_gives_the_same_weights(tmp_path, qwen2_dir):
    config = load_pretrain_config("shapes/pretrain", [*MINIATURE, "steps=2", "eval.every=0"])
    for run in ("a", "b"):
        pretrain(config, tmp_path / run, qwen2_dir=qwen2_dir, log=lambda line: None)
    a, b = (load_file(tmp_path / run / "transformer" / "diffusion_pytorch_model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
