"""trainer.algorithm and trainer.grpo_guard: what each rollout asks for, what a config may combine, and that one
update of each objective moves the policy up its own surrogate."""

import pytest
import torch

from serve_app.config import ConfigError
from serve_app.flowgrpo.sampler import replay_step, sample_group
from serve_app.policies import load_policy
from serve_app.trainer.algorithms import mix_grpo_window_start, rollout_sampling
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.parallel import DataParallel
from serve_app.trainer.update import PolicyUpdate

# 6 steps, a window of 2 anywhere in the first 3 starts.
SHARED = ["sampling.num_steps=6", "sampling.guidance_scale=1.0", "sampling.sde_window_size=2",
          "sampling.sde_window_range=[0,3]", "trainer.eval_every=0"]


def config(*extra):
    return load_trainer_config("trainer/flowgrpo", [*SHARED, *extra])


def test_mix_grpo_slides_its_window_by_the_stride_every_interval_and_stops_at_max_start():
    cfg = config("trainer.algorithm=mix_grpo", "trainer.mix_grpo.shift_interval=3",
                 "trainer.mix_grpo.stride=2", "trainer.mix_grpo.max_start=3")
    starts = [mix_grpo_window_start(cfg.trainer, index) for index in range(12)]
    assert starts == [0, 0, 0, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    for index, start in enumerate(starts):  # each request names its window's first step exactly
        sampling = rollout_sampling(cfg.trainer, cfg.sampling, index)
        assert sampling.sde_window_range == (start, start + 1)
        assert sampling.model_dump(exclude={"sde_window_range"}) == cfg.sampling.model_dump(exclude={"sde_window_range"})


def test_flow_grpo_sends_the_configured_sampling_unchanged():
    cfg = config()
    assert all(rollout_sampling(cfg.trainer, cfg.sampling, i) == cfg.sampling for i in range(5))


@pytest.mark.parametrize("extra, named", [
    (["trainer.algorithm=mix_grpo", "sampling.sde_window_size=null"], "sampling.sde_window_size"),
    (["trainer.algorithm=mix_grpo", "trainer.mix_grpo.max_start=4"], "trainer.mix_grpo.max_start"),
    (["trainer.algorithm=dance_grpo"], "trainer.algorithm"),
    (["trainer.grpo_guard=true", "sampling.sde_type=cps", "sampling.noise_level=0.5"], "trainer.grpo_guard"),
    (["trainer.algorithm=ppo"], "trainer.algorithm"),
])
def test_a_config_an_algorithm_cannot_serve_fails_at_load_naming_the_settings(extra, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        config(*extra)


@pytest.fixture(scope="module")
def batch(tiny_qwen_dir):
    """One rollout of the base policy (a fresh adapter is a no-op) and zero-mean advantages per group."""
    cfg = config()
    policy = load_policy(tiny_qwen_dir, family="qwen_image")
    tokens = policy.text_processor().tokenize(["a photo of a cat", "a red house"])
    trajectory = sample_group(policy, tokens, 4, cfg.sampling.model_copy(update={"seed": 11}), policy_version=0)
    scores = torch.randn(len(trajectory), generator=torch.Generator().manual_seed(3)).reshape(2, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)).reshape(-1)
    with torch.no_grad():
        means = torch.stack([replay_step(policy, trajectory, k).mean for k in range(2)], 1)
    return trajectory, advantages, means


def one_update(tiny_qwen_dir, batch, *extra):
    """The trainer's update of `batch` with these settings; returns the replayed log-probs [B, K] and means after."""
    trajectory, advantages, _ = batch
    cfg = config("trainer.lr=3e-3", "trainer.inner_epochs=1", "trainer.micro_batch_size=8", "trainer.clip_range=0.2",
                 *extra)
    update = PolicyUpdate(cfg.trainer, load_policy(tiny_qwen_dir, family="qwen_image"), DataParallel())
    stats = update.run(trajectory, advantages, check_onpolicy=True, seed=0, step=0)
    assert len(stats.grad_norms) == 1 and stats.onpolicy_ratio_dev < 1e-6
    with torch.no_grad():
        replayed = [replay_step(update.policy, trajectory, k) for k in range(2)]
    return torch.stack([r.log_prob for r in replayed], 1), torch.stack([r.mean for r in replayed], 1), replayed[0].std


def test_the_clipped_ratio_update_raises_its_surrogate(tiny_qwen_dir, batch):
    trajectory, advantages, _ = batch
    log_probs, _, _ = one_update(tiny_qwen_dir, batch)
    ratio = torch.exp(log_probs - trajectory.log_probs)
    # The surrogate mean(A r) is 0 at r = 1 (the advantages are zero-mean); one ascent step makes it positive.
    gain = float((advantages[:, None] * ratio).mean())
    spread = float((advantages[:, None] * (ratio - 1)).abs().mean())
    assert gain > 0.5 * spread > 0


def test_grpo_guard_raises_its_normalised_surrogate_and_is_another_update(tiny_qwen_dir, batch):
    trajectory, advantages, old_means = batch
    log_probs, means, _ = one_update(tiny_qwen_dir, batch, "trainer.grpo_guard=true")
    # GRPO-Guard's objective restated: the Flow-SDE step's std s_k, r_norm = exp(s_k (log r + b)),
    # b = mean_d (mu - mu_old)^2 / (2 s_k^2), each step weighted by 1 / |dt_k|.
    sigmas, steps = trajectory.sigmas, trajectory.step_indices
    objective = spread = torch.zeros(())
    for k in range(2):
        s_now, s_next = float(sigmas[steps[k]]), float(sigmas[steps[k] + 1])
        dt = s_now - s_next
        noise_level = trajectory.sampling.noise_level
        s = noise_level * (s_now / (1 - (s_next if s_now >= 1 else s_now))) ** 0.5 * dt**0.5
        b = ((means[:, k] - old_means[:, k]) ** 2).flatten(1).mean(1) / (2 * s**2)
        r_norm = torch.exp(s * (log_probs[:, k] - trajectory.log_probs[:, k] + b))
        objective = objective + (advantages * (r_norm - 1)).mean() / dt
        spread = spread + (advantages * (r_norm - 1)).abs().mean() / dt
    assert float(objective) > 0.5 * float(spread) > 0
    plain, _, _ = one_update(tiny_qwen_dir, batch)
    assert (plain - log_probs).abs().max() > 1e-6  # the normalisation changed the step
