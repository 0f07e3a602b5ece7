"""On a CUDA device: the sampler's invariants in the precision real runs use (skipped without a GPU).

The same checks run on CPU in fp32 elsewhere; here bf16 weights and compute meet the fp32 step math.
"""

import pytest
import torch

from serve_app.flowgrpo.sampler import replay_step, sample_group
from serve_app.schemas import SamplingParams

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(num_steps=6, guidance_scale=4.0, noise_level=1.2, sde_window_size=2, sde_window_range=(0, 3), seed=5)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_policy(request, tiny_qwen_dir):
    from serve_app.policies import load_policy

    return load_policy(tiny_qwen_dir, family="qwen_image", device="cuda", dtype=request.param)


def test_replay_on_policy_gives_ratio_one(cuda_policy):
    tokens = cuda_policy.text_processor().tokenize(["a cat", "two red circles"])
    trajectory = sample_group(cuda_policy, tokens, 4, PARAMS, policy_version=0)
    assert torch.isfinite(trajectory.log_probs).all()
    with torch.no_grad():
        replayed = torch.stack([replay_step(cuda_policy, trajectory, k).log_prob.cpu()
                                for k in range(trajectory.log_probs.shape[1])], dim=1)
    # The same batch through the same code: the trainer's first ratio is 1 up to kernel rounding.
    assert (replayed - trajectory.log_probs).abs().max() < 1e-4


def test_a_sample_does_not_depend_on_its_batch(cuda_policy):
    text = cuda_policy.text_processor()
    alone = sample_group(cuda_policy, text.tokenize(["a cat"]), 1, PARAMS, policy_version=0)
    batched = sample_group(cuda_policy, text.tokenize(["a cat"]), 4, PARAMS, policy_version=0)
    tolerance = 1e-4 if cuda_policy.dtype == torch.float32 else 5e-2  # bf16 matmuls block by batch size
    assert (batched.latents[0] - alone.latents[0]).abs().max() < tolerance
