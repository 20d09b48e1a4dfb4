"""AWM, DGPO and online DPO losses against golden values from their reference implementations and
against float64 re-derivations of their formulas.

The golden values were produced outside this repository by running the references' own loss code
on the inputs ``_inputs`` builds (the same generator seeds, float64):
scxue/advantage_weighted_matching ``compute_log_prob_awm`` (commit be51372) with its training
loop's advantage rescale and exp_first clipped loss; Luo-Yihong/DGPO
``compute_group_dgpo_loss_allreduce`` (commit 01ceb4b, one gloo process) with its ``clip_dsm``
lines; flow_grpo (commit ac4c86e) ``scripts/train_sd3_dpo.py``'s loss lines (chosen/rejected halves, shared noise).
Each test compares the loss and two functionals of its gradient with respect to the velocity
(Σ g², Σ g·x0).

The ``accumulate`` tests run each algorithm's optimizer step on a toy velocity model over three
micro-batches (a group spanning two of them) and compare the parameter gradient with autograd of
the whole step's loss written out at once: DGPO's group weights and clip, DPO's margin pairs and
AWM's regularisers, through the two-pass scheme of ``miles.algorithms.matching``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.algorithms.awm import awm_advantages, awm_log_prob, awm_policy_loss
from miles.algorithms.dgpo import dgpo_coefficients, group_weights
from miles.algorithms.matching import draw_levels, level_candidates, matching_error
from miles.algorithms.online_dpo import dpo_coefficients, select_pairs


def _inputs(seed, shape=(4, 2, 3, 4, 4)):
    g = torch.Generator().manual_seed(seed)
    x0, noise, *rest = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(5))
    return x0, noise, *((noise - x0) + 0.3 * r for r in rest)  # v, v_ref, v_old near the target


def _grad_stats(grad, x0):
    return (grad**2).sum().item(), (grad * x0).sum().item()


AWM_GOLDEN = {  # weighting: (lp, loss, Σ g², Σ g·x0)
    "uniform": ([-0.08797543383648791, -0.08695360465075523, -0.06753780837365077, -0.11037057011163603], 0.000259458369709704, -0.0053143991976714496),
    "t": ([-0.06158280368554153, -0.06086752325552866, -0.04727646586155553, -0.07725939907814522], 0.00012713460115775494, -0.0037200794383700133),
    "t2": ([-0.04310796257987907, -0.04260726627887006, -0.03309352610308887, -0.05408157935470165], 6.22959545672999e-05, -0.002604055606859009),
    "huber": ([-0.20761757135146378, -0.20640827639171974, -0.18190926137343763, -0.23254746545637786], 0.0004196901035940998, -0.0072757793110348225),
    "ghuber": ([-1.5160702761447458, -1.5116228816998725, -1.4185425986526063, -1.6050260434970929], 0.006178740787499249, -0.02879325316209283),
}  # fmt: skip


@pytest.mark.parametrize("weighting", list(AWM_GOLDEN))
def test_awm_matches_reference(weighting):
    x0, noise, v, _, _ = _inputs(1)
    v.requires_grad_(True)
    lp = awm_log_prob(matching_error(v, x0, noise), 0.7, weighting, 0.25)
    adv = awm_advantages(torch.tensor([1.7, -0.4, 6.0, -2.2], dtype=torch.float64), 5.0, 1.0)
    loss = awm_policy_loss(lp, adv)
    loss.backward()
    golden_lp, sum_sq, dot = AWM_GOLDEN[weighting]
    torch.testing.assert_close(lp.detach(), torch.tensor(golden_lp, dtype=torch.float64), rtol=1e-12, atol=0)
    assert loss.item() == pytest.approx(-0.205, rel=1e-12)  # −mean(A) with A rescaled to ±1
    assert _grad_stats(v.grad, x0) == pytest.approx((sum_sq, dot), rel=1e-10)


def test_awm_gradient_is_advantage_weighted_matching():
    """−A·∇lp with uniform weighting is the gradient of mean(A·e): the flow-matching loss weighted by A."""
    x0, noise, v, _, _ = _inputs(4)
    adv = torch.tensor([0.5, -1.0, 0.2, 0.3], dtype=torch.float64)
    a = v.clone().requires_grad_(True)
    awm_policy_loss(awm_log_prob(matching_error(a, x0, noise), 0.4, "uniform"), adv).backward()
    b = v.clone().requires_grad_(True)
    (adv * ((b - (noise - x0)) ** 2).mean(dim=(1, 2, 3, 4))).mean().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-13, atol=0)


DGPO_GOLDEN = {  # (beta_dpo, clip_range): (loss, Σ g², Σ g·x0)
    (100.0, 0.0): (0.00018344090839972292, 0.00010824824790861307, -0.0004409143187260791),
    (10.0, 1e-2): (4.266660641570145e-05, 1.8224232246802522e-05, -0.0028266903897986506),
}


@pytest.mark.parametrize("beta_dpo,clip_range", list(DGPO_GOLDEN))
def test_dgpo_matches_reference(beta_dpo, clip_range):
    x0, noise, v, v_ref, v_old = _inputs(2, (6, 2, 3, 4, 4))
    adv = torch.tensor([1.2, -0.3, -0.9, 0.5, 0.8, -1.3], dtype=torch.float64)
    gids = torch.tensor([5, 5, 5, 9, 9, 9])
    v.requires_grad_(True)
    err = matching_error(v, x0, noise)
    err_ref, err_old = matching_error(v_ref, x0, noise), matching_error(v_old, x0, noise)
    coef, w, clip = dgpo_coefficients(err, err_ref, adv, gids, beta_dpo, err_old, clip_range)
    (coef * err).sum().backward()
    loss, sum_sq, dot = DGPO_GOLDEN[(beta_dpo, clip_range)]
    assert (w * adv * err).mean().item() == pytest.approx(loss, rel=1e-10)
    assert _grad_stats(v.grad, x0) == pytest.approx((sum_sq, dot), rel=1e-10)
    if clip_range:
        assert clip.tolist() == [True, False, True, True, False, True]  # the reference's mask


def test_dgpo_group_weight_formula():
    """w_g = sigmoid(β Σ_{i∈g} A_i (e_i − e_ref,i) / n_g), written out per group in float64."""
    g = torch.Generator().manual_seed(5)
    err, err_ref, adv = (torch.rand(7, generator=g, dtype=torch.float64) for _ in range(3))
    gids = torch.tensor([3, 1, 3, 1, 1, 8, 3])
    w = group_weights(err, err_ref, adv, gids, 20.0)
    for i in range(7):
        members = [j for j in range(7) if gids[j] == gids[i]]
        s = sum(adv[j] * (err[j] - err_ref[j]) for j in members) * 20.0 / len(members)
        assert w[i].item() == pytest.approx(1 / (1 + torch.exp(-s).item()), rel=1e-13)


DPO_GOLDEN = {100.0: (0.04439365619199009, 0.2555987775988745, -0.384807598122646), 5.0: (0.589716841008475, 0.0354523052926873, -0.3486835777405729)}  # fmt: skip


@pytest.mark.parametrize("beta", list(DPO_GOLDEN))
def test_dpo_matches_reference(beta):
    """flow_grpo's chosen/rejected halves are three groups of one pair each (best vs worst)."""
    x0, noise, v, v_ref, _ = _inputs(3, (6, 2, 3, 4, 4))
    noise = torch.cat([noise[:3], noise[:3]])  # a pair shares its noise
    gids = torch.tensor([0, 1, 2, 0, 1, 2])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0])
    pairs = select_pairs(adv, adv, gids, "best_worst", 0.0)
    assert pairs == [[(0, 3)], [(1, 4)], [(2, 5)]]
    v.requires_grad_(True)
    err = matching_error(v, x0, noise)
    coef, loss, z = dpo_coefficients(err, matching_error(v_ref, x0, noise), pairs, beta)
    (coef * err).sum().backward()
    golden_loss, sum_sq, dot = DPO_GOLDEN[beta]
    assert loss.item() == pytest.approx(golden_loss, rel=1e-10)
    assert (z > 0).all()  # the reference's implicit accuracy is 1.0 on these inputs
    assert _grad_stats(v.grad, x0) == pytest.approx((sum_sq, dot), rel=1e-10)


def test_dpo_margin_pairs_and_gradient_formula():
    """``margin`` keeps every ordered pair whose rewards differ by more than the margin; the
    coefficient gradient equals autograd of mean_groups mean_pairs −log σ(z) in float64."""
    adv = torch.tensor([0.9, -0.2, 0.1, 1.5, -1.5, 0.0])
    rewards = torch.tensor([0.8, 0.3, 0.5, 0.9, 0.1, 0.5])
    gids = torch.tensor([4, 4, 4, 7, 7, 7])
    pairs = select_pairs(adv, rewards, gids, "margin", 0.35)
    assert pairs == [[(0, 1)], [(3, 4), (3, 5), (5, 4)]]  # (0, 2), (2, 1): rewards 0.3, 0.2 apart
    assert select_pairs(-adv, rewards, gids, "best_worst", 0.0) == [[(1, 0)], [(4, 3)]]  # negated: swapped
    g = torch.Generator().manual_seed(6)
    err = torch.rand(6, generator=g, dtype=torch.float64, requires_grad=True)
    err_ref = torch.rand(6, generator=g, dtype=torch.float64)
    coef, loss, _ = dpo_coefficients(err.detach(), err_ref, pairs, 3.0)
    d = err - err_ref
    per_group = [torch.stack([-F.logsigmoid(-1.5 * (d[w] - d[lo])) for w, lo in grp]).mean() for grp in pairs]
    ref = torch.stack(per_group).mean()
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-13)
    torch.testing.assert_close(coef, err.grad, rtol=1e-12, atol=0)


def test_levels_are_drawn_from_the_grid_prefix():
    candidates = level_candidates(10, 3.0, 0.7)
    assert len(candidates) == 7 and candidates[0] == 1.0
    picked = draw_levels(candidates, 4, torch.Generator().manual_seed(0))
    assert len(set(picked.tolist())) == 4 and set(picked.tolist()) <= set(candidates.tolist())


# ---------------------------------------------------------------------------------------------
# accumulate() on a toy velocity model: the chunked two-pass gradient (no-grad errors, then
# Σ c_i·e_i per micro-batch) against autograd of the whole step's loss written out at once.


class _Toy(torch.nn.Module):
    """v = W·x (over channels) + t/1000 · b + mean(context) — enough for distinct per-sample errors."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.eye(2) + 0.3 * torch.randn(2, 2, generator=g))
        self.b = torch.nn.Parameter(0.3 * torch.randn(2, generator=g))

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        v = torch.einsum("oc,bcfhw->bofhw", self.w, hidden_states)
        v = v + (timestep / 1000)[:, None, None, None, None] * self.b[None, :, None, None, None]
        return (v + encoder_hidden_states.mean(dim=(1, 2))[:, None, None, None, None],)


def _setup(section: dict, name: str):
    from contextlib import contextmanager
    from types import SimpleNamespace

    from miles.algorithms import build_algorithm
    from miles.algorithms.base import Policy
    from miles.config import AlgorithmConfig, Config, RolloutConfig
    from miles.rollout.batch import MicroBatch, RolloutBatch

    cfg = Config(algorithm=AlgorithmConfig(name=name), rollout=RolloutConfig(num_steps=8), **section)
    trained, reference, old = _Toy(0), _Toy(1).requires_grad_(False), _Toy(2).requires_grad_(False)

    @contextmanager
    def ref():
        yield [reference]

    def generator(*parts):
        return torch.Generator().manual_seed(hash(parts) & 0x7FFF_FFFF)

    policy = Policy([trained], [1.0], None, ref, generator, SimpleNamespace(transformers=[old]))
    g = torch.Generator().manual_seed(9)
    n = 8  # two groups of 4, in micro-batches of 3, 3, 2 (a group spans micro-batches)
    x0 = torch.randn(n, 2, 1, 2, 2, generator=g)
    pos = torch.randn(n, 3, 4, generator=g)
    neg = torch.randn(1, 3, 4, generator=g)  # the negative prompt, batch 1 as the prompt cache gives it
    adv = torch.tensor([1.2, -0.4, 0.3, -1.1, 0.7, -0.9, 0.1, 0.1])
    batch = RolloutBatch(
        prompts=[""] * n,
        images=[None] * n,
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
        sample_ids=torch.arange(n),
        rollout_index=3,
        chunks=[],
        sde_steps=[],
        advantages=adv,
        rewards=torch.tensor([0.9, 0.2, 0.5, 0.1, 0.8, 0.0, 0.4, 0.45]),
    )
    slices = [slice(0, 3), slice(3, 6), slice(6, 8)]
    chunks = [MicroBatch(s, pos[s], neg, SimpleNamespace(final_latents=x0[s])) for s in slices]
    batch.chunks = chunks
    whole = MicroBatch(slice(0, n), pos, neg, SimpleNamespace(final_latents=x0))
    return build_algorithm(cfg), policy, batch, chunks, whole, (trained, reference, old)


def _compare(algo, policy, batch, chunks, whole, trained, num_levels, salts, noise_key, loss_of_level):
    """accumulate()'s gradient against autograd of mean_levels loss_of_level(whole step)."""
    from miles.algorithms.matching import forward_noise, step_levels

    algo.accumulate(policy, batch, chunks)
    chunked = [p.grad.clone() for p in trained.parameters()]
    trained.zero_grad()
    x0 = whole.rollout.final_latents
    for j, sigma in enumerate(step_levels(policy, batch, 0, salts[0], algo.candidates, num_levels)):
        keys = getattr(batch, noise_key).tolist()
        noise = forward_noise(policy, keys, x0.shape[1:], salts[1], batch.rollout_index, j)
        (loss_of_level(x0, noise, sigma) / num_levels).backward()
    for a, b in zip(chunked, trained.parameters()):
        torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)
    assert all(g.abs().sum() > 0 for g in chunked)


def _v(models, policy, whole, x0, noise, sigma, guidance=1.0):
    from miles.algorithms.matching import noised, velocity

    return velocity(models, policy, noised(x0, noise, sigma), sigma, whole, guidance)


@pytest.mark.parametrize("ref_guidance", [1.0, 3.0], ids=["reference-without-cfg", "reference-with-cfg"])
def test_dgpo_accumulate_matches_the_whole_step_loss(ref_guidance):
    """Both modes: the reference without CFG, and with CFG 3 (the fully CFG-free mode's target)."""
    from miles.config import DGPOConfig

    algo, policy, batch, chunks, whole, (trained, ref, old) = _setup(
        {"dgpo": DGPOConfig(clip_range=0.05, kl_beta=0.1, reference_guidance_scale=ref_guidance)}, "dgpo"
    )
    adv, gids = batch.advantages, batch.group_ids

    def loss(x0, noise, sigma):
        v = _v([trained], policy, whole, x0, noise, sigma)
        e = matching_error(v, x0, noise)
        with torch.no_grad():
            v_ref = _v([ref], policy, whole, x0, noise, sigma, ref_guidance)
            if ref_guidance > 1:  # written out: v_uncond + g (v_cond − v_uncond)
                x_t = (1 - sigma) * x0 + sigma * noise
                t = (sigma * 1000).expand(8)
                cond, uncond = ref(x_t, t, whole.pos)[0], ref(x_t, t, whole.neg.expand(8, 3, 4))[0]
                torch.testing.assert_close(v_ref, uncond + ref_guidance * (cond - uncond))
            e_ref, e_old = (
                matching_error(v_ref, x0, noise),
                matching_error(_v([old], policy, whole, x0, noise, sigma), x0, noise),
            )
            # written out: per group, sigmoid(β Σ A (e − e_ref) / n); the clip as the reference forms it
            w = torch.stack(
                [
                    torch.sigmoid(100.0 * (adv[gids == gids[i]] * (e - e_ref)[gids == gids[i]]).mean())
                    for i in range(8)
                ]
            )
            ratio = torch.exp(e_old - e)
            clip = torch.where(adv > 0, ratio > 1.05, ratio < 0.95)
        dsm = torch.where(clip, e.detach(), e)
        return (w * adv * dsm).mean() + 0.1 * ((v - v_ref) ** 2).mean()

    _compare(algo, policy, batch, chunks, whole, trained, 4, (14, 13), "group_ids", loss)


def test_online_dpo_accumulate_matches_the_whole_step_loss():
    from miles.config import DPOConfig

    algo, policy, batch, chunks, whole, (trained, ref, _) = _setup(
        {"dpo": DPOConfig(pairs="margin", reward_margin=0.15, beta=20.0)}, "online_dpo"
    )
    # ordered by advantage, rewards > 0.15 apart: not (1, 3) (0.1 apart) nor 6, 7 (tied advantages)
    pairs = [[(0, 1), (0, 2), (0, 3), (2, 1), (2, 3)], [(4, 5), (4, 6), (4, 7), (6, 5), (7, 5)]]
    assert select_pairs(batch.advantages, batch.rewards, batch.group_ids, "margin", 0.15) == pairs

    def loss(x0, noise, sigma):
        e = matching_error(_v([trained], policy, whole, x0, noise, sigma), x0, noise)
        with torch.no_grad():
            e_ref = matching_error(_v([ref], policy, whole, x0, noise, sigma), x0, noise)
        d = e - e_ref
        per_group = [
            torch.stack([-F.logsigmoid(-10.0 * (d[w] - d[lo])) for w, lo in grp]).mean() for grp in pairs
        ]
        return torch.stack(per_group).mean()

    _compare(algo, policy, batch, chunks, whole, trained, 4, (15, 16), "group_ids", loss)


def test_awm_accumulate_matches_the_whole_step_loss():
    from miles.config import AWMConfig

    awm = AWMConfig(weighting="t", kl_beta=0.1, ema_kl_beta=0.5)
    algo, policy, batch, chunks, whole, (trained, ref, old) = _setup({"awm": awm}, "awm")
    adv = batch.advantages / 5.0  # rescaled to advantage_max 1 of adv_clip_max 5

    def loss(x0, noise, sigma):
        v = _v([trained], policy, whole, x0, noise, sigma)
        with torch.no_grad():
            v_ref, v_old = (
                _v([ref], policy, whole, x0, noise, sigma),
                _v([old], policy, whole, x0, noise, sigma),
            )
        matching = (adv * sigma * matching_error(v, x0, noise)).mean()  # −A·lp with lp = −σ·e
        return matching + 0.1 * ((v - v_ref) ** 2).mean() + 0.5 * ((v - v_old) ** 2).mean()

    _compare(algo, policy, batch, chunks, whole, trained, 4, (11, 12), "sample_ids", loss)


@pytest.mark.parametrize(
    "name,sections,match",
    [
        ("awm", {"awm": {"num_levels": 6}}, r"awm.num_levels = 6 must be in \[1, 5\]"),
        ("dgpo", {"dgpo": {"num_levels": 5}}, r"dgpo.num_levels = 5 must be in \[1, 4\]"),
        (
            "online_dpo",
            {"train": {"steps_per_rollout": 4}},
            "splits each group of data.group_size = 4 into steps of 1",
        ),
        ("dgpo", {"train": {"steps_per_rollout": 4}}, "lower train.steps_per_rollout"),
    ],
)
def test_bad_settings_name_the_fix(name, sections, match):
    """On the 6-step tiny recipe: 5 candidate levels for AWM (0.9), 4 for DGPO (0.7)."""
    from miles.algorithms import build_algorithm
    from miles.config import (
        AlgorithmConfig,
        AWMConfig,
        Config,
        DataConfig,
        DGPOConfig,
        RolloutConfig,
        TrainConfig,
    )

    classes = {"awm": AWMConfig, "dgpo": DGPOConfig, "train": TrainConfig}
    kwargs = {k: classes[k](**v) for k, v in sections.items()}
    if "train" in kwargs:
        kwargs["train"].micro_batch_size = 2
    cfg = Config(
        algorithm=AlgorithmConfig(name=name),
        rollout=RolloutConfig(num_steps=6),
        data=DataConfig(group_size=4, prompts_per_rank=2),
        **kwargs,
    )
    with pytest.raises(ValueError, match=match):
        build_algorithm(cfg)


def test_online_dpo_without_rewards_pairs_by_advantage_and_refuses_a_margin():
    """``RolloutBatch.rewards`` is set by scoring; a batch without it pairs by advantage alone."""
    from miles.config import DPOConfig

    algo, policy, batch, chunks, _, _ = _setup(
        {"dpo": DPOConfig(pairs="margin", reward_margin=0.15)}, "online_dpo"
    )
    batch.rewards = None
    with pytest.raises(ValueError, match="dpo.reward_margin needs the rollout's rewards"):
        algo.accumulate(policy, batch, chunks)
    algo, policy, batch, chunks, _, _ = _setup(
        {"dpo": DPOConfig(pairs="margin", reward_margin=0.0)}, "online_dpo"
    )
    with_rewards = algo._pairs(batch, chunks)
    batch.rewards = None
    assert algo._pairs(batch, chunks) == with_rewards  # margin 0: only the advantages' order counts


@pytest.mark.parametrize(
    "name, section, metric, uses_old",
    [
        ("awm", {"ema_kl_beta": 1.0, "ema_decay_rate": 0.02, "ema_decay_max": 0.1}, "ema_decay", True),
        ("awm", {"ema_kl_beta": 0.0}, "ema_decay", False),
        ("dgpo", {"clip_range": 1e-3, "old_decay_rate": 0.02, "old_decay_max": 0.1}, "old_decay", True),
    ],
)
def test_lagging_copy_moves_after_each_rollout(name, section, metric, uses_old):
    """AWM's EMA copy and DGPO's old copy (``OnPolicyMatching``): after a rollout the copy moves by
    min(rate·step, max) of its config section, logged under the algorithm's name; ODE rollouts of
    the trained weights."""
    from types import SimpleNamespace

    from miles.config import AWMConfig, DGPOConfig

    config = {"awm": AWMConfig, "dgpo": DGPOConfig}[name](**section)
    algo, policy, *_ = _setup({name: config}, name)
    moved = []
    policy.old = SimpleNamespace(soft_update=moved.append)
    assert (
        algo.sde_steps(8, torch.Generator()) == []
        and algo.rollout_transformers(policy) == policy.transformers
    )
    for step, decay in ((2, 0.04), (4, 0.08), (9, 0.1)):  # min(0.02·step, 0.1)
        if uses_old:
            assert algo.after_rollout(policy, step) == {metric: pytest.approx(decay)}
        else:
            assert algo.after_rollout(policy, step) == {}
    assert moved == ([pytest.approx(d) for d in (0.04, 0.08, 0.1)] if uses_old else [])
