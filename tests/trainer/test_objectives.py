"""GRPO-Guard's RatioNorm and step re-weighting, and DiffusionNFT's loss, against restatements of the papers'
equations written apart from serve_app.trainer.loss (numpy, per-sample loops, the decomposed forms)."""

import math

import numpy as np
import pytest
import torch

from serve_app.flowgrpo.sde import sde_step
from serve_app.trainer.loss import grpo_guard_step_weight, nft_loss, nft_optimality, ratio_norm_log_ratio


def gaussian_log_density(x: np.ndarray, mean: np.ndarray, std: float) -> float:
    """Mean over dimensions of log N(x; mean, std^2), with its constants (Flow-GRPO's per-step log-prob)."""
    return float(np.mean(-((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)))


def test_ratio_norm_is_the_zero_mean_term_of_the_gaussian_log_ratio_scaled_by_the_step_std():
    rng = np.random.default_rng(0)
    rows, dims = 5, 12
    old_mean = rng.normal(size=(rows, dims))
    mean = old_mean + 0.05 * rng.normal(size=(rows, dims))
    std = rng.uniform(0.02, 0.5, size=rows)
    eps = rng.normal(size=(rows, dims))
    x = old_mean + std[:, None] * eps
    log_prob = np.array([gaussian_log_density(x[i], mean[i], std[i]) for i in range(rows)])
    old_log_prob = np.array([gaussian_log_density(x[i], old_mean[i], std[i]) for i in range(rows)])
    got = ratio_norm_log_ratio(*(torch.tensor(a) for a in (log_prob, old_log_prob, mean, old_mean, std)))
    # The paper's decomposition: s (log r + b) is the term mean_d[(mu_theta - mu_old) eps], whatever the step std.
    expected = [float(np.mean((mean[i] - old_mean[i]) * eps[i])) for i in range(rows)]
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-12)
    # The raw log ratio is that term / s minus a positive bias: its mean sits below 0, the normalised one's does not.
    raw = log_prob - old_log_prob
    bias = np.mean((mean - old_mean) ** 2, axis=1) / (2 * std**2)
    np.testing.assert_allclose(raw, np.array(expected) / std - bias, rtol=1e-9, atol=1e-12)


def test_ratio_norm_gives_steps_of_different_std_the_same_log_ratio_spread():
    """Two steps with the same mean shift and noise draws, std 0.05 and 0.5: the raw log ratios differ by 10x in
    spread (and the small step's mean is far below 0); the normalised ones are the same numbers."""
    rng = np.random.default_rng(1)
    draws, dims = 400, 8
    shift = 0.01 * rng.normal(size=dims)
    eps = rng.normal(size=(draws, dims))
    normalised, raw = [], []
    for s in (0.05, 0.5):
        x = s * eps  # mu_old = 0
        logp = torch.tensor([gaussian_log_density(x[i], shift, s) for i in range(draws)], dtype=torch.float64)
        old = torch.tensor([gaussian_log_density(x[i], np.zeros(dims), s) for i in range(draws)], dtype=torch.float64)
        raw.append((logp - old).numpy())
        normalised.append(ratio_norm_log_ratio(logp, old, torch.tensor(shift).expand(draws, dims),
                                               torch.zeros(draws, dims, dtype=torch.float64),
                                               torch.full((draws,), s, dtype=torch.float64)).numpy())
    assert raw[0].std() == pytest.approx(10 * raw[1].std(), rel=1e-6)
    assert raw[0].mean() < -3 * raw[0].std() / math.sqrt(draws)  # the left shift
    np.testing.assert_allclose(normalised[0], normalised[1], rtol=1e-6, atol=1e-12)
    assert abs(normalised[0].mean()) < 3 * normalised[0].std() / math.sqrt(draws)


def test_ratio_norm_reads_the_log_probs_and_std_of_the_sde_step_as_they_are():
    """The convention of serve_app.flowgrpo.sde (log-prob the mean over dims, std [B, 1, ...]) fits RatioNorm:
    scored with the stored prev_sample, two velocities' log ratio normalises to mean_d[(mu_theta - mu_old) eps]."""
    torch.manual_seed(0)
    x, v_old = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    v_new = v_old + 0.1 * torch.randn(3, 4, 5)
    old = sde_step(v_old, x, 0.7, 0.5, noise_level=0.8, generator=torch.Generator().manual_seed(1))
    new = sde_step(v_new, x, 0.7, 0.5, noise_level=0.8, prev_sample=old.prev_sample)
    std = old.std.flatten(1)[:, 0]
    eps = (old.prev_sample - old.mean) / old.std
    got = ratio_norm_log_ratio(new.log_prob, old.log_prob, new.mean, old.mean, std)
    torch.testing.assert_close(got, ((new.mean - old.mean) * eps).flatten(1).mean(1), atol=1e-6, rtol=1e-4)
    # On policy the normalised ratio is exactly 1.
    assert ratio_norm_log_ratio(old.log_prob, old.log_prob, old.mean, old.mean, std).abs().max() == 0


def test_step_reweighting_gives_every_window_step_the_same_gradient():
    """A mean that moves with the parameter by |dt| (mu_theta = mu_old + theta |dt| u): the normalised log ratio's
    gradient at each step is |dt| mean(u eps), so steps of different size pull unequally until each is weighted
    by grpo_guard_step_weight."""
    sigmas = torch.tensor([1.0, 0.9, 0.6, 0.2, 0.0], dtype=torch.float64)
    rng = np.random.default_rng(2)
    u, eps = rng.normal(size=6), rng.normal(size=6)
    gradients, weighted = [], []
    for step in range(3):
        dt = float(sigmas[step] - sigmas[step + 1])
        s = 0.3 * math.sqrt(dt)
        theta = torch.zeros((), dtype=torch.float64, requires_grad=True)
        mean = theta * dt * torch.tensor(u)
        x = s * eps
        logp = -((torch.tensor(x) - mean) ** 2).mean() / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)
        old = gaussian_log_density(x, np.zeros(6), s)
        log_ratio = ratio_norm_log_ratio(logp.reshape(1), torch.tensor([old], dtype=torch.float64), mean.reshape(1, 6),
                                         torch.zeros(1, 6, dtype=torch.float64), torch.tensor([s], dtype=torch.float64))
        (grad,) = torch.autograd.grad(log_ratio.sum(), theta)
        gradients.append(float(grad))
        weighted.append(float(grad) * grpo_guard_step_weight(sigmas, step))
        assert grpo_guard_step_weight(sigmas, step) == pytest.approx(1 / dt)
    assert max(gradients) / min(gradients) == pytest.approx(0.4 / 0.1)
    np.testing.assert_allclose(weighted, [float(np.mean(u * eps))] * 3, rtol=1e-9)


def test_ratio_norm_rejects_a_deterministic_step():
    with pytest.raises(ValueError, match="std > 0"):
        ratio_norm_log_ratio(torch.zeros(2), torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2))


# -- DiffusionNFT ----------------------------------------------------------------------------------------


def nft_reference(x0, eps, t, v_theta, v_old, r, beta, *, adaptive):
    """The paper's loss one sample at a time, the adaptive form written in x0 space (x0_hat = x_t - t v)."""
    total = 0.0
    for i in range(len(x0)):
        x_t = (1 - t[i]) * x0[i] + t[i] * eps[i]
        v_pos = (1 - beta) * v_old[i] + beta * v_theta[i]
        v_neg = (1 + beta) * v_old[i] - beta * v_theta[i]
        terms = []
        for v in (v_pos, v_neg):
            if adaptive:
                x0_hat = x_t - t[i] * v
                terms.append(np.mean((x0_hat - x0[i]) ** 2) / max(np.mean(np.abs(x0_hat - x0[i])), 1e-5))
            else:
                terms.append(np.mean((v - (eps[i] - x0[i])) ** 2))
        total += r[i] * terms[0] + (1 - r[i]) * terms[1]
    return total / len(x0)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("beta", [0.1, 1.0, 2.5])
def test_nft_loss_matches_the_papers_equation(adaptive, beta):
    rng = np.random.default_rng(3)
    x0, eps, v_theta, v_old = (rng.normal(size=(4, 2, 3, 3)) for _ in range(4))
    t, r = rng.uniform(0.05, 0.95, size=4), np.array([0.0, 0.3, 0.5, 1.0])
    got = nft_loss(torch.tensor(v_theta), torch.tensor(v_old), torch.tensor(eps - x0), torch.tensor(r), beta=beta,
                   t=torch.tensor(t) if adaptive else None)
    assert float(got) == pytest.approx(nft_reference(x0, eps, t, v_theta, v_old, r, beta, adaptive=adaptive), rel=1e-5)


def test_nft_r_one_is_the_positive_term_alone_and_beta_one_makes_it_flow_matching_on_v_theta():
    rng = np.random.default_rng(4)
    v_theta, v_old, target = (torch.tensor(rng.normal(size=(3, 8))) for _ in range(3))
    ones = torch.ones(3)
    plain = ((v_theta - target) ** 2).mean()
    torch.testing.assert_close(nft_loss(v_theta, v_old, target, ones, beta=1.0), plain)
    # r = 0: the negative policy 2 v_old - v_theta alone.
    torch.testing.assert_close(nft_loss(v_theta, v_old, target, 0 * ones, beta=1.0),
                               ((2 * v_old - v_theta - target) ** 2).mean())


def test_nft_gradient_at_the_old_policy_follows_r():
    """At v_theta = v_old the gradient is 2 beta (2r - 1)(v_old - v_target) / D: an average sample (r = 1/2) does not
    move the policy, a positive one pulls v_theta toward its target, a negative one pushes it away."""
    rng = np.random.default_rng(5)
    v_old, target = torch.tensor(rng.normal(size=(1, 6))), torch.tensor(rng.normal(size=(1, 6)))
    for r, sign in ((0.5, 0), (1.0, 1), (0.0, -1), (0.8, 1)):
        v_theta = v_old.clone().requires_grad_(True)
        nft_loss(v_theta, v_old, target, torch.tensor([r], dtype=torch.float64), beta=0.7).backward()
        torch.testing.assert_close(v_theta.grad, 2 * 0.7 * (2 * r - 1) * (v_old - target) / 6)
        step = -v_theta.grad  # a gradient step on v_theta
        assert torch.sign((step * (target - v_old)).sum()) == sign


def test_nft_optimality_maps_advantages_into_zero_one():
    r = nft_optimality(torch.tensor([-10.0, -2.0, -1.0, 0.0, 1.0, 3.0]), 2.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0]))
    with pytest.raises(ValueError, match="> 0"):
        nft_optimality(torch.zeros(1), 0.0)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), beta=0.0)
