"""``rollout.sde_type: flow_grpo_wan`` against flow_grpo's own Wan step and float64.

Golden values: flow_grpo's ``sde_step_with_logprob`` of
flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py (yifan123/flow_grpo main at 9745241, the
merge of the Wan PR; the file is unchanged since 11caf1b and is the one scripts/train_wan2_1.py
imports), run outside this repository on the Wan2.1 scheduler flow_grpo's Wan script samples with
(``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
final_sigmas_type="zero")``, 8 steps), ``timestep`` = that step's timestep for both samples, inputs
from ``torch.Generator().manual_seed(200 + step)`` (velocity, latents, then the scored sample, each
(2, 4, 3, 4, 4)), sampling noise from ``manual_seed(7)``. ``weight`` is the Wan script's policy-loss
factor ``std_dev_t.mean() / dt.mean()`` with the ``dt`` (= √|dt|) that function returns.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from miles.rollout.sampler import compute_log_prob, sample_with_logprob, sde_step_indices
from miles.rollout.sde import flow_grpo_wan_step_with_logprob

# The scheduler's sigmas (float32): sigma_max = SIGMAS[1], sigma_min = SIGMAS[-1].
SIGMAS = [0.9999989867210388, 0.9545950293540955, 0.900119960308075, 0.8335554599761963,
          0.7503747940063477, 0.643468976020813, 0.5009989738464355, 0.3016776442527771, 0.0]  # fmt: skip
# step: (log_prob of the scored sample, sum of the mean, mean[0], std_dev_t, sqrt(|dt|), full std,
#        sum of a sample drawn with manual_seed(7), its log_prob, the Wan script's weight)
GOLDEN = {
    0: ([-20.648536682128906, -20.28782844543457], -1.1237093890085816, 0.4691890776157379, 0.954594075679779,
        0.21308204531669617, 0.20340685546398163, -4.012172430753708, [0.24064981937408447, 0.2534724473953247],
        4.479936599731445),
    3: ([-19.15704345703125, -18.242633819580078], 7.349177394993603, -0.911002516746521, 0.7957078814506531,
        0.28841057419776917, 0.22949056327342987, 4.090315278619528, [0.11999606341123581, 0.13281875848770142],
        2.758941411972046),
    7: ([-48.35299301147461, -37.182491302490234], 25.180403728038073, 0.45879122614860535, 0.28797999024391174,
        0.549251914024353, 0.1581735610961914, 22.934271732345223, [0.49216508865356445, 0.5049877166748047],
        0.5243131518363953),
}  # fmt: skip


@pytest.mark.parametrize("step", sorted(GOLDEN))
def test_matches_flow_grpo_wan_step(step):
    log_prob, mean_sum, mean_0, std_dev_t, sqrt_dt, std, sample_sum, sample_log_prob, _ = GOLDEN[step]
    sigma, sigma_next = SIGMAS[step], SIGMAS[step + 1]
    g = torch.Generator().manual_seed(200 + step)
    v, x, prev = (torch.randn(2, 4, 3, 4, 4, generator=g) for _ in range(3))
    out = flow_grpo_wan_step_with_logprob(v, x, sigma, sigma_next, SIGMAS[1], SIGMAS[-1], prev_sample=prev)
    torch.testing.assert_close(out.log_prob, torch.tensor(log_prob), rtol=1e-6, atol=1e-5)
    assert out.mean.double().sum().item() == pytest.approx(mean_sum, rel=1e-6, abs=1e-5)
    assert out.mean.flatten()[0].item() == pytest.approx(mean_0, rel=1e-6)
    assert out.std.flatten()[0].item() == pytest.approx(std, rel=1e-6)
    assert out.std.flatten()[0].item() == pytest.approx(std_dev_t * sqrt_dt, rel=1e-6)
    drawn = flow_grpo_wan_step_with_logprob(
        v, x, sigma, sigma_next, SIGMAS[1], SIGMAS[-1], generator=torch.Generator().manual_seed(7)
    )
    assert drawn.prev_sample.double().sum().item() == pytest.approx(sample_sum, rel=1e-6, abs=1e-5)
    torch.testing.assert_close(drawn.log_prob, torch.tensor(sample_log_prob), rtol=1e-5, atol=1e-6)


def test_matches_the_float64_formula():
    g = torch.Generator().manual_seed(13)
    v, x, prev = (torch.randn(3, 2, 5, 6, generator=g) for _ in range(3))
    sigma, sigma_next, smax, smin = torch.tensor([1.0, 0.6, 0.2]), torch.tensor([0.9, 0.4, 0.0]), 0.93, 0.02
    out = flow_grpo_wan_step_with_logprob(v, x, sigma, sigma_next, smax, smin, prev_sample=prev)
    s, sn = sigma.double().view(-1, 1, 1, 1), sigma_next.double().view(-1, 1, 1, 1)
    st, dt = smin + (smax - smin) * s, sn - s
    mean = x.double() * (1 + st**2 / (2 * s) * dt) + v.double() * (1 + st**2 * (1 - s) / (2 * s)) * dt
    std = st * torch.sqrt(-dt)
    logp = -((prev.double() - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std.double(), std, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.log_prob.double(), logp.mean(dim=(1, 2, 3)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        flow_grpo_wan_step_with_logprob(v, x, sigma, sigma_next, 0.5, 0.5)


def test_step_loss_weight_is_the_wan_scripts():
    """``grpo.step_loss_weight: sigma_over_sqrt_dt`` with ``flow_grpo_wan`` is the Wan script's factor."""
    from miles.algorithms.flow_grpo import FlowGRPO
    from miles.config import Config, GRPOConfig, RolloutConfig

    cfg = Config(
        rollout=RolloutConfig(sde_type="flow_grpo_wan"),
        grpo=GRPOConfig(step_loss_weight="sigma_over_sqrt_dt"),
    )
    steps = sorted(GOLDEN)
    ro = SimpleNamespace(
        sigmas=torch.tensor([SIGMAS[i] for i in steps]),
        sigma_next=torch.tensor([SIGMAS[i + 1] for i in steps]),
        schedule=torch.tensor(SIGMAS),
    )
    for k, step in enumerate(steps):
        assert FlowGRPO(cfg)._step_weight(ro, k) == pytest.approx(GOLDEN[step][-1], rel=1e-6)


def test_trained_step_count_is_floor():
    assert sde_step_indices(20, timestep_fraction=0.99, sde_type="flow_grpo_wan") == list(range(19))
    assert sde_step_indices(8, timestep_fraction=0.6, sde_type="flow_grpo_wan") == list(range(4))
    assert sde_step_indices(8, timestep_fraction=0.6) == list(range(5))  # sde/cps: ceil
    assert sde_step_indices(8, timestep_fraction=1.0, sde_type="flow_grpo_wan") == list(range(8))
    with pytest.raises(ValueError, match="raise rollout.timestep_fraction"):
        sde_step_indices(8, timestep_fraction=0.1, sde_type="flow_grpo_wan")


def test_config_refuses_a_fraction_that_trains_no_step():
    """Refused when the config is read, not at the first rollout; a window ignores the fraction."""
    from miles.config import Config, ConfigError, RolloutConfig

    with pytest.raises(ConfigError, match=r"floor\(0.1 \* 8\) = 0 steps: raise rollout.timestep_fraction"):
        Config(rollout=RolloutConfig(sde_type="flow_grpo_wan", num_steps=8, timestep_fraction=0.1))
    Config(rollout=RolloutConfig(sde_type="flow_grpo_wan", num_steps=8, timestep_fraction=0.125))
    Config(
        rollout=RolloutConfig(sde_type="flow_grpo_wan", num_steps=8, timestep_fraction=0.1, sde_window_size=2)
    )
    Config(rollout=RolloutConfig(sde_type="sde", num_steps=8, timestep_fraction=0.1))  # ceil: one step


class _Linear(torch.nn.Module):
    """A stand-in transformer: v = w·x (enough to test the sampler's plumbing)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.3))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        return (hidden_states * self.w,)


@pytest.mark.parametrize("fraction", [0.6, 1.0])
def test_rollout_is_noisy_at_every_step_and_records_the_trained_ones(fraction):
    """Every step, the last included, is a Wan SDE step drawing its noise in step order; only the
    first ⌊fraction·T⌋ are recorded, and the training recompute reproduces their log-probs."""
    from miles.rollout.sampler import flow_sigmas

    model, embeds, shape, T = _Linear(), torch.zeros(2, 3, 4), (2, 3, 4, 4), 6
    opts = dict(num_steps=T, shift=3.0, guidance_scales=1.0, noise_level=0.7)
    ro = sample_with_logprob(
        [model], embeds, None, shape, **opts, generator=torch.Generator().manual_seed(0),
        timestep_fraction=fraction, sde_type="flow_grpo_wan",
    )  # fmt: skip
    assert ro.step_indices == list(range(math.floor(fraction * T)))
    # The chain by hand: initial noise, then one Wan step per denoising step with its own draw.
    g = torch.Generator().manual_seed(0)
    sig = flow_sigmas(T, 3.0)
    x = torch.randn(2, *shape, generator=g)
    with torch.no_grad():
        for i in range(T):
            x = flow_grpo_wan_step_with_logprob(
                0.3 * x, x, sig[i], sig[i + 1], sig[1], sig[-1], generator=g
            ).prev_sample
    torch.testing.assert_close(ro.final_latents, x, rtol=0, atol=0)
    for k in range(ro.num_sde_steps):
        lp, _, _ = compute_log_prob([model], ro, k, embeds, None, 1.0, None, 0.7, sde_type="flow_grpo_wan")
        assert torch.equal(lp, ro.log_probs[:, k])
    # Evaluation (noise level 0) stays the ODE, as flow_grpo's deterministic Wan eval.
    ode = sample_with_logprob(
        [model], embeds, None, shape, **{**opts, "noise_level": 0.0},
        generator=torch.Generator().manual_seed(0), sde_type="flow_grpo_wan",
    )  # fmt: skip
    assert ode.num_sde_steps == 0 and not torch.equal(ode.final_latents, ro.final_latents)
