"""trainer.algorithm and trainer.grpo_guard: what each rollout asks for, what a config may combine, and that one
update of each objective moves the policy up its own surrogate."""

import pytest
import torch

from serve_app.config import ConfigError
from serve_app.flowgrpo.sampler import replay_step, sample_group
from serve_app.policies import load_policy
from serve_app.trainer.algorithms import mix_grpo_window_start, rollout_sampling
from serve_app.trainer.config import load_trainer_config
from serve_app.trainer.loss import nft_optimality
from serve_app.trainer.nft import (ForwardDraws, VelocityMismatchError, check_velocity, conditional_velocity,
                                   final_latents, first_step_latents, forward_generators)
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


def test_flow_grpo_and_dance_grpo_send_the_configured_sampling_unchanged():
    for cfg in (config(), config("trainer.algorithm=dance_grpo", "sampling.sde_type=dance", "sampling.noise_level=0.3")):
        assert all(rollout_sampling(cfg.trainer, cfg.sampling, i) == cfg.sampling for i in range(5))


def test_diffusion_nft_asks_for_ode_rollouts_recorded_as_their_final_latents():
    cfg = config("trainer.algorithm=diffusion_nft")
    sampling = rollout_sampling(cfg.trainer, cfg.sampling, 3)
    assert sampling.noise_level == 0.0 and sampling.record == "final"
    assert sampling.model_dump(exclude={"noise_level", "record"}) == cfg.sampling.model_dump(exclude={"noise_level", "record"})


@pytest.mark.parametrize("extra, named", [
    (["trainer.algorithm=mix_grpo", "sampling.sde_window_size=null"], "sampling.sde_window_size"),
    (["trainer.algorithm=mix_grpo", "trainer.mix_grpo.max_start=4"], "trainer.mix_grpo.max_start"),
    (["trainer.algorithm=dance_grpo"], "sampling.sde_type"),
    (["trainer.algorithm=diffusion_nft", "sampling.group_noise=shared"], "sampling.group_noise"),
    (["trainer.algorithm=diffusion_nft", "trainer.grpo_guard=true"], "trainer.grpo_guard"),
    (["trainer.algorithm=diffusion_nft", "trainer.diffusion_nft.t_range=[0.5,0.2]"], "t_range"),
    (["trainer.grpo_guard=true", "sampling.sde_type=cps", "sampling.noise_level=0.5"], "trainer.grpo_guard"),
    (["trainer.algorithm=ppo"], "trainer.algorithm"),
    (["trainer.algorithm=diffusion_nft", "trainer.diffusion_nft.sampling_decay_max=1.0"], "sampling_decay_max"),
    (["trainer.algorithm=diffusion_nft", "trainer.diffusion_nft.sampling_decay_rate=0.1",
      "trainer.diffusion_nft.sampling_decay_max=0.5", "trainer.prompts_per_step=2", "trainer.distributed.workers=2",
      "trainer.distributed.strategy=fsdp"], "sampling_decay"),
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


def test_dance_grpo_update_raises_its_surrogate(tiny_qwen_dir):
    cfg = config("sampling.sde_type=dance", "sampling.noise_level=0.3", "trainer.algorithm=dance_grpo")
    policy = load_policy(tiny_qwen_dir, family="qwen_image")
    tokens = policy.text_processor().tokenize(["a photo of a cat", "a red house"])
    trajectory = sample_group(policy, tokens, 4, cfg.sampling.model_copy(update={"seed": 11}), policy_version=0)
    scores = torch.randn(len(trajectory), generator=torch.Generator().manual_seed(3)).reshape(2, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)).reshape(-1)
    dance = ((trajectory, advantages, None))
    log_probs, _, _ = one_update(tiny_qwen_dir, dance, "sampling.sde_type=dance", "sampling.noise_level=0.3",
                                 "trainer.algorithm=dance_grpo")
    ratio = torch.exp(log_probs - trajectory.log_probs)
    gain = float((advantages[:, None] * ratio).mean())
    spread = float((advantages[:, None] * (ratio - 1)).abs().mean())
    assert gain > 0.5 * spread > 0


NFT = ["trainer.algorithm=diffusion_nft", "trainer.diffusion_nft.adaptive_weighting=false"]


@pytest.fixture(scope="module")
def nft_batch(tiny_qwen_dir):
    """ODE rollouts recorded as their final latents, and zero-mean advantages per group."""
    cfg = config(*NFT)
    policy = load_policy(tiny_qwen_dir, family="qwen_image")
    tokens = policy.text_processor().tokenize(["a photo of a cat", "a red house"])
    sampling = rollout_sampling(cfg.trainer, cfg.sampling, 0).model_copy(update={"seed": 11})
    trajectory = sample_group(policy, tokens, 4, sampling, policy_version=0)
    scores = torch.randn(len(trajectory), generator=torch.Generator().manual_seed(3)).reshape(2, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)).reshape(-1)
    return trajectory, advantages


def test_diffusion_nft_update_lowers_the_error_of_the_good_samples_and_raises_the_bad_ones(tiny_qwen_dir, nft_batch):
    # At v_theta = v_old the gradient of nft_loss is that of mean_b (2 r_b - 1) ||v_theta - v_target||^2 (times
    # 2 beta): one descent step lowers the flow-matching error of samples with r > 1/2 against that of r < 1/2.
    trajectory, advantages = nft_batch
    # 8 forward draws per sample (2 by default): the step descends the error averaged over t well enough that the
    # 16 probe draws, drawn apart from the training ones, see it on every probe seed tried.
    cfg = config("trainer.lr=3e-3", "trainer.inner_epochs=1", "trainer.micro_batch_size=8",
                 "trainer.diffusion_nft.draws=8", *NFT)
    update = PolicyUpdate(cfg.trainer, load_policy(tiny_qwen_dir, family="qwen_image"), DataParallel())
    x0 = final_latents(trajectory)
    probe = ForwardDraws.of(x0, 16, (0.05, 0.95), forward_generators(99, 0, trajectory.seeds))
    rows = torch.arange(len(trajectory))

    def errors() -> torch.Tensor:
        with torch.no_grad():
            v = torch.stack([conditional_velocity(update.policy, trajectory, probe.x_t[:, d], probe.t[:, d], rows)
                             for d in range(probe.t.shape[1])], 1)
        return (v - probe.v_target).flatten(2).pow(2).mean(2).mean(1)

    before = errors()
    stats = update.run(trajectory, advantages, check_onpolicy=True, seed=0, step=0)
    assert len(stats.grad_norms) == 1 and stats.checks["nft_velocity_error"] < 1e-4
    change = errors() - before
    weight = 2 * nft_optimality(advantages, 1.0) - 1
    gain = float((weight * change).mean())
    assert gain < -0.5 * float((weight * change).abs().mean()) < 0


def test_the_velocity_check_catches_the_weights_of_one_update_later(tiny_qwen_dir, nft_batch):
    """The check takes the first step of some rows again: with the weights that sampled them it lands within float
    order of the recorded one; after one DiffusionNFT update at the shapes world's learning rate, far outside the
    bound."""
    trajectory, advantages = nft_batch
    cfg = config("trainer.lr=5e-4", "trainer.inner_epochs=1", "trainer.micro_batch_size=8", *NFT)
    update = PolicyUpdate(cfg.trainer, load_policy(tiny_qwen_dir, family="qwen_image"), DataParallel())
    bound = cfg.trainer.diffusion_nft.max_velocity_error
    same = [check_velocity(update.policy, trajectory, torch.tensor(rows), bound=bound) for rows in ([1, 6], [0, 3, 5])]
    # Another batch shape than the sampler's: equal to within a few units in the last place of the latents.
    assert max(same) < bound / 20, same
    # The recorded first step is the sampler's: the ODE's first step from the sample's own noise.
    assert not torch.equal(first_step_latents(trajectory), final_latents(trajectory))
    update.run(trajectory, advantages, check_onpolicy=True, seed=0, step=0)
    with pytest.raises(VelocityMismatchError, match="policy version 0") as raised:
        check_velocity(update.policy, trajectory, torch.tensor([1, 6]), bound=bound)
    print(raised.value)  # -s shows how far one update moves the first step's velocity


@pytest.mark.parametrize("side", ["high", "low"])
def test_diffusion_nft_on_wan22_trains_the_expert_of_each_draws_noise_level(flowgrpo_home, side):
    """Wan2.2-A14B's two experts (tiny-wan22: the low-noise transformer_2 below boundary_ratio 0.875): DiffusionNFT's
    velocity at a forward draw runs the expert of the draw's t, as a sampling step at that sigma does, so draws all
    above the boundary train the high-noise expert's adapter alone and draws all below it the low-noise one's."""
    from serve_app.models import ensure_embedded_model

    policy = load_policy(ensure_embedded_model("tiny-wan22"), family="wan")
    boundary = policy.boundary_timestep / 1000
    t_range = f"[{boundary + 0.02},1.0]" if side == "high" else f"[0.02,{boundary - 0.02}]"
    cfg = load_trainer_config("trainer/flowgrpo", [
        "model=tiny_wan22", "reward=video_brightness", "sampling.num_frames=5", "sampling.num_steps=3",
        "sampling.guidance_scale=1.0", "sampling.group_noise=independent", "trainer.lr=1e-2", "trainer.inner_epochs=1",
        "trainer.micro_batch_size=8", f"trainer.diffusion_nft.t_range={t_range}", *NFT])
    tokens = policy.text_processor().tokenize(["a red circle moving left", "a blue square moving right"])
    sampling = rollout_sampling(cfg.trainer, cfg.sampling, 0).model_copy(update={"seed": 5, "height": 32, "width": 32})
    trajectory = sample_group(policy, tokens, 4, sampling, policy_version=0)
    scores = torch.randn(len(trajectory), generator=torch.Generator().manual_seed(4)).reshape(2, 4)
    advantages = ((scores - scores.mean(1, keepdim=True)) / scores.std(1, keepdim=True)).reshape(-1)

    update = PolicyUpdate(cfg.trainer, policy, DataParallel())
    before = {k: v.clone() for k, v in update.model.publishable_state().items()}
    stats = update.run(trajectory, advantages, check_onpolicy=True, seed=0, step=0)
    assert stats.checks["nft_velocity_error"] < 1e-4
    after = update.model.publishable_state()
    moved = {k: float((after[k] - before[k]).abs().max()) for k in before}
    low = [m for k, m in moved.items() if k.startswith("transformer_2.")]
    high = [m for k, m in moved.items() if not k.startswith("transformer_2.")]
    assert low and high
    trained, untouched = (high, low) if side == "high" else (low, high)
    assert max(trained) > 1e-3 and max(untouched) == 0.0, moved


@pytest.mark.parametrize("delay, rate, top", [(0, 0.001, 0.5), (75, 0.0075, 0.999), (3, 0.25, 0.6)])
def test_the_sampling_policys_decay_is_zero_through_the_delay_then_rises_to_its_max(delay, rate, top):
    from serve_app.trainer.nft import sampling_decay

    cfg = config("trainer.algorithm=diffusion_nft", f"trainer.diffusion_nft.sampling_decay_delay={delay}",
                 f"trainer.diffusion_nft.sampling_decay_rate={rate}", f"trainer.diffusion_nft.sampling_decay_max={top}")
    assert cfg.trainer.diffusion_nft.averages_sampling
    for update in range(0, 400, 7):
        # Restated: no averaging for the first `delay` updates, then a linear ramp from 0, capped.
        expected = 0.0 if update < delay else rate * (update - delay)
        expected = top if expected > top else expected
        assert sampling_decay(cfg.trainer.diffusion_nft, update) == pytest.approx(expected, abs=1e-12)
    assert sampling_decay(cfg.trainer.diffusion_nft, 10**6) == top
    assert not config("trainer.algorithm=diffusion_nft").trainer.diffusion_nft.averages_sampling
