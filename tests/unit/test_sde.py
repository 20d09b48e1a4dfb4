"""The Flow-GRPO SDE step against its formulas written out in float64."""

import math

import pytest
import torch

from miles.rollout.sde import ode_step, sde_step_with_logprob


def _reference(v, x, sigma, sigma_next, a, prev, sigma_guard):
    """Flow-GRPO's step in float64; sigma_guard replaces sigma in 1 - sigma when sigma == 1."""
    v, x, prev = v.double(), x.double(), prev.double()
    denom = sigma_guard if sigma == 1.0 else sigma
    sigma_t = a * math.sqrt(sigma / (1.0 - denom))
    dt = sigma_next - sigma
    mean = x * (1 + sigma_t**2 / (2 * sigma) * dt) + v * (1 + sigma_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = sigma_t * math.sqrt(-dt)
    logp = -((prev - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return mean, std, logp.flatten(1).mean(1)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.95), (0.9, 0.8), (0.5, 0.45), (0.2, 0.1), (0.05, 0.0)])
def test_step_matches_float64_formulas(sigma, sigma_next):
    g = torch.Generator().manual_seed(int(sigma * 1000))
    shape = (3, 4, 2, 6, 5)
    v = torch.randn(shape, generator=g)
    x = torch.randn(shape, generator=g)
    a = 0.7
    step = sde_step_with_logprob(v, x, sigma, sigma_next, a, generator=torch.Generator().manual_seed(7))
    mean_ref, std_ref, logp_ref = _reference(v, x, sigma, sigma_next, a, step.prev_sample, sigma_next)

    torch.testing.assert_close(step.mean.double(), mean_ref, rtol=1e-5, atol=1e-6)
    assert step.std.shape == (3, 1, 1, 1, 1)
    torch.testing.assert_close(step.std.double().flatten(), torch.full((3,), std_ref, dtype=torch.float64))
    torch.testing.assert_close(step.log_prob.double(), logp_ref, rtol=1e-5, atol=1e-5)
    assert step.prev_sample.dtype == torch.float32 and step.log_prob.shape == (3,)

    # The sample is mean + std * z with z the generator's standard normal draw.
    z = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(
        step.prev_sample.double(), mean_ref + std_ref * z.double(), rtol=1e-5, atol=1e-5
    )


def test_scoring_a_sample_reproduces_its_log_prob():
    g = torch.Generator().manual_seed(0)
    v, x = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 4, 3, 8, 8, generator=g)
    sampled = sde_step_with_logprob(v, x, 0.7, 0.6, 0.9, generator=g)
    scored = sde_step_with_logprob(v, x, 0.7, 0.6, 0.9, prev_sample=sampled.prev_sample)
    assert torch.equal(scored.log_prob, sampled.log_prob)
    # A different sample scores differently (the test can fail).
    other = sde_step_with_logprob(v, x, 0.7, 0.6, 0.9, prev_sample=sampled.prev_sample + 0.1)
    assert not torch.allclose(other.log_prob, sampled.log_prob)


def test_per_sample_sigmas_and_bf16_inputs():
    g = torch.Generator().manual_seed(1)
    v, x = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    sig, nxt = torch.tensor([0.8, 0.3]), torch.tensor([0.7, 0.2])
    both = sde_step_with_logprob(v.bfloat16(), x, sig, nxt, 0.5, generator=torch.Generator().manual_seed(3))
    assert both.mean.dtype == torch.float32
    for i in range(2):
        mean_ref, std_ref, logp_ref = _reference(
            v[i : i + 1].bfloat16().float(),
            x[i : i + 1],
            sig[i].item(),
            nxt[i].item(),
            0.5,
            both.prev_sample[i : i + 1],
            None,
        )
        torch.testing.assert_close(both.mean[i : i + 1].double(), mean_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(both.log_prob[i : i + 1].double(), logp_ref, rtol=1e-5, atol=1e-5)


def test_gradient_flows_through_mean_only():
    v = torch.randn(2, 3, 4, 4, requires_grad=True)
    x = torch.randn(2, 3, 4, 4)
    prev = torch.randn(2, 3, 4, 4, requires_grad=True)
    step = sde_step_with_logprob(v, x, 0.5, 0.4, 0.7, prev_sample=prev)
    step.log_prob.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert prev.grad is None


def test_ode_step_is_euler():
    v, x = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    out = ode_step(v.bfloat16(), x, 0.6, 0.25)
    torch.testing.assert_close(out.double(), x.double() + v.bfloat16().double() * (0.25 - 0.6))
    # From sigma to 0 with the exact velocity noise - x0, Euler lands on x0.
    x0, noise = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    xs = 0.4 * noise + 0.6 * x0
    torch.testing.assert_close(ode_step(noise - x0, xs, 0.4, 0.0), x0)


def test_rejects_zero_noise_level():
    with pytest.raises(ValueError, match="noise_level"):
        sde_step_with_logprob(torch.zeros(1, 2), torch.zeros(1, 2), 0.5, 0.4, 0.0)
