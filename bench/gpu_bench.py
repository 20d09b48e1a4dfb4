"""One-GPU benchmarks: the trainer's train and rollout steps vs stock diffusers at real Wan shapes.

    python bench/gpu_bench.py --out bench/results [--shapes wan2.1-1.3b wan2.2-ti2v-5b] [--quick]

Random-initialised transformers with the real Wan configs (they cost what the real weights
cost), bf16 compute, one sample of 81 frames at 480x832 (21x60x104 latents -> 32,760 tokens;
the 5B model is fed the same token count, as in the anchors). For each shape:

- stock: diffusers' WanTransformer3DModel in bf16 — forward, forward+backward without and with
  diffusers' full gradient checkpointing;
- miles: the model as the trainer builds it (fp32 master weights, SP installed at sp=1,
  per-block activation checkpointing, FSDP2 with bf16 compute / fp32 reduce, cudnn attention) —
  forward+backward in each checkpointing mode, and the ``budget`` mode at 40 GiB;
- rollout: one denoising step with CFG, stock (two forwards, as WanPipeline) vs the trainer's
  batched-CFG ``predict_velocity`` under ``unsharded_for_rollout``.

Model FLOPs are counted analytically (matmuls and attention; recompute not counted). Writes
``results.json`` and ``results.md`` to ``--out``; prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "wan2.1-1.3b": dict(
        num_attention_heads=12,
        attention_head_dim=128,
        ffn_dim=8960,
        num_layers=30,
        in_channels=16,
        out_channels=16,
    ),
    "wan2.2-ti2v-5b": dict(
        num_attention_heads=24,
        attention_head_dim=128,
        ffn_dim=14336,
        num_layers=30,
        in_channels=48,
        out_channels=48,
    ),
}
COMMON = dict(
    patch_size=(1, 2, 2),
    text_dim=4096,
    freq_dim=256,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
LATENT_FHW = (21, 60, 104)
# A few-second check of this script itself (runs on CPU too: ``--shapes smoke``).
SHAPES["smoke"] = dict(
    SHAPES["wan2.1-1.3b"], num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2
)
LATENTS = {"smoke": (3, 8, 8)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "_native_cudnn" if DEV == "cuda" else None
TEXT_TOKENS = 512
PEAK_TFLOPS = 782.0  # bf16 matmul measured on this card (DESIGN.md)


def model_flops(cfg: dict, tokens: int, text_tokens: int = TEXT_TOKENS) -> float:
    """Forward FLOPs of one sample: linear layers (2 per MAC) and attention (QK^T and PV)."""
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    f = cfg["ffn_dim"]
    per_token_block = 2 * (4 * d * d + 2 * d * d + 2 * d * f) + 4 * tokens * d + 4 * text_tokens * d
    kv_text = 2 * 2 * d * d * text_tokens  # cross-attention K/V of the text, once per sample
    blocks = cfg["num_layers"] * (per_token_block * tokens + kv_text)
    patch = 2 * tokens * d * cfg["in_channels"] * 4 + 2 * tokens * d * cfg["out_channels"] * 4
    return float(blocks + patch)


def timed(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` with CUDA events."""
    for _ in range(warmup):
        fn()
    if DEV == "cpu":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def inputs(cfg: dict, latent: tuple[int, int, int], batch: int = 1, dtype=torch.bfloat16):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(batch, cfg["in_channels"], *latent, device=DEV, dtype=dtype, generator=g)
    t = torch.full((batch,), 500.0, device=DEV)
    ctx = torch.randn(batch, TEXT_TOKENS, COMMON["text_dim"], device=DEV, dtype=dtype, generator=g)
    return x, t, ctx


def reset():
    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0


def run_case(name: str, fn, flops: float, rows: list, warmup: int, iters: int, **extra) -> None:
    try:
        reset()
        ms = timed(fn, warmup, iters)
        row = dict(case=name, ms=ms, tflops=flops / ms / 1e9, peak_gib=peak_gib(), **extra)
    except torch.OutOfMemoryError:
        row = dict(case=name, ms=None, tflops=None, peak_gib=None, note="out of memory", **extra)
    rows.append(row)
    print(json.dumps(row), flush=True)


def stock_model(cfg: dict):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(**cfg, **COMMON).to(DEV, torch.bfloat16)
    if BACKEND:
        model.set_attention_backend(BACKEND)
    return model


def miles_model(cfg: dict, mesh, modes, compiled: bool):
    from diffusers import WanTransformer3DModel

    from miles.train.parallelize import parallelize_expert

    torch.manual_seed(0)
    model = WanTransformer3DModel(**cfg, **COMMON).to(DEV, torch.float32).train()
    parallelize_expert(
        model,
        mesh,
        attention_backend=BACKEND or None,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        checkpoint_modes=modes,
        compile_blocks=compiled,
    )
    return model


def bench_shape(shape: str, mesh, quick: bool, case_filter: str = "") -> list[dict]:
    from miles.parallel.checkpointing import checkpoint_modes
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.sampler import predict_velocity

    cfg = SHAPES[shape]
    latent = LATENTS.get(shape, LATENT_FHW)
    tokens = latent[0] * (latent[1] // 2) * (latent[2] // 2)
    fwd = model_flops(cfg, tokens)
    rows: list[dict] = []
    warm, iters = (1, 2) if quick else (2, 5)
    common = dict(shape=shape, tokens=tokens)
    x, t, ctx = inputs(cfg, latent)
    neg = torch.zeros_like(ctx)

    def wanted(name: str) -> bool:
        return re.search(case_filter, name) is not None

    # --- stock -----------------------------------------------------------------------------
    model = stock_model(cfg)
    model.eval()
    with torch.no_grad():
        run_case(
            "stock forward", lambda: model(x, t, ctx, return_dict=False), fwd, rows, warm, iters, **common
        )

    def stock_step():
        out = model(x, t, ctx, return_dict=False)[0]
        out.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    model.train()
    if wanted("stock fwd+bwd"):
        run_case("stock fwd+bwd", stock_step, 3 * fwd, rows, warm, iters, **common)
    if wanted("stock fwd+bwd, full ckpt"):
        model.enable_gradient_checkpointing()
        run_case("stock fwd+bwd, full ckpt", stock_step, 3 * fwd, rows, warm, iters, **common)
        model.disable_gradient_checkpointing()

    # rollout: one CFG denoising step, as WanPipeline does it (two forwards of batch 1)
    model.eval()

    def stock_cfg_step():
        with torch.no_grad():
            c = model(x, t, ctx, return_dict=False)[0]
            u = model(x, t, neg, return_dict=False)[0]
            return u + 4.0 * (c - u)

    if wanted("stock rollout"):
        run_case("stock rollout step (CFG, 2 fwd)", stock_cfg_step, 2 * fwd, rows, warm, iters, **common)
    model = None
    reset()

    # --- miles (the trainer's build) ---------------------------------------------------------
    from diffusers import WanTransformer3DModel

    from miles.models.wan import calibrate_block_memory
    from miles.parallel.checkpointing import fixed_training_bytes

    n = cfg["num_layers"]
    for compiled in (False, True):
        tag = ", compiled" if compiled else ""
        plans = {m: checkpoint_modes(m, n) for m in ("none", "selective", "attention", "full")}
        budgets = [
            b for b in (40.0, 80.0, 130.0) if wanted(f"miles train step, ckpt budget {b:.0f} GiB{tag}")
        ]
        budgets = budgets if DEV == "cuda" else []  # calibration measures CUDA memory
        if budgets:
            probe = WanTransformer3DModel(**cfg, **COMMON).to(DEV)  # block 0's activation bytes per mode
            probe.set_attention_backend(BACKEND)
            t0 = time.perf_counter()
            block_bytes = calibrate_block_memory(probe, tokens, torch.device(DEV), batch=1, compiled=compiled)
            num_params = sum(p.numel() for p in probe.parameters())
            fixed = fixed_training_bytes(
                num_params, num_params, 1, sum(p.numel() for p in probe.blocks[0].parameters())
            )
            probe = None
            reset()
            rows.append(
                dict(
                    case="calibration" + tag,
                    shape=shape,
                    seconds=time.perf_counter() - t0,
                    fixed_gib=fixed / 2**30,
                    **{f"block_gib_{k}": v / 2**30 for k, v in block_bytes.items()},
                )
            )
            print(json.dumps(rows[-1]), flush=True)
            for budget in budgets:
                try:
                    plans[f"budget {budget:.0f} GiB"] = checkpoint_modes(
                        "budget", n, budget * 2**30 - fixed, block_bytes
                    )
                except ValueError as e:
                    print(f"budget {budget}: {e}")
        for label, modes in plans.items():
            name = f"miles train step, ckpt {label}{tag}"
            fb_name = f"miles fwd+bwd, ckpt {label}{tag}"
            rollout = label == "none" and wanted("miles rollout" + tag)
            if not (wanted(name) or wanted(fb_name) or rollout):
                continue
            try:
                t0 = time.perf_counter()
                model = miles_model(cfg, mesh, modes, compiled)
            except Exception as e:  # a build failure is a result too
                rows.append(dict(case=name, shape=shape, note=f"failed: {type(e).__name__}: {e}"[:300]))
                continue
            optim = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
            counts = {m: modes.count(m) for m in ("none", "selective", "attention", "full")}

            def fwd_bwd(model=model):
                out = model(x, t, ctx, return_dict=False)[0]
                out.float().square().mean().backward()

            def train_step(model=model, optim=optim):
                # The trainer's step: forward, backward, optimizer (fp32 master weights and moments).
                fwd_bwd(model)
                optim.step()
                optim.zero_grad(set_to_none=True)

            def fwd_bwd_only(model=model):
                fwd_bwd(model)
                model.zero_grad(set_to_none=True)

            if compiled:  # first call compiles; keep it out of the timings and report it
                try:
                    fwd_bwd_only()
                    if DEV == "cuda":
                        torch.cuda.synchronize()
                    rows.append(
                        dict(case=f"compile time, {label}", shape=shape, seconds=time.perf_counter() - t0)
                    )
                    print(json.dumps(rows[-1]), flush=True)
                except torch.OutOfMemoryError:
                    pass
            for case, fn in ((fb_name, fwd_bwd_only), (name, train_step)):
                if not wanted(case):
                    continue
                try:
                    run_case(case, fn, 3 * fwd, rows, warm, iters, modes=counts, **common)
                except Exception as e:
                    rows.append(dict(case=case, shape=shape, note=f"failed: {type(e).__name__}: {e}"[:300]))
            if rollout:
                model.eval()
                with torch.no_grad(), unsharded_for_rollout([model]):
                    run_case(
                        "miles rollout step (batched CFG)" + tag,
                        lambda model=model: predict_velocity([model], x, t[0], ctx, neg, 4.0, None),
                        2 * fwd,
                        rows,
                        warm,
                        iters,
                        **common,
                    )
            model = optim = None
            reset()
    return rows


def write(rows: list[dict], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}; {meta['date']}; command: `{meta['command']}`",
        "",
        "| shape | case | ms | model TFLOP/s | % of 782 peak | peak GiB | blocks none/sel/attn/full |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["case"].startswith(("calibration", "compile time")):
            continue
        ms = ("OOM" if "ms" in r else "-") if r.get("ms") is None else f"{r['ms']:.0f}"
        tf = "-" if r.get("tflops") is None else f"{r['tflops']:.0f}"
        pct = "-" if r.get("tflops") is None else f"{100 * r['tflops'] / PEAK_TFLOPS:.0f}%"
        pk = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        m = r.get("modes")
        modes = f"{m['none']}/{m['selective']}/{m['attention']}/{m['full']}" if m else r.get("note", "")
        lines.append(f"| {r['shape']} | {r['case']} | {ms} | {tf} | {pct} | {pk} | {modes} |")
    cal = [r for r in rows if r["case"].startswith("calibration")]
    if cal:
        lines += ["", "Per-block activation memory (GiB, one sample, measured):", ""]
        for r in cal:
            lines.append(
                f"- {r['shape']} ({r['case']}): none {r['block_gib_none']:.2f}, selective {r['block_gib_selective']:.2f}, "
                f"attention {r['block_gib_attention']:.2f}, full {r['block_gib_full']:.2f}; "
                f"fixed (fp32 weights, grads, AdamW, 2 bf16 blocks) {r['fixed_gib']:.1f}"
            )
    comp = [r for r in rows if r["case"].startswith(("calibration", "compile time"))]
    if comp:
        lines += ["", "Compile and calibration wall time (s): "]
        lines.append(
            ", ".join(f"{r['shape']} {r['case']} {r['seconds']:.0f}" for r in comp if "seconds" in r)
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "smoke"], choices=list(SHAPES))
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations")
    ap.add_argument(
        "--cases",
        nargs="*",
        default=[],
        help="SHAPE=REGEX: only the cases of SHAPE whose name matches REGEX (stock forward always runs)",
    )
    args = ap.parse_args()
    args.cases = dict(c.split("=", 1) for c in args.cases)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    if DEV == "cuda":
        torch.cuda.set_device(0)
    from miles.parallel.topology import ParallelDims, build_parallel_mesh

    mesh = build_parallel_mesh(ParallelDims(world_size=1, sequence_parallel_size=1), DEV)
    meta = dict(
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        command="python bench/gpu_bench.py " + " ".join(sys.argv[1:]),
    )
    rows = []
    try:
        for shape in args.shapes:
            rows += bench_shape(shape, mesh, args.quick, args.cases.get(shape, ""))
            write(rows, Path(args.out), meta)
    finally:
        write(rows, Path(args.out), meta)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
