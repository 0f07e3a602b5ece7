"""Video pretraining runs end to end on a miniature of the moving-shapes model (the real run is not part
of the tests), and the pixel-space Wan pipeline it writes loads like a Wan2.1 checkout."""

import json

import pytest
import torch
from safetensors.torch import load_file

from serve_app.config.loader import ConfigError
from serve_app.worlds.motion.pretrain import load_pretrain_config, pretrain

MINIATURE = [
    "model.layers=1", "model.heads=2", "model.head_dim=12", "model.ffn_dim=32", "model.text_dim=16",
    "model.text_layers=1", "model.text_heads=2", "batch_size=4", "warmup_steps=1", "lr=3e-3",
    "eval.samples_per_prompt=1", "eval.num_steps=2", "ema_decay=0.5",
]


@pytest.fixture(scope="module")
def qwen2_dir(flowgrpo_home):
    from serve_app.models import ensure_qwen2_tokenizer

    return ensure_qwen2_tokenizer()


def test_committed_config_loads_and_unknown_keys_fail():
    config = load_pretrain_config("motion/pretrain")
    assert config.model.vae_patch_size == 2 and config.num_frames == 4 and config.seed == 0
    assert load_pretrain_config("configs/motion/pretrain.yaml") == config
    with pytest.raises(ConfigError, match="model.layres"):
        load_pretrain_config("motion/pretrain", ["model.layres=2"])


@pytest.mark.slow  # a learning run (24 / 16 pretraining steps); the seed test keeps a short run fast
def test_a_few_steps_lower_the_loss_and_save_a_loadable_wan_pipeline(tmp_path, qwen2_dir):
    # One frame a token (the shipped model takes two: the test below), which takes any frame count.
    config = load_pretrain_config("motion/pretrain", [*MINIATURE, "steps=16", "eval.every=8", "model.temporal_patch=1"])
    entries = pretrain(config, tmp_path / "model", qwen2_dir=qwen2_dir, log=lambda line: None)
    assert [e["step"] for e in entries] == [8, 16]
    assert entries[-1]["loss"] < entries[0]["loss"]
    assert set(entries[-1]["eval"]) == {"train", "held_out"}
    assert 0.0 <= entries[-1]["eval"]["held_out"]["direction_accuracy"] <= 1.0
    logged = [json.loads(line) for line in (tmp_path / "model" / "pretrain_log.jsonl").read_text().splitlines()]
    assert logged == entries
    index = json.loads((tmp_path / "model" / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert index["vae"] == ["serve_app.models.pixel_vae", "PixelPatchVideoVAE"]

    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.policies import load_policy
    from serve_app.schemas import SamplingParams

    policy = load_policy(tmp_path / "model", family="wan",
                         components={"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"})
    # "left to right" and "right to left" are the same words in another order: the encoder must see the order.
    tokens = policy.text_processor().tokenize(["a red circle moving left to right", "a red circle moving right to left"])
    embeds = policy.encode_prompts(tokens).embeds
    assert not torch.allclose(embeds[0], embeds[1])
    params = SamplingParams(num_frames=5, num_steps=2, guidance_scale=1.0, sde_window_size=None, seed=0)
    batch = sample_group(policy, tokens[:1], 2, params, policy_version=0)
    assert batch.images.shape == (2, 5, 3, 32, 32)  # any frame count: the pixel VAE's temporal factor is 1


def test_two_frame_tokens_train_sample_and_refuse_an_odd_frame_count(tmp_path, qwen2_dir):
    from serve_app.errors import InvalidRequestError
    from serve_app.flowgrpo.sampler import sample_group
    from serve_app.policies import load_policy
    from serve_app.schemas import SamplingParams

    config = load_pretrain_config("motion/pretrain", [*MINIATURE, "steps=4", "eval.every=0"])  # as shipped
    assert config.model.temporal_patch == 2
    pretrain(config, tmp_path / "model", qwen2_dir=qwen2_dir, log=lambda line: None)
    transformer = json.loads((tmp_path / "model" / "transformer" / "config.json").read_text())
    assert transformer["patch_size"] == [2, 2, 2]
    policy = load_policy(tmp_path / "model", family="wan",
                         components={"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"})
    assert policy.geometry.tokens(32, 32, 4) == 8 * 8 * 2  # 4 frames in 2 tokens' worth of frames
    tokens = policy.text_processor().tokenize(["a red circle moving left to right"])
    params = SamplingParams(num_frames=4, num_steps=2, guidance_scale=1.0, sde_window_size=None, seed=0)
    assert sample_group(policy, tokens, 2, params, policy_version=0).images.shape == (2, 4, 3, 32, 32)
    with pytest.raises(InvalidRequestError) as info:
        policy.check_size(32, 32, 5)
    assert info.value.field == "sampling.num_frames"
    # A replica's health probe forwards the fewest frames the model takes: one token's two frames.
    from serve_app.serving.engine import DiffusersEngine

    assert policy.geometry.min_frames == 2
    DiffusersEngine(policy).check_health()


def test_videos_round_trip_through_the_policys_encoder_exactly(tmp_path, qwen2_dir):
    from serve_app.worlds.motion.model import MotionModelSpec, build_motion_wan
    from serve_app.policies.wan import WanPolicy

    spec = MotionModelSpec(layers=1, heads=2, head_dim=12, ffn_dim=32, text_dim=16, text_layers=1, text_heads=2)
    policy = WanPolicy(build_motion_wan(tmp_path / "m", spec, qwen2_dir=qwen2_dir), device=torch.device("cpu"),
                       dtype=torch.float32)
    videos = torch.randint(0, 256, (2, 4, 3, 32, 32)).float() / 255.0
    latents = policy.encode_videos(videos)
    assert latents.shape == (2, 12, 4, 16, 16) == (2, *policy.latent_shape(32, 32, 4))
    torch.testing.assert_close(policy.decode(latents, height=32, width=32), videos, atol=1e-6, rtol=0)


def test_the_same_seed_gives_the_same_weights(tmp_path, qwen2_dir):
    config = load_pretrain_config("motion/pretrain", [*MINIATURE, "steps=2", "eval.every=0"])
    for run in ("a", "b"):
        pretrain(config, tmp_path / run, qwen2_dir=qwen2_dir, log=lambda line: None)
    a, b = (load_file(tmp_path / run / "transformer" / "diffusion_pytorch_model.safetensors") for run in ("a", "b"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_untrained_text_encoder_already_sees_word_order(tmp_path, qwen2_dir):
    from serve_app.worlds.motion.evaluation import word_order_gap
    from serve_app.worlds.motion.model import build_motion_wan
    from serve_app.policies import load_policy

    config = load_pretrain_config("motion/pretrain", MINIATURE)
    gaps = {}
    for bias in (0.0, 5.0):
        spec = config.model.model_copy(update={"text_neighbour_bias": bias})
        build_motion_wan(tmp_path / str(bias), spec, qwen2_dir=qwen2_dir, seed=0)
        policy = load_policy(tmp_path / str(bias), family="wan",
                             components={"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"})
        gaps[bias] = [word_order_gap(policy, subject) for subject in ("red circle", "blue square", "green triangle")]
    # UMT5's own init: the two signs of an axis a small fraction as far apart as the two axes; from the
    # neighbours' bias on, about as far.
    assert max(gaps[0.0]) < 0.15 and min(gaps[5.0]) > 0.3, gaps  # measured 0.05 / 0.6


def test_a_frozen_text_encoder_ships_as_built_while_the_transformer_trains(tmp_path, qwen2_dir):
    from serve_app.worlds.motion.model import build_motion_wan

    config = load_pretrain_config("motion/pretrain", [*MINIATURE, "steps=3", "eval.every=0", "train_text_encoder=false",
                                                      "model.text_neighbour_bias=5"])
    pretrain(config, tmp_path / "trained", qwen2_dir=qwen2_dir, log=lambda line: None)
    build_motion_wan(tmp_path / "built", config.model, qwen2_dir=qwen2_dir, seed=config.seed)
    weights = {run: {part: load_file(next((tmp_path / run / part).glob("*.safetensors")))
                     for part in ("text_encoder", "transformer")} for run in ("trained", "built")}
    built, trained = weights["built"], weights["trained"]
    assert all(torch.equal(built["text_encoder"][k], trained["text_encoder"][k]) for k in built["text_encoder"])
    assert not all(torch.equal(built["transformer"][k], trained["transformer"][k]) for k in built["transformer"])
