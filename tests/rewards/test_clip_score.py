"""CLIP score and PickScore over the tiny random CLIP, loaded from its saved directory like a real one.

The tiny model's weights are random: these tests check the plumbing and the scoring rule, not quality.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from serve_app.rewards import CompositeReward, build_reward, registered_rewards
from serve_app.rewards.clip_score import load_clip


def noise(b, size=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, size, size), dtype=torch.uint8, generator=g)


PROMPTS = ["a red cube", "a red cube", "two cats on a mat", "two cats on a mat"]


@pytest.fixture(scope="module")
def clip_dir(flowgrpo_home):
    from serve_app.models import ensure_tiny_clip

    return ensure_tiny_clip()


def test_registered_without_importing_transformers():
    assert {"clip_score", "pickscore"} <= set(registered_rewards())
    code = "import sys, serve_app.rewards as r; r.registered_rewards(); print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["clip_score", "pickscore"])
def test_scores_finite_shaped_and_deterministic(clip_dir, name):
    images = noise(4)
    reward = build_reward(name, path=str(clip_dir))
    first = reward(images, PROMPTS)
    assert first.shape == (4,) and first.dtype == torch.float32
    assert torch.isfinite(first).all()
    # Random weights still give distinct scores per (image, prompt) pair.
    assert first.unique().numel() == 4
    again = build_reward(name, path=str(clip_dir), batch_size=3)(images, PROMPTS)
    # Another batch size blocks the matmuls differently: scores of ~30 move by a few float32 ulps (1 ulp: ~4e-6).
    torch.testing.assert_close(again, first, rtol=1e-6, atol=0)
    assert torch.equal(reward(images, PROMPTS), first)


def test_scores_equal_hand_computation_with_clip_forward(clip_dir):
    """CLIPModel's own forward gives logits = logit_scale.exp() * cos for every (image, text) pair."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(str(clip_dir), local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(str(clip_dir), local_files_only=True)
    images = noise(4, size=48, seed=3)
    inputs = processor(text=PROMPTS, images=list(images), padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits_per_image  # [images, texts]
    scale = model.logit_scale.exp().item()
    expected_pick = logits.diagonal()
    expected_clip = 100.0 * expected_pick / scale
    # The tiny model's logit scale is CLIP's initial 1/0.07, so the two rules differ by 100/14.3.
    assert abs(scale - 1 / 0.07) < 1e-3

    pick = build_reward("pickscore", path=str(clip_dir))(images, PROMPTS)
    clip = build_reward("clip_score", path=str(clip_dir))(images, PROMPTS)
    torch.testing.assert_close(pick, expected_pick, rtol=0, atol=1e-5)
    torch.testing.assert_close(clip, expected_clip, rtol=0, atol=1e-4)
    assert (clip.abs() <= 100).all()


def test_score_changes_with_image_and_with_prompt(clip_dir):
    reward = build_reward("clip_score", path=str(clip_dir))
    a, b = noise(1, seed=1), noise(1, seed=2)
    same_prompt = reward(torch.cat([a, b]), ["a red cube", "a red cube"])
    assert abs(same_prompt[0] - same_prompt[1]) > 1e-3
    same_image = reward(torch.cat([a, a]), ["a red cube", "two cats on a mat"])
    assert abs(same_image[0] - same_image[1]) > 1e-3
    # Each image is scored with its own prompt: a mixed batch equals the single-prompt batches.
    mixed = reward(torch.cat([a, b]), ["a red cube", "two cats on a mat"])
    torch.testing.assert_close(mixed[0], reward(a, ["a red cube"])[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(mixed[1], reward(b, ["two cats on a mat"])[0], rtol=0, atol=1e-4)


def test_model_loaded_once_per_process(clip_dir):
    first = load_clip(str(clip_dir))
    assert load_clip(str(clip_dir) + "/") is first
    assert load_clip(str(clip_dir), dtype="bfloat16")[0] is not first[0]


def test_bfloat16_close_to_float32(clip_dir):
    images = noise(4, seed=5)
    fp32 = build_reward("pickscore", path=str(clip_dir))(images, PROMPTS)
    bf16 = build_reward("pickscore", path=str(clip_dir), dtype="bfloat16")(images, PROMPTS)
    assert bf16.dtype == torch.float32
    # bf16 keeps ~3 significant digits of a score of size ~10.
    torch.testing.assert_close(bf16, fp32, rtol=0, atol=0.3)


def test_bad_paths_and_args_fail_clearly(tmp_path, clip_dir):
    missing = tmp_path / "no-such-clip"
    with pytest.raises(FileNotFoundError, match="no-such-clip.*does not exist.*nothing is downloaded"):
        build_reward("clip_score", path=str(missing))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        build_reward("pickscore", path=str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="cannot load a CLIPModel from"):
        build_reward("pickscore", path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="CLIP processor directory"):
        build_reward("pickscore", path=str(clip_dir), processor_path=str(missing))
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_reward("clip_score", path=str(clip_dir), dtype="float64")
    with pytest.raises(ValueError, match="bad args for reward 'clip_score'"):
        build_reward("clip_score")


def test_composite_reward_runs_clip_and_reports_bad_input(clip_dir):
    composite = CompositeReward([{"name": "pickscore", "args": {"path": str(clip_dir)}, "weight": 0.5}])
    images = noise(2)
    out = composite.score(images, PROMPTS[:2])
    direct = build_reward("pickscore", path=str(clip_dir))(images, PROMPTS[:2])
    torch.testing.assert_close(out["total"], 0.5 * direct)
    with pytest.raises(ValueError, match="uint8"):
        composite.score(images.float(), PROMPTS[:2])
