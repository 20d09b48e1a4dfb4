"""CPS (coefficients-preserving sampling, ``rollout.sde_type: cps``) against flow_grpo and float64.

Golden values: flow_grpo's ``sde_step_with_logprob(..., sde_type="cps")``
(flow_grpo/diffusers_patch/sd3_sde_with_logprob.py at 54809b5), run outside this repository on a
``FlowMatchEulerDiscreteScheduler(shift=3.0)`` grid of 8 steps, noise level 0.7, inputs from
``torch.Generator().manual_seed(100 + step)`` (velocity, latents, then the scored sample, each
(2, 4, 3, 4, 4)) and sampling noise from ``manual_seed(7)``. The float64 test writes the paper's
formula out independently on fresh inputs.
"""

import math

import pytest
import torch

from miles.rollout.sampler import compute_log_prob, sample_with_logprob
from miles.rollout.sde import cps_step_with_logprob

# step: (sigma, sigma_next, log_prob of the scored sample, sum of the mean, mean[0], std,
#        sum of a sample drawn with manual_seed(7), its log_prob)
GOLDEN = {
    0: (1.0, 0.9475425481796265, [-1.197118878364563, -1.1113382577896118], -4.436313587240875,
        -0.15264850854873657, 0.8442665934562683, -16.425255354493856, [-0.6172139048576355, -0.5989342927932739]),
    3: (0.8008373379707336, 0.6937931180000305, [-1.4918259382247925, -1.3669323921203613], -15.11522083543241,
        0.821416974067688, 0.6181741952896118, -23.893555267713964, [-0.3309011161327362, -0.32110103964805603]),
    6: (0.33797216415405273, 0.008928571827709675, [-2.0571162700653076, -1.9671006202697754], 25.903757924796082,
        -1.3952956199645996, 0.007955416105687618, 25.79078848613426, [-5.480280742631294e-05, -5.317969771567732e-05]),
}  # fmt: skip


@pytest.mark.parametrize("step", sorted(GOLDEN))
def test_cps_matches_flow_grpo(step):
    sigma, sigma_next, log_prob, mean_sum, mean_0, std, sample_sum, sample_log_prob = GOLDEN[step]
    g = torch.Generator().manual_seed(100 + step)
    v, x, prev = (torch.randn(2, 4, 3, 4, 4, generator=g) for _ in range(3))
    out = cps_step_with_logprob(v, x, sigma, sigma_next, 0.7, prev_sample=prev)
    torch.testing.assert_close(out.log_prob, torch.tensor(log_prob), rtol=1e-6, atol=1e-7)
    assert out.mean.double().sum().item() == pytest.approx(mean_sum, rel=1e-6, abs=1e-5)
    assert out.mean.flatten()[0].item() == pytest.approx(mean_0, rel=1e-6)
    assert out.std.flatten()[0].item() == pytest.approx(std, rel=1e-6)
    drawn = cps_step_with_logprob(v, x, sigma, sigma_next, 0.7, generator=torch.Generator().manual_seed(7))
    assert drawn.prev_sample.double().sum().item() == pytest.approx(sample_sum, rel=1e-6, abs=1e-5)
    torch.testing.assert_close(drawn.log_prob, torch.tensor(sample_log_prob), rtol=1e-5, atol=1e-9)


def test_cps_matches_the_float64_formula():
    g = torch.Generator().manual_seed(11)
    v, x, prev = (torch.randn(3, 2, 5, 6, generator=g) for _ in range(3))
    sigma, sigma_next, a = torch.tensor([0.9, 0.5, 0.2]), torch.tensor([0.8, 0.3, 0.05]), 0.55
    out = cps_step_with_logprob(v, x, sigma, sigma_next, a, prev_sample=prev)
    s, sn = sigma.double().view(-1, 1, 1, 1), sigma_next.double().view(-1, 1, 1, 1)
    std = sn * math.sin(a * math.pi / 2)
    x0, x1 = x.double() - s * v.double(), x.double() + (1 - s) * v.double()
    mean = x0 * (1 - sn) + x1 * torch.sqrt(sn**2 - std**2)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std.double(), std, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        out.log_prob.double(), -((prev.double() - mean) ** 2).mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="0 < noise_level <= 1"):
        cps_step_with_logprob(v, x, sigma, sigma_next, 1.5)


class _Linear(torch.nn.Module):
    """A stand-in transformer: v = W x, conditioned on nothing (enough to test the plumbing)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        return (hidden_states * self.w,)


def test_cps_rollout_recompute_is_exact():
    model = _Linear()
    embeds = torch.zeros(2, 3, 4)
    ro = sample_with_logprob(
        [model], embeds, None, (2, 3, 4, 4), num_steps=6, shift=3.0, guidance_scales=1.0,
        noise_level=0.7, generator=torch.Generator().manual_seed(0), sde_type="cps",
    )  # fmt: skip
    for k in range(ro.num_sde_steps):
        lp, mean, std = compute_log_prob([model], ro, k, embeds, None, 1.0, None, 0.7, sde_type="cps")
        assert torch.equal(lp, ro.log_probs[:, k])
    with pytest.raises(ValueError, match="sde_type"):
        compute_log_prob([model], ro, 0, embeds, None, 1.0, None, 0.7, sde_type="ddim")
