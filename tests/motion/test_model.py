"""The shipped moving-shapes checkpoint: size, provenance, the stock WanPipeline's path, its tokenizer,
what it draws."""

import pytest
import torch

from serve_app.models import ensure_embedded_model
from serve_app.worlds.motion.scene import all_prompts
from serve_app.policies import detect_family, load_policy

VAE = {"vae": "serve_app.models.pixel_vae:PixelPatchVideoVAE"}


@pytest.fixture(scope="module")
def motion_dir():
    return ensure_embedded_model("serve_app.worlds.motion.model:MOTION_WAN")


@pytest.fixture(scope="module")
def policy(motion_dir):
    return load_policy(motion_dir, family="wan", components=VAE)


def test_checkpoint_is_small_and_records_its_config(motion_dir):
    size = sum(p.stat().st_size for p in motion_dir.rglob("*") if p.is_file())
    assert size <= 10 * 2**20, f"{size / 2**20:.1f} MiB"
    assert detect_family(motion_dir) == "wan"
    from serve_app.worlds.motion.pretrain import load_pretrain_config

    assert load_pretrain_config(motion_dir / "pretrain.yaml") == load_pretrain_config("motion/pretrain")
    assert (motion_dir / "README.md").is_file()


def test_tokenizer_knows_the_grammar_in_few_positions(policy):
    tokenizer = policy.pipeline.tokenizer
    for prompt in all_prompts():
        ids = tokenizer(prompt)["input_ids"]
        assert tokenizer.unk_token_id not in ids and len(ids) <= policy.max_sequence_length == 16, prompt
    assert tokenizer.unk_token_id in tokenizer("a purple hexagon moving sideways")["input_ids"]


def test_noise_zero_reproduces_the_stock_wan_pipeline(policy, ode_sample):
    from serve_app.flowgrpo.sampler import initial_latents
    from serve_app.flowgrpo.seeding import sample_generators
    from serve_app.schemas import SamplingParams

    params = SamplingParams(num_frames=4, num_steps=6, guidance_scale=3.0, noise_level=0.0, sde_window_size=None, seed=0)
    generators = sample_generators(torch.tensor([5]))
    latents = initial_latents(policy, params, generators)
    assert latents.shape == (1, 12, 4, 16, 16)
    prompt = "a red circle moving left to right"
    # The stock call warns that num_frames is no 4k + 1 (it assumes a 4x temporal VAE) and bumps it for
    # latents of its own; given ours it samples their 4 frames.
    stock = policy.pipeline(prompt=prompt, negative_prompt=" ", guidance_scale=3.0, height=32, width=32, num_frames=4,
                            num_inference_steps=6, max_sequence_length=policy.max_sequence_length,
                            latents=latents.clone(), output_type="pt").frames
    video, _ = ode_sample(policy, prompt, params, latents, generators)
    assert video.shape == stock.shape == (1, 4, 3, 32, 32)
    torch.testing.assert_close(video, stock, atol=5e-5, rtol=0)
