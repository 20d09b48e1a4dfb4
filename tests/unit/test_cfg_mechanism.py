"""bench/cfg_mechanism.py's gradient split: the parts through the conditional and the
unconditional branch of the guided velocity add up to the whole gradient, and each is the chain
rule's g·J_cᵀδ and (1 − g)·J_uᵀδ written out by hand."""

from types import SimpleNamespace

import torch

from bench.cfg_mechanism import grad_vector, guided, step_terms


class _Text(torch.nn.Module):
    """A stand-in transformer whose velocity depends on the latents and, through ``u``, on the text."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.3))
        self.u = torch.nn.Parameter(torch.tensor(0.7))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        text = encoder_hidden_states.mean(dim=(1, 2)).view(-1, 1, 1, 1, 1)
        return (hidden_states * self.w + self.u * text * hidden_states.tanh(),)


def _rollout(generator):
    x = torch.randn(3, 2, 2, 3, 3, generator=generator)
    return SimpleNamespace(
        num_sde_steps=2,
        latents=torch.stack([x, 0.9 * x], dim=1),
        next_latents=torch.stack([0.9 * x, 0.8 * x], dim=1) + 0.05,
        timesteps=torch.tensor([900.0, 700.0]),
        sigmas=torch.tensor([0.9, 0.7]),
        sigma_next=torch.tensor([0.7, 0.5]),
    )


def test_branch_gradients_add_up_to_the_guided_gradient():
    g = torch.Generator().manual_seed(0)
    model, ro, scale = _Text(), _rollout(g), 4.0
    batch = {"pos": torch.randn(3, 5, 4, generator=g), "neg": torch.randn(1, 5, 4, generator=g)}
    weights = torch.tensor([1.0, -0.5, 0.25])

    def loss(detach=None):
        return sum((weights * t["log_prob"]).sum() for t in step_terms(model, ro, batch, scale, detach))

    full, cond, uncond = (
        grad_vector(model, loss()),
        grad_vector(model, loss("uncond")),
        grad_vector(model, loss("cond")),
    )
    for name in full:
        torch.testing.assert_close(cond[name] + uncond[name], full[name], rtol=1e-5, atol=1e-7)
    # By hand: dL/dv from the guided velocity, then g·(dv_c/dθ)ᵀ and (1 − g)·(dv_u/dθ)ᵀ.
    terms = step_terms(model, ro, batch, scale)
    for t in terms:
        t["v"].retain_grad()
    total = sum((weights * t["log_prob"]).sum() for t in terms)
    total.backward()
    model.zero_grad(set_to_none=True)
    v_c = [t["v_c"] for t in step_terms(model, ro, batch, scale)]
    by_hand = torch.autograd.grad(
        sum((scale * vc * t["v"].grad).sum() for vc, t in zip(v_c, terms)), model.u
    )[0]
    torch.testing.assert_close(cond["u"], by_hand, rtol=1e-5, atol=1e-7)
    assert cond["u"].abs() > 0 and uncond["u"].abs() > 0  # the test can fail: both branches carry gradient
    # Guidance 1 is the conditional velocity alone.
    v_c0, v_u0 = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(guided(v_c0, v_u0, 1.0), v_c0)
