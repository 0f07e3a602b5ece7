import math

import pytest
import torch

from serve_app.flowgrpo.sde import SolverHistory, kl_between_means, ode_step, sde_step


def _inputs(batch=3, shape=(4, 5), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g).to(dtype)
    v = torch.randn(batch, *shape, generator=g).to(dtype)
    return v, x


def test_sde_log_prob_is_mean_of_normal_density():
    v, x = _inputs()
    out = sde_step(v, x, 0.7, 0.6, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    expected = torch.distributions.Normal(out.mean, out.std).log_prob(out.prev_sample.float()).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_prob, expected, rtol=0, atol=1e-5)
    assert out.log_prob.shape == (3,)


def test_sde_mean_and_std_follow_flow_sde_formula():
    v, x = _inputs()
    sigma, sigma_next, a = 0.7, 0.6, 0.7
    out = sde_step(v, x, sigma, sigma_next, noise_level=a)
    dt = sigma_next - sigma
    std_dev_t = a * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.full((3, 1, 1), std_dev_t * math.sqrt(-dt)))


def test_scoring_the_sampled_value_gives_the_same_log_prob_exactly():
    v, x = _inputs()
    sampled = sde_step(v, x, 0.9, 0.8, noise_level=1.2, generator=torch.Generator().manual_seed(3))
    scored = sde_step(v, x, 0.9, 0.8, noise_level=1.2, prev_sample=sampled.prev_sample)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    assert torch.equal(torch.exp(scored.log_prob - sampled.log_prob), torch.ones(3))


def test_bf16_input_scores_the_rounded_sample():
    v, x = _inputs(dtype=torch.bfloat16)
    sampled = sde_step(v, x, 0.9, 0.8, noise_level=1.0, generator=torch.Generator().manual_seed(3))
    assert sampled.prev_sample.dtype == torch.bfloat16
    assert sampled.mean.dtype == torch.float32
    rescored = sde_step(v, x, 0.9, 0.8, noise_level=1.0, prev_sample=sampled.prev_sample)
    assert torch.equal(rescored.log_prob, sampled.log_prob)


def test_noise_level_zero_and_ode_are_the_euler_step():
    v, x = _inputs()
    for kwargs in ({"noise_level": 0.0}, {"noise_level": 0.7, "sde_type": "ode"}):
        out = sde_step(v, x, 0.5, 0.25, **kwargs)
        torch.testing.assert_close(out.prev_sample, x + v * (0.25 - 0.5))
        assert torch.equal(out.log_prob, torch.zeros(3))


def test_sigma_one_stays_finite():
    v, x = _inputs()
    out = sde_step(v, x, 1.0, 0.9, noise_level=1.2, generator=torch.Generator().manual_seed(0))
    for t in (out.prev_sample, out.log_prob, out.mean, out.std):
        assert torch.isfinite(t).all()
    # The denominator falls back to 1 - sigma_next: std = a * sqrt(1 / 0.1) * sqrt(0.1) = a.
    torch.testing.assert_close(out.std, torch.full((3, 1, 1), 1.2))


def test_cps_preserves_the_marginal_coefficients():
    # With a perfect velocity v = eps - x0, CPS mean = (1 - s') x0 + sqrt(s'^2 - std^2) eps, so
    # signal + noise variances stay those of x_{s'} = (1 - s') x0 + s' eps.
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    sigma, sigma_next, a = 0.8, 0.6, 0.7
    x = (1 - sigma) * x0 + sigma * eps
    out = sde_step(eps - x0, x, sigma, sigma_next, noise_level=a, sde_type="cps")
    std = sigma_next * math.sin(a * math.pi / 2)
    torch.testing.assert_close(out.std, torch.full((2, 1, 1), std))
    torch.testing.assert_close(out.mean, (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps, atol=1e-6, rtol=0)
    assert math.isclose(float(out.std[0, 0, 0]) ** 2 + (sigma_next**2 - std**2), sigma_next**2, rel_tol=1e-6)
    torch.testing.assert_close(out.log_prob, -((out.prev_sample - out.mean) ** 2).mean(dim=(1, 2)))


def test_dance_step_restates_dance_grpo():
    # DanceGRPO's flux_step written out: Euler mean, plus -a^2/2 * score * dsigma with the score
    # -(x - (1 - s) x0_hat) / s^2, std a sqrt(s - s'), and the full Gaussian log-density.
    v, x = _inputs()
    sigma, sigma_next, a = 0.7, 0.55, 0.3
    out = sde_step(v, x, sigma, sigma_next, noise_level=a, sde_type="dance", generator=torch.Generator().manual_seed(2))
    dsigma = sigma_next - sigma
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    mean = x + dsigma * v + (-0.5 * a**2 * score) * dsigma
    std = a * math.sqrt(sigma - sigma_next)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.full((3, 1, 1), std))
    log_prob = (-((out.prev_sample - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi)))
    torch.testing.assert_close(out.log_prob, log_prob.mean(dim=(1, 2)))
    rescored = sde_step(v, x, sigma, sigma_next, noise_level=a, sde_type="dance", prev_sample=out.prev_sample)
    assert torch.equal(rescored.log_prob, out.log_prob)


def test_dance_step_with_a_perfect_velocity_keeps_the_signal():
    # The score drift only moves the noise part, shrinking it for the noise the step adds: with
    # v = eps - x0 the mean is (1 - s') x0 + (s' - a^2 |dt| / (2 s)) eps.
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    sigma, sigma_next, a = 0.8, 0.6, 0.5
    x = (1 - sigma) * x0 + sigma * eps
    out = sde_step(eps - x0, x, sigma, sigma_next, noise_level=a, sde_type="dance")
    expected = (1 - sigma_next) * x0 + (sigma_next - a**2 * (sigma - sigma_next) / (2 * sigma)) * eps
    torch.testing.assert_close(out.mean, expected, atol=1e-6, rtol=0)


def test_tensor_sigmas_per_sample():
    v, x = _inputs()
    sigma = torch.tensor([0.9, 0.5, 0.3])
    out = sde_step(v, x, sigma, sigma - 0.1, noise_level=0.0)
    torch.testing.assert_close(out.prev_sample, x - 0.1 * v)


def test_per_sample_generators_make_rows_independent_of_neighbours():
    v, x = _inputs(batch=3)
    gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12)]
    batched = sde_step(v, x, 0.9, 0.8, noise_level=1.0, generator=gens)
    alone = sde_step(v[1:2], x[1:2], 0.9, 0.8, noise_level=1.0, generator=[torch.Generator().manual_seed(11)])
    assert torch.equal(batched.prev_sample[1:2], alone.prev_sample)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sigma": 0.5, "sigma_next": 0.5}, "sigma_next"),
        ({"sigma": 0.5, "sigma_next": 0.7}, "sigma_next"),
        ({"noise_level": -0.1}, "noise_level"),
        ({"sde_type": "ddim"}, "sde_type"),
        ({"velocity": torch.zeros(3, 4, 4)}, "velocity"),
        ({"prev_sample": torch.zeros(2, 4, 5)}, "prev_sample"),
        ({"sigma": torch.tensor([0.5, 0.6])}, "sigma"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, name):
    v, x = _inputs()
    args = {"velocity": v, "sample": x, "sigma": 0.9, "sigma_next": 0.8, "noise_level": 0.7}
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        sde_step(args.pop("velocity"), args.pop("sample"), args.pop("sigma"), args.pop("sigma_next"), **args)


def test_kl_between_means_is_per_dim_gaussian_kl():
    mean = torch.zeros(2, 3)
    mean_ref = torch.ones(2, 3)
    std = torch.full((2, 1), 0.5)
    torch.testing.assert_close(kl_between_means(mean, mean_ref, std), torch.full((2,), 1 / (2 * 0.25)))
    p = torch.distributions.Normal(mean, std.expand(2, 3))
    q = torch.distributions.Normal(mean_ref, std.expand(2, 3))
    torch.testing.assert_close(kl_between_means(mean, mean_ref, std), torch.distributions.kl_divergence(p, q).mean(1))


def _gaussian_data_velocity(mu: float, c: float):
    """The exact velocity field when x0 ~ N(mu, c^2) per dim and x_s = (1 - s) x0 + s eps, and its flow map:
    the ODE carries x_1 = z to x_0 = mu + c z."""

    def velocity(x: torch.Tensor, s: float) -> torch.Tensor:
        a = 1.0 - s
        x0_mean = mu + a * c**2 / (a**2 * c**2 + s**2) * (x - a * mu)
        return (x - x0_mean) / s

    return velocity


def _solve(velocity, z: torch.Tensor, sigmas: list[float], solver: str) -> torch.Tensor:
    x, history = z, SolverHistory()
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        x, history = ode_step(velocity(x, s), x, s, s_next, solver=solver, history=history)
    return x


def test_euler_ode_step_is_the_deterministic_sde_step_bitwise():
    v, x = _inputs()
    sigma, sigma_next = torch.tensor(0.7), torch.tensor(0.45)
    out, _ = ode_step(v, x, sigma, sigma_next, solver="euler", history=SolverHistory())
    assert torch.equal(out, sde_step(v, x, sigma, sigma_next, noise_level=0.0).prev_sample)
    # Without a previous step, and at the last step, DPM-Solver++(2M) takes the Euler step too.
    first, history = ode_step(v, x, sigma, sigma_next, solver="dpm2m", history=SolverHistory())
    assert torch.equal(first, out)
    last, _ = ode_step(v, x, 0.3, 0.0, solver="dpm2m", history=history)
    torch.testing.assert_close(last, x - 0.3 * v)


def test_dpm2m_step_restates_dpm_solver_pp_2m():
    # The multistep update of Lu et al. (2022), Algorithm 2, in float64 with alpha = 1 - sigma:
    # x_t = (s_t / s_{t-1}) x - alpha_t (e^{-h} - 1) D, D = (1 + 1/(2r)) x0_{t-1} - 1/(2r) x0_{t-2}.
    v_prev, x_prev = _inputs(seed=1)
    v, x = _inputs(seed=2)
    s0, s1, s2 = 0.8, 0.6, 0.35
    _, history = ode_step(v_prev, x_prev, s0, s1, solver="dpm2m", history=SolverHistory())
    out, _ = ode_step(v, x, s1, s2, solver="dpm2m", history=history)
    lam = [math.log((1 - s) / s) for s in (s0, s1, s2)]
    h, h_prev = lam[2] - lam[1], lam[1] - lam[0]
    r = h_prev / h
    d0, d_prev = x.double() - s1 * v.double(), x_prev.double() - s0 * v_prev.double()
    data = (1 + 1 / (2 * r)) * d0 - 1 / (2 * r) * d_prev
    expected = (s2 / s1) * x.double() - (1 - s2) * (math.exp(-h) - 1) * data
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=0)


def test_dpm2m_with_half_the_steps_beats_euler_with_all_of_them_on_an_exact_flow():
    # Gaussian data has an exact velocity and flow map; steps uniform in log-SNR from sigma 0.95 to 0.05.
    mu, c, s_first, s_last = 0.5, 0.8, 0.95, 0.05
    velocity = _gaussian_data_velocity(mu, c)
    z = torch.randn(4, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    at = lambda s: (1 - s) * mu + math.sqrt((1 - s) ** 2 * c**2 + s**2) * z  # noqa: E731
    lam_first, lam_last = math.log((1 - s_first) / s_first), math.log((1 - s_last) / s_last)

    def error(n: int, solver: str) -> float:
        sigmas = [1 / (1 + math.exp(lam_first + (lam_last - lam_first) * i / n)) for i in range(n + 1)]
        return float((_solve(velocity, at(s_first), sigmas, solver) - at(s_last)).abs().max())

    euler = {n: error(n, "euler") for n in (8, 16, 32, 64, 128)}
    dpm = {n: error(n, "dpm2m") for n in (8, 16, 32, 64)}
    assert all(dpm[n] < euler[2 * n] / 2 for n in dpm)
    # Second order: doubling the steps divides the error by about 4 (Euler's by about 2).
    assert dpm[32] / dpm[64] > 3.0 and euler[32] / euler[64] < 2.5


def test_unknown_ode_solver_raises_naming_it():
    v, x = _inputs()
    with pytest.raises(ValueError, match="ode_solver"):
        ode_step(v, x, 0.9, 0.8, solver="heun", history=SolverHistory())
