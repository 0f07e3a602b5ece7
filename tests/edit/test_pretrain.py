"""Edit-world pretraining runs end to end on a miniature (the real run is not part of the tests)."""

import json

import pytest
import torch

from serve_app.config.loader import ConfigError
from serve_app.worlds.edit.pretrain import EditBatches, load_pretrain_config, pretrain

MINIATURE = [
    "warm_start=false", "model.layers=1", "model.heads=2", "model.head_dim=16", "model.rope_axes=[4,6,6]",
    "model.text_dim=16", "model.text_heads=2", "model.text_mrope=[1,1,2]", "batch_size=8", "warmup_steps=1",
    "lr=3e-3", "eval.samples_per_prompt=1", "eval.num_steps=2", "eval_scenes_per_instruction=1", "ema_decay=0.5",
]


def test_committed_config_loads_and_refuses_what_the_model_cannot_do():
    config = load_pretrain_config("edit/pretrain")
    assert config.warm_start and not config.train_text_encoder and config.model.rope_axes == (8, 12, 12)
    with pytest.raises(ConfigError, match="lr_typo"):
        load_pretrain_config("edit/pretrain", ["lr_typo=1"])
    with pytest.raises(ValueError, match="train_text_encoder"):
        pretrain(load_pretrain_config("edit/pretrain", ["train_text_encoder=true"]), "/nonexistent")


def test_batches_pair_each_target_with_its_own_source():
    targets, picks, sources = EditBatches(seed=0, batch_size=6).next()
    assert targets.shape == (6, 3, 32, 32) and len(picks) == len(sources) == 6
    assert all(len(s) == 1 and s[0].shape == (3, 32, 32) for s in sources)
    assert any(not torch.equal(t, s[0]) for t, s in zip(targets, sources))
    again = EditBatches(seed=0, batch_size=6).next()
    assert torch.equal(again[0], targets) and again[1] == picks


@pytest.mark.slow  # a learning run (16 pretraining steps)
def test_a_few_steps_lower_the_loss_and_save_a_loadable_edit_pipeline(tmp_path, flowgrpo_home):
    from serve_app.models import ensure_qwen2_tokenizer

    config = load_pretrain_config("edit/pretrain", [*MINIATURE, "steps=16", "eval.every=8"])
    entries = pretrain(config, tmp_path / "model", qwen2_dir=ensure_qwen2_tokenizer(), log=lambda line: None)
    assert [e["step"] for e in entries] == [8, 16] and entries[-1]["loss"] < entries[0]["loss"]
    assert set(entries[-1]["eval"]) == {"train", "held_out"}
    assert 0.0 <= entries[-1]["eval"]["held_out"]["kept_accuracy"] <= 1.0
    logged = [json.loads(line) for line in (tmp_path / "model" / "pretrain_log.jsonl").read_text().splitlines()]
    assert logged == entries

    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.policies import load_policy
    from serve_app.schemas import SamplingParams

    policy = load_policy(tmp_path / "model", family="qwen_image_edit",
                         components={"vae": "serve_app.models.pixel_vae:PixelPatchVAE"})
    tokens = policy.text_processor().tokenize(["make the square red"])
    tokens[0].images = [torch.zeros(3, 32, 32, dtype=torch.uint8)]
    params = SamplingParams(num_steps=2, guidance_scale=1.0, sde_window_size=None, seed=0)
    assert sample_group(policy, tokens, 2, params, policy_version=0).images.shape == (2, 3, 32, 32)


def test_the_same_seed_gives_the_same_weights(tmp_path, flowgrpo_home):
    from safetensors.torch import load_file

    from serve_app.models import ensure_qwen2_tokenizer

    config = load_pretrain_config("edit/pretrain", [*MINIATURE, "steps=2", "eval.every=0"])
    for run in ("a", "b"):
        pretrain(config, tmp_path / run, qwen2_dir=ensure_qwen2_tokenizer(), log=lambda line: None)
    a, b = (load_file(tmp_path / run / "transformer" / "diffusion_pytorch_model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
