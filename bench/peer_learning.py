"""flow_grpo's own Wan training step on the tiny world, for a side by side with ours (issue 31).

    python bench/peer_learning.py --flow-grpo .cache/peers/flow_grpo --out OUT --mode cfg nocfg \\
        --num-rollouts 150 --lr 1e-4

flow_grpo's code stays in its checkout (``--flow-grpo``: a clone of yifan123/flow_grpo with
``scripts/train_wan2_1.py``, commit 32b48fd or later); nothing of it is copied here. Its full script
needs accelerate, ml_collections, absl, wandb and its reward zoo, and encodes prompts at 512 tokens,
so this bench drives its step functions on the world instead:

- sampling: ``flow_grpo.diffusers_patch.wan_pipeline_with_logprob.wan_pipeline_with_logprob`` on a
  diffusers ``WanPipeline`` of the world (``miles/world/pipeline``; its FlowMatch Euler scheduler,
  shift 3), prompts encoded by its ``wan_prompt_embedding.encode_prompt`` at the world's 64 tokens
  (the length the prior was trained at) — every step its SDE step, log-probs of all of them;
- the log-probability of a stored step under the current weights: ``compute_log_prob`` of
  ``scripts/train_wan2_1.py``, read from the script's source (the function alone, executed with
  its module's ``sde_step_with_logprob``: importing the script would run its heavy imports);
- advantages: its ``flow_grpo.stat_tracking.PerPromptStatTracker`` (per prompt of the rollout,
  cleared after each), clipped at ``adv_clip_max``;
- the loss: the clipped-ratio loss of the script's training loop, written out below line for line
  (it is inline in ``main`` there): ``policy_loss · σ_t / √|dt|``, gradient accumulation over the
  micro-batches and the ⌊fraction · T⌋ trained steps, grad-norm clip, AdamW, one optimizer step per
  ``batches_per_rollout`` share of the shuffled rollout (its ``num_batches_per_epoch``).

Settings are the world recipe's (``configs/world_cpu.yaml`` at the GPU path's global batch): 8
prompt groups of 8 per rollout drawn by our ``GroupSampler`` with the same seed (the same prompts
per rollout as ``bench/learning.py --gpu``), 8 denoising steps, fraction 0.6, 2 optimizer steps per
rollout, AdamW (weight decay 1e-4), max grad norm 1, clip range and lr as given; full fine-tune,
fp32 weights, bf16 autocast. ``cfg``: guidance 4 with ``train.cfg`` (its CFG training);
``nocfg``: guidance 1, CFG-free. Every ``--export-every`` rollouts the transformer is saved into
a pipeline folder that ``python -m miles.eval`` evaluates afterwards (held-out prompts, ODE, fixed
seeds: the same evaluation as our trainer's). Writes ``peer.json`` (per run: training reward per
optimizer step with wall time, held-out adherence per export) and, with ``--ours`` (a
``bench/learning.py`` JSON), ``side_by_side.{json,png,md}``.

``--recipe own`` (issue 42) runs the peer at its own Wan recipe instead of the matched settings:
``general_ocr_wan2_1`` of yifan123/flow_grpo ``config/grpo.py`` (31c71b9) as
``scripts/train_wan2_1.py`` (32b48fd) trains it — LoRA r 32, alpha 64, Gaussian init on
to_q/to_k/to_v/to_out.0 (its target list; Wan has no add_* projections), lr 1e-4, clip 1e-3, KL
beta 0.004 against the same transformer with its adapter disabled (the reference forward of every
trained step, its ``kl_loss`` written out below), 20 denoising steps, timestep fraction 0.99
(int(19.8) = 19 trained steps), guidance 4.5 with CFG training, no autocast (its LoRA path keeps
fp32), and its EMA of the LoRA weights (decay 0.9, every 8 steps) in the exports it evaluates. The
batch stays the world's (``--prompts-per-rollout`` x ``--group-size``, 2 optimizer steps a rollout)
so both trainers see the same prompts. ``--num-frames 81 --height 480 --width 832 --model
miles/world/pipeline_81 --config configs/world_81.yaml`` runs it on the 81-frame world.

The side by side compares training rewards per rollout on both sides: the peer logs one row per
optimizer step (two a rollout, the same rollout mean), ours one a rollout, so each side is first
reduced to one value a rollout and the windows are the same count of rollouts (``WINDOW``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = {"cfg": 4.0, "nocfg": 1.0}
WINDOW = 5
"""Rollouts averaged at each end of a training-reward curve, the same count on both sides."""
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""flow_grpo's LoRA targets that exist in Wan (its list adds SD3's add_* projections)."""
OWN_RECIPE = dict(
    clip_range=1e-3, beta=0.004, lora_rank=32, lr=1e-4, timestep_fraction=0.99, num_steps=20, cfg_guidance=4.5
)
"""flow_grpo's Wan recipe (config/grpo.py ``general_ocr_wan2_1`` at 31c71b9); plus EMA and fp32."""


def load_peer(checkout: Path) -> dict:
    """flow_grpo's functions from its checkout: the sampler, the SDE step, the stat tracker, the
    prompt encoder, and ``compute_log_prob`` from the training script's source."""
    script = checkout / "scripts" / "train_wan2_1.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: --flow-grpo must be a flow_grpo checkout at 32b48fd or later")
    sys.path.insert(0, str(checkout))
    from flow_grpo.diffusers_patch.wan_pipeline_with_logprob import (
        sde_step_with_logprob,
        wan_pipeline_with_logprob,
    )
    from flow_grpo.diffusers_patch.wan_prompt_embedding import encode_prompt
    from flow_grpo.stat_tracking import PerPromptStatTracker

    tree = ast.parse(script.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_log_prob")
    namespace = {"torch": torch, "sde_step_with_logprob": sde_step_with_logprob}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(script), "exec"), namespace)
    try:
        from flow_grpo.ema import EMAModuleWrapper
    except ImportError:  # only --recipe own needs it
        EMAModuleWrapper = None
    return {
        "ema": EMAModuleWrapper,
        "sample": wan_pipeline_with_logprob,
        "compute_log_prob": namespace["compute_log_prob"],
        "tracker": PerPromptStatTracker,
        "encode_prompt": encode_prompt,
    }


def peer_config(guidance: float, args) -> argparse.Namespace:
    """The fields of flow_grpo's ml_collections config that ``compute_log_prob`` reads."""
    ns = argparse.Namespace
    return ns(
        attention_kwargs=None,
        train=ns(cfg=guidance > 1.0, clip_range=args.clip_range, adv_clip_max=5.0),
        sample=ns(guidance_scale=guidance),
    )


def rollout_record(pipe, videos, embeds, latents: list, log_probs: list) -> dict:
    """What flow_grpo's training loop keeps of a rollout: the per-step latents and log-probs stacked
    along dim 1, each step's input and output apart."""
    latents = torch.stack(latents, dim=1)
    return {
        "videos": videos,
        "prompt_embeds": embeds,
        "timesteps": pipe.scheduler.timesteps.repeat(len(embeds), 1),
        "latents": latents[:, :-1],
        "next_latents": latents[:, 1:],
        "log_probs": torch.stack(log_probs, dim=1),
    }


def rollout(peer, pipe, prompts, neg, guidance, args, generator_seed: int) -> dict:
    """One rollout: flow_grpo's sampler with log-probs on the rollout's prompts (as its loop calls it)."""
    device = pipe.transformer.device
    with torch.no_grad():
        embeds = peer["encode_prompt"](
            [pipe.text_encoder], [pipe.tokenizer], prompts, args.max_sequence_length
        )
    torch.manual_seed(generator_seed)
    with torch.autocast(device.type, torch.bfloat16, enabled=_autocast(args, device)), torch.no_grad():
        videos, latents, log_probs, _ = peer["sample"](
            pipe,
            prompt_embeds=embeds,
            negative_prompt_embeds=neg.repeat(len(prompts), 1, 1),
            num_inference_steps=args.num_steps,
            guidance_scale=guidance,
            output_type="pt",
            return_dict=False,
            num_frames=args.num_frames,
            height=args.height or args.size,
            width=args.width or args.size,
        )
    return rollout_record(pipe, videos, embeds, latents, log_probs)


def _autocast(args, device) -> bool:
    """bf16 autocast on CUDA, except flow_grpo's LoRA path (``--recipe own``), which runs fp32."""
    return device.type == "cuda" and args.lora_rank == 0


def kl_loss(prev_sample_mean, prev_sample_mean_ref, std_dev_t, dt_ref) -> torch.Tensor:
    """flow_grpo's ``kl_loss`` (scripts/train_wan2_1.py, the training loop, beta > 0), written out."""
    kl = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
        2 * (std_dev_t * dt_ref) ** 2
    )
    return torch.mean(kl)


def train_rollout(peer, pipe, samples, advantages, neg, cfg, optimizer, args, ema=None) -> list[dict]:
    """flow_grpo's inner epoch on one rollout: shuffle, split into ``batches_per_rollout`` optimizer
    steps, each accumulating micro-batches × trained steps; its loss, written out."""
    transformer = pipe.transformer
    device = transformer.device
    n = samples["latents"].shape[0]
    num_train_timesteps = int(args.num_steps * args.timestep_fraction)  # flow_grpo: floor
    perm = torch.randperm(n, device=device)
    samples = {k: v[perm] for k, v in samples.items()}
    advantages = advantages[perm]
    per_step = n // args.batches_per_rollout
    accumulation = (per_step // args.micro_batch) * num_train_timesteps
    logs = []
    for s in range(args.batches_per_rollout):
        info = {"clipfrac": [], "policy_loss": []}
        for m in range(s * per_step, (s + 1) * per_step, args.micro_batch):
            sample = {k: v[m : m + args.micro_batch] for k, v in samples.items()}
            adv_mb = advantages[m : m + args.micro_batch]
            embeds = sample["prompt_embeds"]
            negative_embeds = neg.repeat(len(embeds), 1, 1) if cfg.train.cfg else None
            for j in range(num_train_timesteps):
                with torch.autocast(device.type, torch.bfloat16, enabled=_autocast(args, device)):
                    _, log_prob, mean, std_dev_t, dt = peer["compute_log_prob"](
                        transformer, pipe, sample, j, embeds, negative_embeds, cfg
                    )
                    if args.beta > 0:  # its reference: the same weights with the adapter disabled
                        with torch.no_grad(), transformer.disable_adapter():
                            _, _, mean_ref, _, dt_ref = peer["compute_log_prob"](
                                transformer, pipe, sample, j, embeds, negative_embeds, cfg
                            )
                # --- flow_grpo scripts/train_wan2_1.py, training loop (beta = 0) ---
                adv = torch.clamp(adv_mb, -cfg.train.adv_clip_max, cfg.train.adv_clip_max)
                ratio = torch.exp(log_prob - sample["log_probs"][:, j])
                unclipped_loss = -adv * ratio
                clipped_loss = -adv * torch.clamp(
                    ratio, 1.0 - cfg.train.clip_range, 1.0 + cfg.train.clip_range
                )
                policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
                policy_loss = policy_loss * std_dev_t.mean() / dt.mean()
                loss = policy_loss
                if args.beta > 0:
                    loss = policy_loss + args.beta * kl_loss(mean, mean_ref, std_dev_t, dt_ref)
                (loss / accumulation).backward()  # accelerate divides by the accumulation steps
                info["clipfrac"].append(float((torch.abs(ratio - 1.0) > cfg.train.clip_range).float().mean()))
                info["policy_loss"].append(float(policy_loss.detach()))
            if ema is not None:  # its loop steps the EMA after each micro-batch's timesteps
                ema.step(trainable(transformer), optimizer.state_steps)
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        optimizer.state_steps += 1  # its global_step: optimizer steps so far
        logs.append({k: sum(v) / len(v) for k, v in info.items()})
    return logs


def trainable(transformer) -> list:
    return [p for p in transformer.parameters() if p.requires_grad]


def with_lora(transformer, rank: int):
    """flow_grpo's LoRA: ``get_peft_model`` with r ``rank``, alpha 2 r, Gaussian init, its targets."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS
    )
    return get_peft_model(transformer, config)


def export(pipe, model_path: Path, out: Path, ema=None) -> None:
    """A pipeline folder for ``python -m miles.eval``: the world's components, the trained transformer
    (LoRA: merged into a copy; with ``ema``, its EMA weights, as flow_grpo's checkpoints hold)."""
    import copy

    out.mkdir(parents=True, exist_ok=True)
    for item in model_path.iterdir():
        if item.name != "transformer" and not (out / item.name).exists():
            os.symlink(item.resolve(), out / item.name)
    transformer = pipe.transformer
    if not hasattr(transformer, "merge_and_unload"):
        transformer.save_pretrained(out / "transformer")
        return
    if ema is not None:
        ema.copy_ema_to(trainable(transformer), store_temp=True)
    copy.deepcopy(transformer).merge_and_unload().save_pretrained(out / "transformer")
    if ema is not None:
        ema.copy_temp_to(trainable(transformer))


def run_mode(peer, mode: str, args) -> dict:
    from diffusers import WanPipeline

    from miles.data.prompts import GroupSampler, load_prompts
    from miles.rewards.world import world_scores

    guidance = args.cfg_guidance if mode == "cfg" else MODES[mode]
    cfg = peer_config(guidance, args)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    pipe = WanPipeline.from_pretrained(args.model, torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.requires_grad_(args.lora_rank == 0)
    if args.lora_rank:
        pipe.transformer = with_lora(pipe.transformer, args.lora_rank)
    optimizer = torch.optim.AdamW(
        trainable(pipe.transformer), lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8
    )
    optimizer.state_steps = 0
    ema = None
    if args.ema:
        if peer["ema"] is None:
            raise SystemExit("--ema needs flow_grpo.ema in the checkout (EMAModuleWrapper)")
        ema = peer["ema"](trainable(pipe.transformer), decay=0.9, update_step_interval=8, device=device)
    prompts = [p.text for p in load_prompts(args.prompt_file)]
    sampler = GroupSampler(len(prompts), args.prompts_per_rollout, args.group_size, 0, 1, seed=args.seed)
    with torch.no_grad():
        neg = peer["encode_prompt"]([pipe.text_encoder], [pipe.tokenizer], [""], args.max_sequence_length)
    out = args.out / f"peer-{mode}"
    result = {"mode": mode, "guidance": guidance, "train": [], "exports": []}
    t0, step = time.monotonic(), 0
    for r in range(args.num_rollouts):
        if r % args.export_every == 0:
            export(pipe, Path(args.model), out / f"export_step{step:04d}", ema)
            result["exports"].append({"step": step, "rollout": r, "time_s": time.monotonic() - t0})
        batch = next(sampler)
        texts = [prompts[i] for i in batch.prompt_indices]
        pipe.transformer.eval()
        samples = rollout(peer, pipe, texts, neg, guidance, args, args.seed * 100003 + r)
        rewards = world_scores(samples.pop("videos").float(), texts)["adherence"].cpu()
        tracker = peer["tracker"](global_std=False)
        advantages = torch.as_tensor(
            tracker.update(texts, rewards.numpy()), dtype=torch.float32, device=device
        )
        pipe.transformer.train()
        logs = train_rollout(peer, pipe, samples, advantages, neg, cfg, optimizer, args, ema)
        for log in logs:
            step += 1
            row = {
                "step": step,
                "rollout": r,
                "reward": float(rewards.mean()),
                "time_s": time.monotonic() - t0,
            }
            row.update(log)
            result["train"].append(row)
        print(
            f"peer-{mode} rollout {r}: reward {float(rewards.mean()):.3f} clipfrac {logs[-1]['clipfrac']:.3f}"
        )
        if args.time_limit and time.monotonic() - t0 > args.time_limit:
            break
    export(pipe, Path(args.model), out / f"export_step{step:04d}", ema)
    result["exports"].append({"step": step, "rollout": r + 1, "time_s": time.monotonic() - t0})
    result["wall_s"] = time.monotonic() - t0
    return result


def evaluate_exports(result: dict, mode: str, args) -> None:
    """Held-out adherence of every export through ``python -m miles.eval`` (the trainer's evaluation)."""
    for e in result["exports"]:
        folder = args.out / f"peer-{mode}" / f"export_step{e['step']:04d}"
        cmd = [sys.executable, "-m", "miles.eval", "--config", args.config, "--model.path", str(folder)]
        cmd += ["--out", str(folder / "eval"), "--rollout.guidance-scale", str(result["guidance"])]
        cmd += [
            "--model.dtype",
            "bfloat16" if args.device == "cuda" else "float32",
            "--run.wandb-mode",
            "disabled",
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        summary = json.loads((folder / "eval" / "eval.json").read_text())
        e["adherence"] = summary["summary"]["eval/reward/mean"]


def rollout_rewards(train: list[dict], steps_per_rollout: int = 1) -> list[float]:
    """One training reward a rollout. The peer logs a row per optimizer step (its ``rollout`` field,
    or ``steps_per_rollout`` rows a rollout in older JSON), each the rollout's mean; ours logs one a
    rollout. The result is the same unit on both sides, so windows count the same rollouts."""
    per: dict[int, float] = {}
    for i, t in enumerate(train):
        per.setdefault(t.get("rollout", i // steps_per_rollout), t["reward"])
    return list(per.values())


def reward_window(rewards: list[float], n: int = WINDOW) -> tuple[float, float]:
    """Mean of the first and of the last ``n`` rollouts."""
    return sum(rewards[:n]) / len(rewards[:n]), sum(rewards[-n:]) / len(rewards[-n:])


def side_by_side(peer: dict, ours: dict, pairs: dict[str, str], out: Path, peer_steps: int = 2) -> None:
    """Both trainers' curves per optimizer step: training reward and held-out adherence."""
    rows = {}
    for mode, name in pairs.items():
        if mode in peer and name in ours:
            last = peer[mode]["train"][-1]["step"]  # per step: ours cut at the peer's last step
            mine = {k: [r for r in ours[name][k] if r["step"] <= last] for k in ("train", "eval")}
            rows[mode] = {"flow_grpo": peer[mode], "miles": {"run": name, **mine}}
    (out / "side_by_side.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"| mode | trainer | held-out first → last (step) | training reward, first → last {WINDOW} rollouts |"
    ]
    lines.append("|---|---|---|---|")
    for mode, both in rows.items():
        for who, res in both.items():
            ev = res["eval"] if who == "miles" else [e for e in res["exports"] if "adherence" in e]
            first, last = reward_window(rollout_rewards(res["train"], 1 if who == "miles" else peer_steps))
            lines.append(
                f"| {mode} | {who} | {ev[0]['adherence']:.3f} → {ev[-1]['adherence']:.3f} ({ev[-1]['step']}) "
                f"| {first:.3f} → {last:.3f} ({res['train'][-1]['step']} steps) |"
            )
    (out / "side_by_side.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, out / "side_by_side.png")


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, both in rows.items():
        for who, res in both.items():
            style = {"linestyle": "-" if who == "miles" else "--", "color": "C0" if mode == "nocfg" else "C3"}
            label = f"{who}, {'CFG 4' if mode == 'cfg' else 'CFG-free'}"
            steps = [t["step"] for t in res["train"]]
            reward = [t["reward"] for t in res["train"]]
            k = 10  # a running mean over 10 optimizer steps (5 rollouts)
            smooth = [
                sum(reward[max(0, i - k + 1) : i + 1]) / len(reward[max(0, i - k + 1) : i + 1])
                for i in range(len(reward))
            ]
            axes[0].plot(steps, smooth, label=label, **style)
            ev = res["eval"] if who == "miles" else [e for e in res["exports"] if "adherence" in e]
            axes[1].plot(
                [e["step"] for e in ev],
                [e["adherence"] for e in ev],
                marker="o",
                markersize=3,
                label=label,
                **style,
            )
    axes[0].set_ylabel("training reward (running mean of 10 steps)")
    axes[1].set_ylabel("held-out adherence (miles.eval, ODE)")
    for ax in axes:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("flow_grpo's Wan step (dashed) vs miles (solid) on the tiny world")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def apply_own_recipe(args) -> None:
    """``--recipe own``: flow_grpo's Wan settings (``OWN_RECIPE``), its EMA exports, LoRA in fp32."""
    for key, value in OWN_RECIPE.items():
        setattr(args, key, value)
    args.ema = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--flow-grpo", type=Path, required=True, help="a flow_grpo checkout (scripts/train_wan2_1.py)"
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", nargs="+", default=["cfg", "nocfg"], choices=list(MODES))
    p.add_argument("--num-rollouts", type=int, default=40)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--clip-range", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default=str(ROOT / "miles/world/pipeline"))
    p.add_argument("--config", default="configs/world_cpu.yaml", help="the recipe miles.eval evaluates with")
    p.add_argument("--prompt-file", default=str(ROOT / "miles/world/prompts_train.txt"))
    p.add_argument("--prompts-per-rollout", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=8)
    p.add_argument("--timestep-fraction", type=float, default=0.6)
    p.add_argument("--batches-per-rollout", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--max-sequence-length", type=int, default=64)
    p.add_argument("--num-frames", type=int, default=9)
    p.add_argument("--size", type=int, default=64, help="height and width unless --height/--width")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--beta", type=float, default=0.0, help="KL weight against the adapter-free reference")
    p.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tune; flow_grpo's Wan: 32")
    p.add_argument("--ema", action="store_true", help="export its EMA of the trained weights")
    p.add_argument("--cfg-guidance", type=float, default=MODES["cfg"], help="the cfg mode's guidance")
    p.add_argument(
        "--recipe", choices=["matched", "own"], default="matched", help="own: flow_grpo's Wan recipe"
    )
    p.add_argument("--export-every", type=int, default=25, help="rollouts between exports (evaluated after)")
    p.add_argument("--time-limit", type=float, default=None, help="stop training after this many s")
    p.add_argument("--from-json", type=Path, default=None, help="a peer.json of an earlier run: no training")
    p.add_argument("--ours", type=Path, default=None, help="a bench/learning.py learning.json to set beside")
    p.add_argument("--ours-runs", nargs=2, default=["cfg-dp4-lr1e-4", "dp4-lr1e-4"], metavar=("CFG", "NOCFG"))
    args = p.parse_args()
    if args.recipe == "own":
        apply_own_recipe(args)
    args.out.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.from_json.read_text()) if args.from_json else {}
    peer = None if args.from_json else load_peer(args.flow_grpo.resolve())
    for mode in [] if args.from_json else args.mode:
        results[mode] = run_mode(peer, mode, args)
        evaluate_exports(results[mode], mode, args)
        (args.out / "peer.json").write_text(json.dumps(results, indent=1))
        ev = results[mode]["exports"]
        print(
            f"peer-{mode}: held-out {ev[0]['adherence']:.3f} -> {ev[-1]['adherence']:.3f} at step {ev[-1]['step']}"
        )
    if args.ours:
        ours = json.loads(args.ours.read_text())
        side_by_side(
            results, ours, dict(zip(("cfg", "nocfg"), args.ours_runs)), args.out, args.batches_per_rollout
        )


if __name__ == "__main__":
    main()
