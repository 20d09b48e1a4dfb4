"""FP8 vs bf16 rollouts on one GPU: seconds per rollout, the log-prob gap per SDE step, the drift.

    python bench/fp8_rollout.py --out bench/results/fp8                     # 1.3B, 81 and 33 frames
    python bench/fp8_rollout.py --out runs/fp8 --model tiny --frames 5 --size 64 64 --num-steps 4 \\
        --precisions bf16                                                    # CPU, seconds

The transformer is the real config with random weights (``bench/real_configs.py``), wrapped as the
trainer wraps it (``parallelize_expert``: cudnn attention, FSDP2 with bf16 compute, each block
compiled unless ``--eager``) and sampled as the trainer samples (``unsharded_for_rollout`` around
``sample_with_logprob``, batched CFG 5, ``rollout.precision``'s context inside it: the float8 copy
is made once per rollout and its cost is reported apart as ``quantize_s``). Random text embeddings
stand in for UMT5's; no VAE. Every non-final step is an SDE step (noise level 0.7) so that the
gap is measured at every step; an SDE step costs what an ODE step costs.

For each frame count: a warm-up rollout per precision (compile, cudnn plans; fp8 first, so the
first forward through FSDP is a quantized one as in a run), then ``--repeats`` rollouts of each,
alternating, from the same initial and SDE noise. Then the FP8 rollout's SDE steps are rescored
by the bf16 policy (what ``miles.algorithms.rollout_correction`` does in training): per step the
mean and max |logp_bf16 − logp_fp8| and the truncated importance weights min(exp(Δ), 2); the bf16
rollout is rescored too (``rescore_abs_gap_max``: the same no-grad path, so 0 unless the rescoring
itself is inexact: it shows that the FP8 gap is FP8's), and the final latents of the two rollouts
are compared (relative L2). ``speedup`` excludes the once-per-rollout quantization,
``speedup_with_quantize`` includes it. Model FLOPs as ``bench/gpu_bench.py``
counts them (samples x steps x CFG forwards). Writes ``fp8_rollout.json`` (after every case) and
``fp8_rollout.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_bench import model_flops  # noqa: E402
from bench.real_configs import model_spec  # noqa: E402

GUIDANCE, NOISE_LEVEL, SHIFT, TEXT_TOKENS, CAP = 5.0, 0.7, 3.0, 512, 2.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_expert(name: str, device: torch.device, compile_blocks: bool):
    """The transformer of ``name`` with random weights, wrapped as the trainer wraps it (one rank)."""
    from diffusers import WanTransformer3DModel

    from miles.models.config_folders import per_token_timesteps
    from miles.parallel.topology import ParallelDims, build_parallel_mesh
    from miles.sequence_parallel.checks import default_attention_backend
    from miles.train.parallelize import parallelize_expert

    spec = model_spec(name)
    if spec["vae"].get("z_dim", 16) != spec["transformer"]["in_channels"] or per_token_timesteps(spec):
        raise SystemExit(f"{name}: this bench covers the Wan2.1-VAE text-to-video experts (1.3B, 14B, tiny)")
    mesh = build_parallel_mesh(ParallelDims(world_size=1, sequence_parallel_size=1), device.type)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (1.3B: seconds, not a CPU init and a copy)
        model = WanTransformer3DModel(**spec["transformer"]).float()
    parallelize_expert(
        model,
        mesh,
        attention_backend=default_attention_backend(device),
        param_dtype=torch.bfloat16,  # FP8 quantizes bf16 weights (the plan requires model.dtype bfloat16)
        reduce_dtype=torch.float32,
        compile_blocks=compile_blocks,
    )
    return model.eval(), spec


def rollout(model, precision: str, pos, neg, init, args, device):
    """One rollout: (Rollout, seconds sampling, seconds making the float8 copy, peak GiB)."""
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.precision import rollout_precision
    from miles.rollout.sampler import sample_with_logprob

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    generator = torch.Generator(device=device).manual_seed(1)
    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(unsharded_for_rollout([model]))
        _sync(device)
        t0 = time.perf_counter()
        fp8 = precision.startswith("fp8")
        stack.enter_context(
            rollout_precision([model], "fp8" if fp8 else precision, fast_accum=precision != "fp8_accurate")
        )
        _sync(device)
        t1 = time.perf_counter()
        ro = sample_with_logprob(
            [model],
            pos,
            neg,
            init.shape[1:],
            num_steps=args.num_steps,
            shift=SHIFT,
            guidance_scales=[GUIDANCE],
            noise_level=NOISE_LEVEL,
            generator=generator,
            latents=init,
            sde_steps=list(range(args.num_steps - 1)),
        )
        _sync(device)
        t2 = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return ro, t2 - t1, t1 - t0, peak


@torch.no_grad()
def rescore(model, ro, pos, neg) -> torch.Tensor:
    """(B, K) log-probs of the rollout's SDE steps under the bf16 policy (training's recompute)."""
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.sampler import compute_log_prob

    with unsharded_for_rollout([model]):
        steps = [
            compute_log_prob([model], ro, k, pos, neg, [GUIDANCE], None, NOISE_LEVEL)[0]
            for k in range(ro.num_sde_steps)
        ]
    return torch.stack(steps, dim=1).float()


def gap_rows(lp_bf16: torch.Tensor, lp_roll: torch.Tensor, step_indices: list[int]) -> list[dict]:
    """Per SDE step: mean/max |Δ| and the TIS weights min(exp(Δ), CAP), Δ = logp_bf16 − logp_rollout."""
    from miles.grpo.tis import tis_weights

    delta = (lp_bf16 - lp_roll.to(lp_bf16.device)).cpu()
    rows = []
    for k, i in enumerate(step_indices):
        d = delta[:, k]
        w = tis_weights(d, torch.zeros_like(d), CAP)
        rows.append(
            dict(
                step=i,
                logp_abs_gap_mean=float(d.abs().mean()),
                logp_abs_gap_max=float(d.abs().max()),
                logp_rollout_mean=float(lp_roll[:, k].mean()),
                tis_weight_mean=float(w.mean()),
                tis_weight_max=float(w.max()),
                tis_capped_frac=float((w >= CAP).float().mean()),
            )
        )
    return rows


def bench_frames(model, spec, frames: int, args, device, flops_forward) -> dict:
    h, w = args.size
    t = spec["transformer"]
    latent = (t["in_channels"], (frames - 1) // 4 + 1, h // 8, w // 8)
    tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
    g = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    pos = torch.randn(args.samples, TEXT_TOKENS, t["text_dim"], generator=g).to(device, dtype)
    neg = torch.randn(1, TEXT_TOKENS, t["text_dim"], generator=g).to(device, dtype)
    init = torch.randn(args.samples, *latent, generator=g).to(device)
    flops = args.samples * args.num_steps * 2 * flops_forward(tokens)
    case = dict(frames=frames, size=[h, w], latent=list(latent), tokens=tokens, model_tflop=flops / 1e12)
    runs: dict[str, list] = {p: [] for p in args.precisions}
    order = sorted(args.precisions, key=lambda p: p == "bf16")  # fp8 first: its first forward
    last = {}
    for rep in range(args.repeats + 1):
        for p in order if rep == 0 else args.precisions:
            ro, secs, quant, peak = rollout(model, p, pos, neg, init, args, device)
            runs[p].append(dict(rollout_s=secs, quantize_s=quant, peak_gib=peak, warmup=rep == 0))
            last[p] = ro
            print(json.dumps(dict(frames=frames, precision=p, **runs[p][-1])), flush=True)
    for p, rows in runs.items():
        measured = [r["rollout_s"] for r in rows if not r["warmup"]] or [rows[-1]["rollout_s"]]
        mean = sum(measured) / len(measured)
        case[p] = dict(
            runs=rows,
            rollout_s=mean,
            per_step_s=mean / args.num_steps,
            tflops=flops / mean / 1e12,
            quantize_s=rows[-1]["quantize_s"],
            peak_gib=max((r["peak_gib"] or 0.0) for r in rows) or None,
        )
    if "bf16" in last:
        canary = rescore(model, last["bf16"], pos, neg) - last["bf16"].log_probs.float()
        case["bf16"]["rescore_abs_gap_max"] = float(canary.abs().max())
    for p in [p for p in last if p != "bf16"]:
        fp, ro8 = case[p], last[p]
        fp["logp_gap"] = gap_rows(rescore(model, ro8, pos, neg), ro8.log_probs, ro8.step_indices)
        if "bf16" in last:
            bf = case["bf16"]
            fp["speedup"] = bf["rollout_s"] / fp["rollout_s"]
            with_q = (bf["rollout_s"] + bf["quantize_s"]) / (fp["rollout_s"] + fp["quantize_s"])
            fp["speedup_with_quantize"] = with_q
            a, b = ro8.final_latents.float(), last["bf16"].final_latents.float()
            fp["final_latent_rel_l2"] = float((a - b).norm() / b.norm())
    return case


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [
        f"{m['model']}, {m['samples']} samples, {m['num_steps']} steps, CFG {GUIDANCE:g}, "
        f"{'compiled' if m['compiled'] else 'eager'}, on {m['device']} (torch {m['torch']}, torchao {m['torchao']})",
        "",
        "| frames | tokens | rollout | s (TFLOP/s) | speed-up (with quantize) | quantize s | peak GiB "
        "| mean abs logp gap (max) | TIS w mean (max) | final latent rel. L2 |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in result["cases"]:
        if "error" in c:
            lines.append(
                f"| {c['frames']} | | error: {c['error'].strip().splitlines()[-1][:80]} | | | | | | | |"
            )
            continue
        for p in [p for p in ("bf16", "fp8", "fp8_accurate") if p in c]:
            r, gap = c[p], c[p].get("logp_gap")
            speed = f"{r['speedup']:.2f}x ({r['speedup_with_quantize']:.2f}x)" if "speedup" in r else "—"
            gap_s = w_s = "—"
            if gap:
                mean_gap = sum(g["logp_abs_gap_mean"] for g in gap) / len(gap)
                gap_s = f"{mean_gap:.2e} ({max(g['logp_abs_gap_max'] for g in gap):.2e})"
                mean_w = sum(g["tis_weight_mean"] for g in gap) / len(gap)
                w_s = f"{mean_w:.4f} ({max(g['tis_weight_max'] for g in gap):.4f})"
            peak = "—" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
            l2 = f"{r['final_latent_rel_l2']:.3f}" if "final_latent_rel_l2" in r else "—"
            lines.append(
                f"| {c['frames']} | {c['tokens']} | {p} | {r['rollout_s']:.2f} ({r['tflops']:.0f}) | {speed} | "
                f"{r['quantize_s']:.2f} | {peak} | {gap_s} | {w_s} | {l2} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b", help="a bench/real_configs.py model, or tiny")
    ap.add_argument("--frames", type=int, nargs="+", default=[81, 33])
    ap.add_argument("--size", type=int, nargs=2, default=[480, 832], metavar=("H", "W"))
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument(
        "--repeats", type=int, default=2, help="measured rollouts per precision (after a warm-up)"
    )
    ap.add_argument(
        "--precisions",
        nargs="+",
        default=["bf16", "fp8"],
        choices=["bf16", "fp8", "fp8_accurate"],
        help="fp8_accurate: fp8 without torchao's fast accumulation (not a trainer setting)",
    )
    ap.add_argument(
        "--eager", action="store_true", help="do not compile the blocks (the trainer compiles on CUDA)"
    )
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    compiled = device.type == "cuda" and not args.eager
    model, spec = build_expert(args.model, device, compiled)
    result = dict(
        meta=dict(
            model=args.model,
            samples=args.samples,
            num_steps=args.num_steps,
            compiled=compiled,
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            torch=torch.__version__,
            torchao=torchao_version,
            command="python bench/fp8_rollout.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        ),
        cases=[],
    )
    forward = lambda tokens: model_flops(spec["transformer"], tokens, text_tokens=TEXT_TOKENS)  # noqa: E731
    try:
        for frames in args.frames:
            try:
                result["cases"].append(bench_frames(model, spec, frames, args, device, forward))
            except Exception:  # one failed case (OOM, an unsupported kernel) must not lose the others
                result["cases"].append(dict(frames=frames, error=traceback.format_exc()))
                print(result["cases"][-1]["error"], flush=True)
            (args.out / "fp8_rollout.json").write_text(json.dumps(result, indent=2) + "\n")
    finally:
        (args.out / "fp8_rollout.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "fp8_rollout.md").write_text(markdown(result))
        print(markdown(result), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
