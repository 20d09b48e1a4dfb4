"""flow_grpo's own Wan GRPO step beside miles' at a real shape, one after the other on one GPU (issues 35, 43).

    python bench/peer_step.py --flow-grpo .cache/peers/flow_grpo --out OUT            # 1.3B, 81x480x832
    python bench/peer_step.py --flow-grpo .cache/peers/flow_grpo --out OUT --train lora --fit 81 121 161 201
    python bench/peer_step.py --flow-grpo .cache/peers/flow_grpo --out OUT --model tiny \\
        --shape 5 64 64 --num-steps 4 --text-tokens 16 --steps 2                      # CPU, seconds

flow_grpo's code stays in its checkout (``--flow-grpo``, as ``bench/peer_learning.py`` loads it:
its ``wan_pipeline_with_logprob`` sampler, ``compute_log_prob`` read from ``scripts/train_wan2_1.py``,
the clipped loss of its training loop as ``peer_learning.train_rollout`` writes it out). Its step is
set up as its script sets it up: diffusers eager (no compile), the transformer in fp32 under bf16
autocast (its script's full fine-tune; its LoRA path runs fp32 without autocast, which this bench does
not copy: both settings here run the faster bf16 autocast, so the ratio is the conservative one),
``enable_gradient_checkpointing()``, the VAE in fp32, AdamW; no KL term; CFG ``--guidance`` with its
``train.cfg``; every denoising step is its SDE step and ``⌊timestep_fraction · T⌋`` of them are
trained — set to ``--train-steps`` of the ``--num-steps`` (miles' SDE window). The model is the real
config with random weights (``bench/real_configs.py``), random text embeddings of ``--text-tokens``
stand in for UMT5's (no text encoder on either side's clock: miles caches them too), the samples are
decoded by the pipeline (``output_type="pt"``) and scored by miles' ``jpeg_incompressibility``, so
the phases match ``bench/step_bench.py``'s: rollout (flow_grpo: sampling), decode + reward, train
(all the trained steps of the rollout, one optimizer step).

Like for like (``--train``, default ``both``): ``lora`` trains LoRA r 32 / alpha 64 on flow_grpo's
eight target modules on BOTH sides, ``full`` every weight on both sides; ``both`` runs each and
reports each ratio. miles' side is ``bench/step_bench.py`` in its own process (``--rewards jpeg``;
compiled, cudnn attention, FSDP2) given every setting the sides share as a flag (``ours_command``:
shape, samples, denoising and trained steps, guidance, shift, text tokens, micro-batch, LoRA
rank/alpha/targets) rather than relying on equal defaults; its JSON records them. ``--fit``: each
frame count at ``--shape``'s size, at the first ``--train`` setting, both trainers each in a process
of its own capped alike at 80 and at 141 GiB (``MILES_BENCH_MEMORY_CAP_GIB`` →
``torch.cuda.set_per_process_memory_fraction`` in each process, ``step_bench.cap_process_memory``;
miles also gets the cap as its activation budget, at most the card's memory): the largest that
completes one step. Frame counts are 4k+1, run ascending; a trainer that failed is not tried at more,
and at 141 GiB each starts from its largest fit at 80 (the smaller counts recorded as implied); every
case's peak and step seconds are in ``fit.cases`` and the Markdown's fit table. ``--fit-only`` runs
the search alone; ``--fit-resume`` an earlier ``peer_step.json`` keeps its cases (a search cut by a
device command's time limit continues where it stopped). Writes
``peer_step.json`` (after every case) and ``peer_step.md`` (drawn from that JSON alone) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.peer_learning import load_peer, peer_config, rollout_record, train_rollout  # noqa: E402
from bench.step_bench import cap_process_memory  # noqa: E402

LORA_TARGETS = ["add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v"]
LORA_RANK, LORA_ALPHA = 32, 64.0  # flow_grpo's Wan script: r 32, alpha 64
CAPS_GIB = (80.0, 141.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_pipeline(args, device: torch.device):
    """A diffusers ``WanPipeline`` at ``args.model``'s real config, random weights, set up as
    flow_grpo's script sets it up (no text encoder: the embeddings are given)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from peft import LoraConfig, get_peft_model

    from bench.real_configs import model_spec

    spec = model_spec(args.model)
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel(**spec["transformer"])
        vae = AutoencoderKLWan(**spec["vae"])
    vae.requires_grad_(False)
    transformer.requires_grad_(args.full)
    if not args.full:
        lora = LoraConfig(
            r=LORA_RANK, lora_alpha=LORA_ALPHA, init_lora_weights="gaussian", target_modules=LORA_TARGETS
        )
        transformer = get_peft_model(transformer, lora)
    transformer.enable_gradient_checkpointing()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=args.shift)
    pipe = WanPipeline(
        tokenizer=None, text_encoder=None, transformer=transformer, vae=vae, scheduler=scheduler
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sample(peer, pipe, embeds, neg, args) -> dict:
    """One rollout of ``--samples`` videos: flow_grpo's sampler with log-probs, decoded."""
    device = pipe.transformer.device
    frames, height, width = args.shape
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"), torch.no_grad():
        videos, latents, log_probs, _ = peer["sample"](
            pipe,
            prompt_embeds=embeds,
            negative_prompt_embeds=neg,
            num_inference_steps=args.num_steps,
            guidance_scale=args.guidance,
            output_type="pt",
            return_dict=False,
            num_frames=frames,
            height=height,
            width=width,
            max_sequence_length=args.text_tokens,
        )
    return rollout_record(pipe, videos, embeds, latents, log_probs)


def _train_args(args) -> argparse.Namespace:
    """The fields ``peer_learning.train_rollout`` reads: all samples in one optimizer step, no KL
    term (the step measured since issue 35), and bf16 autocast on both settings (``lora_rank`` 0 is
    how ``peer_learning._autocast`` says so: flow_grpo's own script runs its LoRA path in fp32
    without autocast, scripts/train_wan2_1.py at 9745241; the side by side keeps the peer in bf16,
    the faster of the two, as it samples)."""
    return argparse.Namespace(
        num_steps=args.num_steps,
        timestep_fraction=(args.train_steps + 0.5) / args.num_steps,  # floor() gives train_steps
        batches_per_rollout=1,
        micro_batch=args.micro_batch,
        max_grad_norm=1.0,
        beta=0.0,
        lora_rank=0,
    )


def make_optimizer(params) -> torch.optim.Optimizer:
    """flow_grpo's AdamW, with the step count ``peer_learning.train_rollout`` keeps on it (its EMA's)."""
    optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=1e-4)
    optimizer.state_steps = 0
    return optimizer


def _phase(device: torch.device, fn):
    """``fn()``'s result, wall seconds and peak allocated GiB (CUDA; None on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return out, time.perf_counter() - t0, peak


def peer_steps(args) -> dict:
    """``--steps`` GRPO steps of flow_grpo (the first is the warm-up): per-phase seconds and peaks."""
    from miles.rewards.jpeg import JpegIncompressibility

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    peer = load_peer(args.flow_grpo.resolve())
    pipe = build_pipeline(args, device)
    text_dim = pipe.transformer.config.text_dim
    trainable = [p for p in pipe.transformer.parameters() if p.requires_grad]
    optimizer = make_optimizer(trainable)
    cfg = peer_config(args.guidance, argparse.Namespace(clip_range=1e-4))
    reward = JpegIncompressibility()
    gen = torch.Generator().manual_seed(1)
    embeds = torch.randn(args.samples, args.text_tokens, text_dim, generator=gen).to(device)
    neg = torch.randn(1, args.text_tokens, text_dim, generator=gen).to(device)  # one negative prompt
    steps = []
    for i in range(args.steps):
        torch.manual_seed(100 + i)
        pipe.transformer.eval()
        samples, t_roll, p_roll = _phase(
            device, lambda: sample(peer, pipe, embeds, neg.repeat(len(embeds), 1, 1), args)
        )
        videos = samples.pop("videos")
        rewards, t_rew, _ = _phase(device, partial(reward, videos.float().cpu(), [""] * args.samples))
        adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-4)).to(device)
        pipe.transformer.train()
        train = partial(train_rollout, peer, pipe, samples, adv, neg, cfg, optimizer, _train_args(args))
        _, t_train, p_train = _phase(device, train)
        steps.append(
            {
                "rollout_s": t_roll,
                "reward_s": t_rew,
                "train_s": t_train,
                "peak_gib": max(p_roll or 0, p_train or 0),
            }
        )
        print(f"[peer-step] step {i}: {json.dumps(steps[-1])}", flush=True)
    _, _, c, f, h, w = samples["latents"].shape  # (samples, steps, C, F', H', W')
    patch = pipe.transformer.config.patch_size
    tokens = f // patch[0] * (h // patch[1]) * (w // patch[2])
    return {"steps": steps, "tokens": tokens, "trainable_params": sum(p.numel() for p in trainable)}


def summarize(steps: list[dict], flops: dict) -> dict:
    """Mean seconds per phase over the measured steps (all but the warm-up), TFLOP/s, peak."""
    measured = steps[1:] if len(steps) > 1 else steps
    mean = {k: sum(s[k] for s in measured) / len(measured) for k in ("rollout_s", "reward_s", "train_s")}
    total = sum(mean.values())
    peaks = [s["peak_gib"] for s in steps if s["peak_gib"]]
    return {
        **mean,
        "step_s": total,
        "rollout_tflops": flops["rollout"] / mean["rollout_s"] / 1e12,
        "train_tflops": flops["train"] / mean["train_s"] / 1e12,
        "step_tflops": (flops["rollout"] + flops["train"]) / total / 1e12,
        "peak_gib": max(peaks) if peaks else None,
    }


def step_flops(args, tokens: int) -> dict:
    """Model FLOPs of one step as ``bench/step_bench.py`` counts them (recompute not counted)."""
    from bench.gpu_bench import model_flops
    from bench.real_configs import model_spec

    t = model_spec(args.model)["transformer"]
    forward = model_flops(t, tokens, text_tokens=args.text_tokens)
    cfg = 2 if args.guidance > 1 else 1
    return {
        "tokens": tokens,
        "rollout": args.samples * args.num_steps * cfg * forward,
        "train": args.samples * args.train_steps * cfg * 3 * forward,
    }


def ours_command(args, out: Path, shape: list[int], budget: float, full: bool) -> list[str]:
    """``bench/step_bench.py``'s command line for miles' side: every setting the two sides share is
    passed (shape, denoising and trained steps, samples, guidance, shift, text tokens, micro-batch,
    LoRA rank/alpha/targets or full), none left to equal defaults."""
    cmd = [sys.executable, str(ROOT / "bench" / "step_bench.py"), "--out", str(out), "--model", args.model]
    cmd += ["--shape", *map(str, shape), "--num-steps", str(args.num_steps), "--samples", str(args.samples)]
    cmd += ["--sde-window", str(args.train_steps), "--rollouts", str(args.steps), "--budget-gib", str(budget)]
    cmd += ["--rewards", "jpeg", "--guidance", str(args.guidance), "--shift", str(args.shift)]
    cmd += ["--text-tokens", str(args.text_tokens), "--micro-batch", str(args.micro_batch)]
    cmd += ["--lora-rank", "0" if full else str(LORA_RANK), "--lora-alpha", str(LORA_ALPHA)]
    return cmd + ["--lora-targets", *LORA_TARGETS]


def ours(
    args, out: Path, shape: list[int], budget: float, full: bool, cap: float | None = None
) -> dict | None:
    """miles' step through ``bench/step_bench.py`` (its own process, capped at ``cap`` GiB as the
    peer's is); its jpeg.json, or None."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("MILES_BENCH_MEMORY_CAP_GIB", None)
    if cap is not None:
        env["MILES_BENCH_MEMORY_CAP_GIB"] = f"{cap:g}"
    rc = subprocess.run(ours_command(args, out, shape, budget, full), env=env).returncode
    return json.loads((out / "jpeg.json").read_text()) if rc == 0 else None


def card_gib() -> float | None:
    """This GPU's memory, GiB (None without CUDA): a cap above it is the whole card."""
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def fit_peer(args, setting: str, shape: list[int], cap: float, case: Path) -> dict:
    """One flow_grpo fit case: ``--one-peer`` in its own process capped at ``cap``; its record."""
    cmd = [sys.executable, __file__, *args.argv, "--train", setting, "--one-peer", *map(str, shape)]
    cmd += ["--one-peer-json", str(case / "flow_grpo.json")]
    env = {**os.environ, "MILES_BENCH_MEMORY_CAP_GIB": f"{cap:g}", "PYTHONUNBUFFERED": "1"}
    rc = subprocess.run(cmd, env=env).returncode
    side = json.loads((case / "flow_grpo.json").read_text()) if rc == 0 else None
    step = side["steps"][-1] if side else {}
    return {"ok": rc == 0, "rc": rc, "peak_gib": step.get("peak_gib"), "step_s": _step_s(step)}


def _step_s(step: dict) -> float | None:
    return sum(step[k] for k in ("rollout_s", "reward_s", "train_s")) if step else None


def fit_ours(args, setting: str, shape: list[int], cap: float, case: Path) -> dict:
    """One miles fit case: ``bench/step_bench.py`` capped at ``cap`` (its activation budget: the cap,
    at most the card), completed within the cap."""
    budget = min(cap, card_gib() or cap)
    r = ours(args, case, shape, budget, setting == "full", cap)
    peak = r["summary"]["peak_gib"] if r else None
    step = r["summary"]["step"]["wall_s"] if r else None
    return {
        "ok": r is not None and (peak or 0) <= cap,
        "peak_gib": peak,
        "step_s": step,
        "budget_gib": budget,
    }


def earlier_cases(path: Path | None, setting: str) -> dict:
    """``--fit-resume``: the run cases of an earlier ``peer_step.json`` at the same ``--train`` setting,
    by (cap, frames, trainer)."""
    if path is None or not path.is_file():
        return {}
    fit_ = json.loads(path.read_text()).get("fit", {})
    if fit_.get("train") != setting:
        return {}
    keys = ("cap_gib", "frames", "trainer")
    return {
        tuple(c[k] for k in keys): {k: v for k, v in c.items() if k not in keys}
        for c in fit_.get("cases", [])
        if not c.get("implied_by_smaller_cap")
    }


def fit(args, results: dict) -> None:
    """The largest frame count of ``--fit`` each trainer completes a step at, per memory cap (False:
    not even the first), at the first of ``--train``'s settings (LoRA where it is run). Each case is
    a process of its own, capped alike on both sides (``MILES_BENCH_MEMORY_CAP_GIB``); every case's
    peak and step time go to ``fit.cases``. Frame counts run ascending; a trainer that failed is not
    tried at more frames, and at a larger cap it starts from its largest fit at the smaller one (what
    fits in 80 GiB fits in 141: those counts are recorded as implied, not run again)."""
    setting = settings(args)[0]
    results["fit"] = {"train": setting, "card_gib": card_gib(), "cases": []}
    done = earlier_cases(args.fit_resume, setting)
    runners = {"flow_grpo": fit_peer, "miles": fit_ours}
    fitted = {name: False for name in runners}  # the largest fit at the previous (smaller) cap
    for cap in CAPS_GIB:
        row = results["fit"][f"{cap:g}"] = dict(fitted)
        failed: set[str] = set()
        for frames in args.fit:
            shape = [frames, *args.shape[1:]]
            for name, run in runners.items():
                if name in failed:
                    continue
                case = {"cap_gib": cap, "frames": frames, "trainer": name}
                if row[name] and frames <= row[name]:
                    results["fit"]["cases"].append({**case, "ok": True, "implied_by_smaller_cap": True})
                    continue
                out = args.out / f"fit_{setting}_{cap:g}_{frames}"
                out.mkdir(parents=True, exist_ok=True)
                rec = done.get((cap, frames, name)) or run(args, setting, shape, cap, out)
                results["fit"]["cases"].append({**case, **rec})
                row[name] = frames if rec["ok"] else row[name]
                failed |= set() if rec["ok"] else {name}
                print(f"[peer-step] fit {setting} {cap:g} GiB, {frames} frames: {name} {rec}", flush=True)
                (args.out / "peer_step.json").write_text(json.dumps(results, indent=1))
        fitted = dict(row)


def settings(args) -> list[str]:
    """``--train``'s settings in the order they run: LoRA against LoRA, full against full."""
    return ["lora", "full"] if args.train == "both" else [args.train]


def ratio(side: dict) -> float | None:
    """flow_grpo's step time over miles' at one setting, both read from this JSON (None: no miles)."""
    o = side.get("miles")
    return side["flow_grpo"]["step_s"] / o["summary"]["step"]["wall_s"] if o else None


def markdown(results: dict) -> str:
    a = results["args"]
    lines = [
        f"{a['model']}, {a['shape'][0]}x{a['shape'][1]}x{a['shape'][2]} ({results.get('flops', {}).get('tokens', '?')} tokens), "
        f"{a['samples']} samples, {a['num_steps']} steps, {a['train_steps']} trained, CFG {a['guidance']:g}, "
        f"shift {a['shift']:g}, {a['text_tokens']} text tokens, micro-batch {a['micro_batch']}, on {results['device']}",
        "",
        "| train | trainer | trainable params | rollout s (TFLOP/s) | decode + reward s | train s (TFLOP/s) | step s | peak GiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for setting in ("lora", "full"):
        if setting not in results:
            continue
        p, o = results[setting]["flow_grpo"], results[setting].get("miles")
        lines.append(
            f"| {setting} | flow_grpo | {p['trainable_params']:,} | {p['rollout_s']:.2f} ({p['rollout_tflops']:.0f}) | "
            f"{p['reward_s']:.2f} | {p['train_s']:.2f} ({p['train_tflops']:.0f}) | {p['step_s']:.2f} | "
            f"{p['peak_gib'] or 0:.1f} |"
        )
        if o:
            ph = o["summary"]["phases"]
            lines.append(
                f"| {setting} | miles | {o.get('trainable_params') or 0:,} | {ph['rollout']['wall_s']:.2f} "
                f"({ph['rollout']['tflops']:.0f}) | {ph['decode+reward']['wall_s']:.2f} | "
                f"{ph['train']['wall_s']:.2f} ({ph['train']['tflops']:.0f}) | {o['summary']['step']['wall_s']:.2f} | "
                f"{o['summary']['peak_gib'] or 0:.1f} |"
            )
    lines.append("")
    for setting in ("lora", "full"):
        if setting in results and (r := ratio(results[setting])) is not None:
            lines.append(
                f"{setting}: miles' step is {r:.2f}x flow_grpo's speed (the same setting on both sides)."
            )
    fits = results.get("fit", {})
    for cap in CAPS_GIB:
        if (row := fits.get(f"{cap:g}")) is not None:
            lines.append(
                f"Largest frame count in {cap:g} GiB ({fits['train']}): flow_grpo {row['flow_grpo']}, miles {row['miles']}."
            )
    if fits.get("cases"):
        lines += [
            "",
            "| cap GiB | frames | trainer | fits | peak GiB | step s |",
            "| ---: | ---: | --- | --- | ---: | ---: |",
        ]
        for c in fits["cases"]:
            fits_ = (
                "yes (fits at the smaller cap)"
                if c.get("implied_by_smaller_cap")
                else ("yes" if c["ok"] else "no")
            )
            peak = "—" if c.get("peak_gib") is None else f"{c['peak_gib']:.1f}"
            step = "—" if c.get("step_s") is None else f"{c['step_s']:.1f}"
            lines.append(f"| {c['cap_gib']:g} | {c['frames']} | {c['trainer']} | {fits_} | {peak} | {step} |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--flow-grpo", type=Path, required=True, help="a flow_grpo checkout (scripts/train_wan2_1.py)"
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b", help="a bench/real_configs.py model, or tiny")
    ap.add_argument("--shape", type=int, nargs=3, default=[81, 480, 832], metavar=("FRAMES", "H", "W"))
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=2, help="trained SDE steps (miles' SDE window)")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=1, help="the train micro-batch, both sides")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--shift", type=float, default=3.0)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps per trainer; the first is the warm-up")
    ap.add_argument(
        "--train",
        choices=["lora", "full", "both"],
        default="both",
        help="LoRA r 32 on both sides, every weight on both sides, or each in turn",
    )
    ap.add_argument("--no-ours", action="store_true", help="flow_grpo's step alone")
    ap.add_argument("--fit", type=int, nargs="*", default=[], help="frame counts to try per memory cap")
    ap.add_argument("--fit-only", action="store_true", help="the --fit search alone (no side by side)")
    ap.add_argument(
        "--fit-resume",
        type=Path,
        default=None,
        help="a peer_step.json of an earlier --fit run (cut by a time limit): its cases are kept, not run again",
    )
    ap.add_argument("--one-peer", type=int, nargs=3, default=None, help=argparse.SUPPRESS)  # a --fit case
    ap.add_argument("--one-peer-json", type=Path, default=None, help=argparse.SUPPRESS)  # its record
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # a --fit case's process gets them again
    if args.train_steps > args.num_steps:
        raise SystemExit(f"--train-steps {args.train_steps} exceeds --num-steps {args.num_steps}")
    if args.fit_only and not args.fit:
        raise SystemExit("--fit-only needs --fit FRAMES...")
    bad = [f for f in args.fit if f < 1 or (f - 1) % 4]
    if bad:
        raise SystemExit(f"--fit {' '.join(map(str, bad))}: frame counts must be 4k+1 (81, 121, 161, ...)")
    args.fit = sorted(set(args.fit))
    return args


def main() -> None:
    args = parse()
    cap_process_memory()  # a --fit case: this process capped as miles' is (bench/step_bench.py)
    if args.one_peer:
        args.shape, args.steps, args.full = args.one_peer, 1, args.train == "full"
        record = peer_steps(args)
        if args.one_peer_json:
            args.one_peer_json.write_text(json.dumps({"shape": args.shape, **record}, indent=1))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results = {
        "args": {
            k: v
            for k, v in vars(args).items()
            if k not in ("flow_grpo", "out", "argv", "one_peer_json", "fit_resume")
        },
        "device": device,
    }
    for setting in [] if args.fit_only else settings(args):  # LoRA vs LoRA, full vs full
        args.full = setting == "full"
        peer = peer_steps(args)
        results["flops"] = step_flops(args, peer["tokens"])
        results[setting] = {"flow_grpo": {**summarize(peer["steps"], results["flops"]), **peer}}
        (args.out / "peer_step.json").write_text(json.dumps(results, indent=1))
        if not args.no_ours:
            results[setting]["miles"] = ours(
                args, args.out / f"miles_{setting}", args.shape, 100.0, args.full
            )
            results[setting]["ratio"] = ratio(results[setting])
            (args.out / "peer_step.json").write_text(json.dumps(results, indent=1))
    if args.fit:
        fit(args, results)
    (args.out / "peer_step.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
