"""Why Flow-GRPO with CFG does not learn on the tiny world: the mechanism, on one fixed batch (CPU).

    python bench/cfg_mechanism.py [--out docs/learning/cfg_mechanism.json]

One process, a few training prompts of the world (miles/world, configs/world_cpu.yaml's sampler:
8 steps, shift 3, noise level 0.7, the first 5 steps SDE). Each mode samples the same prompts
from the same initial noise and SDE noise, scores them with ``world_adherence``, forms group
advantages, and then, from the pretrained weights each time:

1. splits the gradient of the clipped loss (at ratio 1) through the guided velocity
   v = v_u + g·(v_c − v_u) into the part through the conditional branch (g·J_cᵀδ) and the part
   through the unconditional one ((1 − g)·J_uᵀδ), per parameter group;
2. takes AdamW steps of the trainer's (lr, betas, weight decay, clip norm 1) on the whole batch,
   old log-probs fixed as in PPO's inner epochs (``--num-updates``), and measures what the first
   and the last did on that batch: the per-step log-ratio (approx_kl, the fraction outside each
   clip range), its alignment with the advantages, the log-prob change of positive- and
   negative-advantage samples, the change of the guided and of the conditional velocity, and the
   reward of the batch re-sampled with the same noise (paired with the rollout's);
3. for CFG rollouts, how far the conditional-only log-prob is from the guided one (what
   "CFG rollouts, CFG-free training" would start its ratios from).

Modes: ``cfg_free`` (guidance 1, train the conditional branch: the world recipe), ``cfg_g`` for
each guidance g > 1 (CFG rollouts, ``grpo.train_cfg`` true) and ``cfg_g_train_cond`` (CFG
rollouts, the conditional branch trained with old log-probs recomputed under it: a candidate fix).
The numbers go to a JSON file and a table is printed; the explanation is docs/learning_cfg.md. Cheap: a few CPU-minutes per mode at the defaults (32 samples).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from miles.config import ModelConfig, TrainConfig
from miles.grpo.advantages import group_advantages
from miles.grpo.losses import grpo_policy_loss
from miles.models.wan import load_wan
from miles.rewards.world import world_scores
from miles.rollout.sampler import sample_with_logprob
from miles.rollout.sde import sde_step_with_logprob
from miles.world.world import HEIGHT, NUM_FRAMES, read_prompt_file

NUM_STEPS, SHIFT, NOISE_LEVEL, FRACTION = 8, 3.0, 0.7, 0.6
CLIP_RANGES = (1e-4, 1e-3, 1e-2)
GROUPS = ("attn1", "attn2", "ffn", "condition_embedder.text", "condition_embedder.time", "other")


def param_group(name: str) -> str:
    """The group of a transformer parameter: self-attention, cross-attention (the text path), FFN,
    text/time embedders, everything else."""
    return next((g for g in GROUPS[:-1] if g in name), "other")


def velocities(transformer, x, t, pos, neg) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(v_c, v_u) of latents x (B, ...) at timestep t (0-dim); v_u is None without ``neg``."""
    b = x.shape[0]
    v_c = transformer(hidden_states=x, timestep=t.expand(b), encoder_hidden_states=pos, return_dict=False)[0]
    if neg is None:
        return v_c.float(), None
    neg = neg.expand(b, *neg.shape[1:])
    v_u = transformer(hidden_states=x, timestep=t.expand(b), encoder_hidden_states=neg, return_dict=False)[0]
    return v_c.float(), v_u.float()


def guided(v_c, v_u, g: float, detach: str | None = None) -> torch.Tensor:
    """v_u + g·(v_c − v_u); ``detach`` ("cond"/"uncond") stops the gradient through one branch."""
    if v_u is None:
        return v_c
    v_c = v_c.detach() if detach == "cond" else v_c
    v_u = v_u.detach() if detach == "uncond" else v_u
    return v_u + g * (v_c - v_u)


def step_terms(transformer, ro, batch, g: float, detach: str | None = None) -> list[dict]:
    """Per SDE step k: log-prob (B,) and mean of the stored sample under ``transformer``'s guided
    velocity (``g`` 1: the conditional branch alone), with v_c and v_u."""
    neg = batch["neg"] if g > 1 else None
    out = []
    for k in range(ro.num_sde_steps):
        v_c, v_u = velocities(transformer, ro.latents[:, k], ro.timesteps[k], batch["pos"], neg)
        v = guided(v_c, v_u, g, detach)
        step = sde_step_with_logprob(
            v,
            ro.latents[:, k],
            ro.sigmas[k],
            ro.sigma_next[k],
            NOISE_LEVEL,
            prev_sample=ro.next_latents[:, k],
        )
        out.append({"log_prob": step.log_prob, "mean": step.mean, "v": v, "v_c": v_c, "v_u": v_u})
    return out


def clipped_loss(terms: list[dict], old: list[torch.Tensor], adv: torch.Tensor, clip: float) -> torch.Tensor:
    """The trainer's loss: the clipped-ratio loss averaged over SDE steps (samples averaged inside)."""
    losses = [grpo_policy_loss(t["log_prob"], o, adv, clip).loss for t, o in zip(terms, old)]
    return torch.stack(losses).mean()


def grad_vector(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of ``loss`` per parameter name (zeroed before)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def branch_gradients(transformer, ro, batch, g: float, adv, clip: float) -> dict:
    """Norms (total and per group) of the gradient through the conditional branch, through the
    unconditional branch, and of their sum, at the rollout's weights (ratio 1)."""
    old = [t["log_prob"].detach() for t in step_terms(transformer, ro, batch, g)]
    parts = {
        "full": grad_vector(transformer, clipped_loss(step_terms(transformer, ro, batch, g), old, adv, clip))
    }
    if g > 1:
        for branch, stop in (("cond", "uncond"), ("uncond", "cond")):
            terms = step_terms(transformer, ro, batch, g, detach=stop)
            parts[branch] = grad_vector(transformer, clipped_loss(terms, old, adv, clip))
    out = {}
    for part, grads in parts.items():
        flat = torch.cat([v.flatten() for v in grads.values()])
        groups = {grp: 0.0 for grp in GROUPS}
        for n, v in grads.items():
            groups[param_group(n)] += float(v.double().pow(2).sum())
        out[part] = {"norm": float(flat.norm()), "groups": {k: v**0.5 for k, v in groups.items()}}
    if g > 1:
        c = torch.cat([v.flatten() for v in parts["cond"].values()])
        u = torch.cat([v.flatten() for v in parts["uncond"].values()])
        out["cos_cond_uncond"] = float(torch.nn.functional.cosine_similarity(c, u, dim=0))
        out["norm_cond_over_full"] = out["cond"]["norm"] / out["full"]["norm"]
    return out


def text_path_share(groups: dict[str, float]) -> float:
    """Fraction of the gradient's squared norm in the text path (cross-attention, text embedder)."""
    total = sum(v**2 for v in groups.values())
    return (groups["attn2"] ** 2 + groups["condition_embedder.text"] ** 2) / total


def policy_gradient(transformer, ro, batch, g: float, adv, clip: float) -> torch.Tensor:
    """The flattened gradient of the clipped loss at ratio 1 (the policy-gradient estimate)."""
    old = [t["log_prob"].detach() for t in step_terms(transformer, ro, batch, g)]
    grads = grad_vector(transformer, clipped_loss(step_terms(transformer, ro, batch, g), old, adv, clip))
    return torch.cat([v.flatten() for v in grads.values()])


def gradient_agreement(model, batch, gs: tuple[float, float], ro, adv, args) -> dict:
    """Cosine between the policy-gradient estimates of independent batches (same prompts, other
    noise): how much of one batch's update is signal that another batch agrees with."""
    transformer, (roll_g, train_g) = model.transformers[0], gs
    grads = [policy_gradient(transformer, ro, batch, train_g, adv, args.clip_range)]
    for j in range(1, args.num_batches):
        other = dict(
            batch, init=torch.randn(batch["init"].shape, generator=torch.Generator().manual_seed(1000 + j))
        )
        ro_j = rollout(model, other, roll_g, args.seed + 1000 + j)
        adv_j = group_advantages(rewards_of(model, ro_j, batch["prompts"]), batch["group_ids"]).float()
        grads.append(policy_gradient(transformer, ro_j, other, train_g, adv_j, args.clip_range))
    cos = [
        float(torch.nn.functional.cosine_similarity(grads[i], grads[j], dim=0))
        for i in range(len(grads))
        for j in range(i + 1, len(grads))
    ]
    return {"pairwise_cos": cos, "mean_cos": sum(cos) / len(cos)}


def rollout(model, batch, g: float, seed: int):
    """The batch sampled at guidance g from the batch's initial noise, SDE noise from ``seed``."""
    return sample_with_logprob(
        model.transformers,
        batch["pos"],
        batch["neg"] if g > 1 else None,
        batch["shape"],
        num_steps=NUM_STEPS,
        shift=SHIFT,
        guidance_scales=g,
        noise_level=NOISE_LEVEL,
        generator=torch.Generator().manual_seed(seed),
        timestep_fraction=FRACTION,
        latents=batch["init"],
    )


def rewards_of(model, ro, prompts: list[str]) -> torch.Tensor:
    with torch.no_grad():
        return world_scores(model.decode(ro.final_latents), prompts)["adherence"]


def _rel(after: list[dict], before: list[dict], key: str) -> float:
    """Mean over steps of ‖Δ key‖ / ‖key‖ over the batch."""
    return sum(float((a[key] - b[key]).norm() / b[key].norm()) for a, b in zip(after, before)) / len(before)


def update_effect(before: list[dict], after: list[dict], adv: torch.Tensor) -> dict:
    """What one update did to the fixed batch's log-probs and velocities."""
    delta = torch.stack([a["log_prob"] - b["log_prob"] for a, b in zip(after, before)])  # (K, B)
    ratio = delta.exp()
    cos = torch.stack([torch.nn.functional.cosine_similarity(d, adv, dim=0) for d in delta])
    out = {
        "approx_kl": float(0.5 * delta.pow(2).mean()),
        "median_abs_log_ratio": float(delta.abs().median()),
        "clipfrac": {str(e): float(((ratio - 1).abs() > e).float().mean()) for e in CLIP_RANGES},
        "cos_log_ratio_advantage": float(cos.mean()),
        "surrogate_gain": float((adv * (ratio - 1)).mean()),
        "dlogp_positive_adv": float(delta[:, adv > 0].mean()),
        "dlogp_negative_adv": float(delta[:, adv < 0].mean()),
        "rel_change_v_guided": _rel(after, before, "v"),
        "rel_change_v_cond": _rel(after, before, "v_c"),
    }
    if before[0]["v_u"] is not None:
        out["rel_change_v_uncond"] = _rel(after, before, "v_u")
        dv = sum(float((a["v"] - b["v"]).norm()) for a, b in zip(after, before))
        dvc = sum(float((a["v_c"] - b["v_c"]).norm()) for a, b in zip(after, before))
        out["norm_dv_guided_over_dv_cond"] = dv / dvc
    return out


def _resampled_change(model, batch, g: float, seed: int, rewards, adv) -> dict:
    """The batch re-sampled at guidance g with the rollout's noise: its paired reward change."""
    diff = rewards_of(model, rollout(model, batch, g, seed), batch["prompts"]) - rewards
    return {
        "reward_change": float(diff.mean()),
        "reward_change_se": float(diff.std() / len(diff) ** 0.5),
        "reward_change_pos_adv": float(diff[adv > 0].mean()),
        "reward_change_neg_adv": float(diff[adv < 0].mean()),
        "fraction_improved": float((diff > 0).float().mean()),
    }


def train_on_batch(model, ro, batch, gs: tuple[float, float], adv, lr: float, args, rewards) -> dict:
    """``args.num_updates`` AdamW steps of the trainer's settings on the fixed batch from the current
    weights (PPO's inner epochs: old log-probs fixed, the clip active), sampled at ``gs[0]`` and
    trained at ``gs[1]``: the first step's effect, the cumulative effect, the paired reward change
    after one step and after all; the weights are restored."""
    roll_g, train_g = gs
    transformer, tcfg = model.transformers[0], TrainConfig()
    saved = {n: p.detach().clone() for n, p in transformer.named_parameters()}
    with torch.no_grad():
        before = step_terms(transformer, ro, batch, train_g)
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=lr, betas=tuple(tcfg.adam_betas), eps=tcfg.adam_eps, weight_decay=tcfg.weight_decay
    )
    old = [b["log_prob"] for b in before]
    out = {}
    for i in range(args.num_updates):
        opt.zero_grad(set_to_none=True)
        clipped_loss(step_terms(transformer, ro, batch, train_g), old, adv, args.clip_range).backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, tcfg.max_grad_norm))
        opt.step()
        if i in (0, args.num_updates - 1):
            with torch.no_grad():
                effect = update_effect(before, step_terms(transformer, ro, batch, train_g), adv)
            effect.update(
                grad_norm=grad_norm, **_resampled_change(model, batch, roll_g, args.seed, rewards, adv)
            )
            out["after_1" if i == 0 else f"after_{args.num_updates}"] = effect
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            p.copy_(saved[n])
    return out


def measure_mode(model, batch, gs: tuple[float, float], args) -> dict:
    """Every measurement for rollouts at guidance ``gs[0]`` trained at ``gs[1]`` (1: CFG-free)."""
    start = time.perf_counter()
    roll_g, train_g = gs
    ro = rollout(model, batch, roll_g, args.seed)
    rewards = rewards_of(model, ro, batch["prompts"])
    adv = group_advantages(rewards, batch["group_ids"]).float()
    transformer = model.transformers[0]
    group_std = rewards.view(-1, args.group_size).std(dim=1)
    out = {"rollout_guidance": roll_g, "train_guidance": train_g, "reward_mean": float(rewards.mean())}
    out["within_group_reward_std"] = float(group_std.mean())
    out["gradients"] = branch_gradients(transformer, ro, batch, train_g, adv, args.clip_range)
    out["gradients"]["text_path_share"] = text_path_share(out["gradients"]["full"]["groups"])
    if args.num_batches > 1:
        out["gradient_agreement"] = gradient_agreement(model, batch, gs, ro, adv, args)
    out["updates"] = {
        str(lr): train_on_batch(model, ro, batch, gs, adv, lr, args, rewards) for lr in args.lrs
    }
    if roll_g > 1:  # how far the conditional-only policy is from the guided one on these samples
        with torch.no_grad():
            cond = step_terms(transformer, ro, batch, 1.0)
            guided_terms = step_terms(transformer, ro, batch, roll_g)
        gap = torch.stack([c["log_prob"] - q["log_prob"] for c, q in zip(cond, guided_terms)])
        out["cond_minus_guided_log_prob"] = {"mean": float(gap.mean()), "mean_abs": float(gap.abs().mean())}
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def make_batch(model, args) -> dict:
    """The fixed batch: prompts (groups contiguous), their embeddings, the initial noise."""
    prompts_all = read_prompt_file("train")
    chosen = prompts_all[:: max(1, len(prompts_all) // args.num_prompts)][: args.num_prompts]
    prompts = [p for p in chosen for _ in range(args.group_size)]
    pos, neg = model.encode_prompts(prompts, "", args.max_sequence_length, torch.device("cpu"))
    shape = model.latent_shape(NUM_FRAMES, HEIGHT, HEIGHT)
    init = torch.randn(len(prompts), *shape, generator=torch.Generator().manual_seed(args.seed + 1))
    group_ids = torch.arange(len(chosen)).repeat_interleave(args.group_size)
    return dict(prompts=prompts, pos=pos, neg=neg[:1], shape=shape, init=init, group_ids=group_ids)


def table(results: dict) -> str:
    """A markdown table of the main numbers per mode (first learning rate, first and last update)."""
    rows = [
        "| mode | reward | within-group std | ‖g_cond‖/‖g‖ | cos(g_cond, g_uncond) | text-path share | cos(g, g') "
        "| ‖Δv_guided‖/‖Δv_c‖ "
        "| median \\|log r\\| (1st step) | clipfrac 1e-4 / 1e-3 (last) | cos(log r, A) | Δlogp A>0 / A<0 "
        "| Δreward (1st / last) |",
        "|---" * 13 + "|",
    ]
    for name, m in results.items():
        if name == "config":
            continue
        grads, upd = m["gradients"], next(iter(m["updates"].values()))
        first, last = upd["after_1"], upd[max(upd, key=lambda k: int(k.split("_")[1]))]
        cond = f"{grads['norm_cond_over_full']:.2f}" if "cond" in grads else "—"
        cos = f"{grads['cos_cond_uncond']:.2f}" if "cond" in grads else "—"
        agree = f"{m['gradient_agreement']['mean_cos']:.2f}" if "gradient_agreement" in m else "—"
        dv = f"{first['norm_dv_guided_over_dv_cond']:.2f}" if "norm_dv_guided_over_dv_cond" in first else "1"
        rows.append(
            f"| {name} | {m['reward_mean']:.3f} | {m['within_group_reward_std']:.3f} | {cond} | {cos} "
            f"| {grads['text_path_share']:.2f} | {agree} | {dv} "
            f"| {first['median_abs_log_ratio']:.1e} | {last['clipfrac']['0.0001']:.2f} / {last['clipfrac']['0.001']:.2f} "
            f"| {last['cos_log_ratio_advantage']:.2f} | {last['dlogp_positive_adv']:+.1e} / {last['dlogp_negative_adv']:+.1e} "
            f"| {first['reward_change']:+.3f} / {last['reward_change']:+.3f} ± {last['reward_change_se']:.3f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="miles/world/pipeline")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--guidance", type=float, nargs="+", default=[1.0, 2.0, 4.0, 6.0])
    parser.add_argument(
        "--cond-trained",
        type=float,
        nargs="*",
        default=[4.0],
        help="CFG rollouts at these scales, CFG-free training",
    )
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4])
    parser.add_argument("--num-updates", type=int, default=3, help="AdamW steps on the fixed batch")
    parser.add_argument(
        "--num-batches", type=int, default=3, help="independent batches for gradient agreement"
    )
    parser.add_argument("--clip-range", type=float, default=1e-4)
    parser.add_argument("--max-sequence-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("docs/learning/cfg_mechanism.json"))
    parser.add_argument("--table", type=Path, default=None, help="only print the table of this JSON")
    args = parser.parse_args()
    if args.table is not None:
        print(table(json.loads(args.table.read_text())))
        return
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_wan(ModelConfig(path=args.model), torch.device("cpu"))
    batch = make_batch(model, args)
    results = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    results["config"].update(
        num_steps=NUM_STEPS, shift=SHIFT, noise_level=NOISE_LEVEL, timestep_fraction=FRACTION
    )
    modes = [(g, g) for g in args.guidance] + [(g, 1.0) for g in args.cond_trained]
    for gs in modes:
        name = "cfg_free" if gs[0] <= 1 else f"cfg_{gs[0]:g}" + ("_train_cond" if gs[1] <= 1 else "")
        results[name] = measure_mode(model, batch, gs, args)
        print(name, json.dumps(results[name]["updates"]), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")  # after every mode: partial runs count
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
