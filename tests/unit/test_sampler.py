"""The rollout sampler: schedule, SDE step selection, expert routing, CFG, log-prob recompute."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from torch import nn

from miles.models.wan import WanRouting
from miles.rollout.sampler import (
    Rollout,
    cfg_combine,
    compute_log_prob,
    flow_sigmas,
    initial_noise,
    predict_velocity,
    sample_with_logprob,
    sde_step_indices,
)

LATENT = (4, 2, 8, 8)  # (C, F, H, W): 2 * 4 * 4 = 32 tokens
TEXT_LEN, TEXT_DIM = 8, 16


def tiny_wan(seed: int) -> WanTransformer3DModel:
    torch.manual_seed(seed)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=16,
        ffn_dim=32,
        num_layers=1,
    )
    return model.eval()


@pytest.fixture(scope="module")
def experts():
    return [tiny_wan(0), tiny_wan(1)]


def embeds(batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g), torch.randn(
        1, TEXT_LEN, TEXT_DIM, generator=g
    )


# ---------------------------------------------------------------- schedule and step selection


def test_flow_sigmas_endpoints_and_shift():
    for shift in (1.0, 3.0, 5.0):
        sigmas = flow_sigmas(10, shift)
        assert sigmas.shape == (11,) and sigmas.dtype == torch.float32
        assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
        assert bool((sigmas[1:] < sigmas[:-1]).all())
        for i in range(11):
            s = 1 - i / 10
            assert sigmas[i].item() == pytest.approx(shift * s / (1 + (shift - 1) * s), abs=1e-7)
    torch.testing.assert_close(flow_sigmas(4, 1.0), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    # A larger shift spends more steps at high noise.
    assert flow_sigmas(10, 5.0)[5] > flow_sigmas(10, 3.0)[5] > flow_sigmas(10, 1.0)[5]


def test_sde_steps_by_fraction_exclude_the_final_step():
    assert sde_step_indices(10, timestep_fraction=0.6) == [0, 1, 2, 3, 4, 5]  # 0.6*10 is 6.000...01
    assert sde_step_indices(10, timestep_fraction=0.55) == [0, 1, 2, 3, 4, 5]  # ceil
    assert sde_step_indices(10, timestep_fraction=1.0) == list(range(9))
    assert sde_step_indices(2, timestep_fraction=0.1) == [0]
    with pytest.raises(ValueError):
        sde_step_indices(10, timestep_fraction=0.0)


def test_sde_window_is_random_within_range_and_seeded():
    starts = set()
    for seed in range(64):
        steps = sde_step_indices(10, 3, (2, 5), generator=torch.Generator().manual_seed(seed))
        assert steps == list(range(steps[0], steps[0] + 3))
        starts.add(steps[0])
        again = sde_step_indices(10, 3, (2, 5), generator=torch.Generator().manual_seed(seed))
        assert again == steps
    assert starts == {2, 3, 4}  # half-open [2, 5)
    # The default range allows every window that stops before the final step.
    ends = {sde_step_indices(6, 2, generator=torch.Generator().manual_seed(s))[-1] for s in range(64)}
    assert ends == {1, 2, 3, 4}
    with pytest.raises(ValueError, match="final step"):
        sde_step_indices(10, 3, (5, 8))  # a window starting at 7 would include step 9
    with pytest.raises(ValueError):
        sde_step_indices(10, 10)


# ---------------------------------------------------------------- expert routing


class _Recorder:
    def __init__(self, models):
        self.calls = []
        self.handles = [
            m.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, m in enumerate(models)
        ]

    def _hook(self, i):
        def hook(module, args, kwargs):
            self.calls.append((i, kwargs["timestep"][0].clone()))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def test_expert_routing_matches_wan_pipeline(experts):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(8)
    # One boundary between timesteps and one exactly on a timestep (the >= edge).
    for boundary_ratio in (0.875, scheduler.timesteps[3].item() / 1000):
        pipe = WanPipeline(
            tokenizer=None,
            text_encoder=None,
            vae=None,
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            transformer=experts[0],
            transformer_2=experts[1],
            boundary_ratio=boundary_ratio,
        )
        pe, ne = embeds(1)
        rec = _Recorder(experts)
        try:
            pipe(
                prompt_embeds=pe,
                negative_prompt_embeds=ne,
                height=16,
                width=16,
                num_frames=1,
                num_inference_steps=8,
                guidance_scale=2.0,
                output_type="latent",
            )
        finally:
            rec.remove()
        assert {i for i, _ in rec.calls} == {0, 1}
        for used, t in rec.calls:
            assert WanRouting(boundary_ratio).expert_index(t, 2) == used, (t, boundary_ratio)
            assert WanRouting(boundary_ratio).expert_index(t.item(), 2) == used


def test_expert_index_rule():
    assert WanRouting(0.875).expert_index(875.0, 2) == 0
    assert WanRouting(0.875).expert_index(874.9, 2) == 1
    assert WanRouting(0.875).expert_index(10.0, 1) == 0
    assert WanRouting(None).expert_index(10.0, 1) == 0
    with pytest.raises(ValueError):
        WanRouting(None).expert_index(10.0, 2)


# ---------------------------------------------------------------- CFG


class _SpyVelocity(nn.Module):
    """A velocity model simple enough to check CFG by hand; records its batch sizes."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(scale))
        self.batches = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        self.batches.append(hidden_states.shape[0])
        text = encoder_hidden_states.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)
        return (self.scale * hidden_states * text + timestep.view(-1, 1, 1, 1, 1) / 1000,)


def test_cfg_is_batched_and_guided_per_expert():
    models = [_SpyVelocity(1.0), _SpyVelocity(-2.0)]
    x = torch.randn(3, *LATENT)
    pe, ne = embeds(3)
    t_high, t_low = torch.tensor(950.0), torch.tensor(300.0)

    v = predict_velocity(models, x, t_high, pe, ne, (5.0, 1.0), WanRouting(0.9))
    assert models[0].batches == [6] and models[1].batches == []  # one batched [cond; uncond] forward
    v_c = models[0](x, t_high.expand(3), pe)[0]
    v_u = models[0](x, t_high.expand(3), ne.expand(3, -1, -1))[0]
    torch.testing.assert_close(v, v_u + 5.0 * (v_c - v_u))
    torch.testing.assert_close(cfg_combine(v_c, v_u, 5.0), v_u + 5.0 * (v_c - v_u))
    assert not torch.allclose(v, v_c)

    # The low-noise expert has scale 1: no unconditional pass at all (diffusers' rule).
    v2 = predict_velocity(models, x, t_low, pe, ne, (5.0, 1.0), WanRouting(0.9))
    assert models[1].batches == [3]
    torch.testing.assert_close(v2, models[1](x, t_low.expand(3), pe)[0])


def test_batched_cfg_matches_separate_passes_on_wan(experts):
    x = torch.randn(2, *LATENT)
    pe, ne = embeds(2)
    t = torch.tensor(700.0)
    v = predict_velocity(experts[:1], x, t, pe, ne, 3.0, None)
    with torch.no_grad():
        v_c = experts[0](hidden_states=x, timestep=t.expand(2), encoder_hidden_states=pe, return_dict=False)[
            0
        ]
        v_u = experts[0](
            hidden_states=x,
            timestep=t.expand(2),
            encoder_hidden_states=ne.expand(2, -1, -1),
            return_dict=False,
        )[0]
    torch.testing.assert_close(v, v_u + 3.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- sampling loop


def _rollout(models, seed, batch=4, **kw) -> Rollout:
    pe, ne = embeds(batch)
    args = dict(
        num_steps=6,
        shift=3.0,
        guidance_scales=(4.0, 3.0),
        routing=WanRouting(0.9),
        noise_level=0.7,
        timestep_fraction=0.6,
    )
    args.update(kw)
    return sample_with_logprob(models, pe, ne, LATENT, generator=torch.Generator().manual_seed(seed), **args)


def test_rollout_shapes_and_chain(experts):
    r = _rollout(experts, 0)
    assert r.step_indices == [0, 1, 2, 3]
    assert r.latents.shape == r.next_latents.shape == (4, 4, *LATENT)
    assert r.log_probs.shape == (4, 4) and r.final_latents.shape == (4, *LATENT)
    sigmas = flow_sigmas(6, 3.0)
    torch.testing.assert_close(r.sigmas, sigmas[:4])
    torch.testing.assert_close(r.sigma_next, sigmas[1:5])
    torch.testing.assert_close(r.timesteps, sigmas[:4] * 1000)
    # Consecutive SDE steps chain: each step starts where the previous one ended.
    assert torch.equal(r.next_latents[:, :-1], r.latents[:, 1:])
    # Both experts were used (sigma 1 and 0.9375 are above the boundary of 0.9, the rest below).
    assert [WanRouting(0.9).expert_index(t, 2) for t in r.timesteps] == [0, 0, 1, 1]


def test_ode_tail_matches_a_hand_written_loop(experts):
    r = _rollout(experts, 3, timestep_fraction=0.2)  # SDE on steps 0-1, ODE on 2-5
    pe, ne = embeds(4)
    sigmas = flow_sigmas(6, 3.0)
    x = r.next_latents[:, -1]
    for i in range(2, 6):
        t = sigmas[i] * 1000
        model, g = (experts[0], 4.0) if t >= 900 else (experts[1], 3.0)
        with torch.no_grad():
            out = model(
                hidden_states=torch.cat([x, x]),
                timestep=t.expand(8),
                encoder_hidden_states=torch.cat([pe, ne.expand(4, -1, -1)]),
                return_dict=False,
            )[0]
        v_c, v_u = out.chunk(2)
        x = x + (v_u + g * (v_c - v_u)) * (sigmas[i + 1] - sigmas[i])
    torch.testing.assert_close(r.final_latents, x)


def test_recompute_reproduces_rollout_log_probs_exactly(experts):
    r = _rollout(experts, 1)
    pe, ne = embeds(4)
    for k in range(r.num_sde_steps):
        logp, mean, std = compute_log_prob(experts, r, k, pe, ne, (4.0, 3.0), WanRouting(0.9), 0.7)
        assert torch.equal(logp, r.log_probs[:, k]), k
        assert mean.shape == (4, *LATENT) and std.shape == (4, 1, 1, 1, 1)

    # A micro-batch recompute of the same samples also matches (to rounding: batch size changed).
    sub = r.select([1, 3])
    logp, _, _ = compute_log_prob(experts, sub, 2, pe[[1, 3]], ne, (4.0, 3.0), WanRouting(0.9), 0.7)
    torch.testing.assert_close(logp, r.log_probs[[1, 3], 2], rtol=1e-5, atol=1e-5)

    # Changed weights change the log-prob (the equality above is not vacuous) and it has a gradient.
    changed = tiny_wan(2)
    logp, _, _ = compute_log_prob([changed, experts[1]], r, 0, pe, ne, (4.0, 3.0), WanRouting(0.9), 0.7)
    assert not torch.allclose(logp, r.log_probs[:, 0])
    logp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in changed.parameters())


def test_rollout_is_deterministic_from_seed(experts):
    a, b, c = _rollout(experts, 5), _rollout(experts, 5), _rollout(experts, 6)
    for name in ("latents", "next_latents", "log_probs", "final_latents"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.allclose(a.final_latents, c.final_latents)
    w1 = _rollout(
        experts[:1],
        5,
        routing=None,
        guidance_scales=4.0,
        sde_window_size=2,
        sde_window_start_range=(0, 4),
    )
    w2 = _rollout(
        experts[:1],
        5,
        routing=None,
        guidance_scales=4.0,
        sde_window_size=2,
        sde_window_start_range=(0, 4),
    )
    assert w1.step_indices == w2.step_indices and len(w1.step_indices) == 2
    assert torch.equal(w1.final_latents, w2.final_latents)


def test_shared_initial_noise_per_group(experts):
    r = _rollout(experts, 7, same_noise_per_group=True, group_size=2)
    start = r.latents[:, 0]  # step 0 is an SDE step, so this is the initial noise
    assert torch.equal(start[0], start[1]) and torch.equal(start[2], start[3])
    assert not torch.allclose(start[0], start[2])
    # The SDE noise still differs within a group, so the samples diverge.
    assert not torch.allclose(r.final_latents[0], r.final_latents[1])
    # Without sharing every sample starts from its own noise.
    r2 = _rollout(experts, 7)
    assert not torch.allclose(r2.latents[0, 0], r2.latents[1, 0])

    noise = initial_noise(6, (2, 3), torch.Generator().manual_seed(0), group_size=3)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[2], noise[3])
    with pytest.raises(ValueError):
        initial_noise(5, (2, 3), None, group_size=2)


def test_zero_noise_level_is_pure_ode(experts):
    r = _rollout(experts[:1], 0, routing=None, guidance_scales=4.0, noise_level=0.0)
    assert r.num_sde_steps == 0 and r.log_probs.shape == (4, 0) and r.latents.shape == (4, 0, *LATENT)
    again = _rollout(experts[:1], 0, routing=None, guidance_scales=4.0, noise_level=0.0)
    assert torch.equal(r.final_latents, again.final_latents)
