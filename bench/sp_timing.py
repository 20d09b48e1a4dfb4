"""One rank's train step (transformer forward + backward) at sp 1, 4, 8, and the bytes each
collective moves per layer: the compute side and the communication side of SP efficiency.

    python bench/sp_timing.py --out bench/results/sp                       # Wan2.1-1.3B, 81x480x832, sp 1 4 8
    python bench/sp_timing.py --out runs/sp --model tiny --shape 5 64 64 --layouts 1 2 4 4u2   # CPU

Each layout runs in its own process as rank 0 of a fake process group of world = sp (dp 1;
``bench/fake_rank.py``): the transformer (random weights, the real config) is built as the
trainer builds it — attention backend, SP install (``apply_sequence_parallel`` with the model's
plan), per-block activation checkpointing, ``apply_fsdp`` (bf16 compute, fp32 reduce, per-block
compile on CUDA) — and fed the full latent of a CFG micro-batch (batch 2); the SP boundary keeps
1/sp of the tokens, so every kernel runs at 1/sp of the sequence while the collectives move
nothing. Time: median of ``--iters`` steps after warm-up (CUDA events). A layout ``SPuU`` sets
the Ulysses degree (``4u2``: ulysses 2 x ring 2); plain ``SP`` takes the trainer's auto choice.

Collective bytes come from one extra step on an uncompiled copy (``bench/collective_bytes.py``),
per layer = per step / num_layers. Ideal speed-up at sp is sp x; ``efficiency`` = t(1) / (sp t(sp)).
``model TFLOP/s``: one rank's share of the step's model FLOPs (``bench/gpu_bench.py``'s formula x 3
for forward + backward, / sp) over its time; a row above the 782 TFLOP/s bf16 peak is flagged: it
did less work than the real rank (on the H200, sp 4 under the fake group ran at an implied 1003).
``grads vs eager``: after timing, one step from zero gradients, its per-parameter gradient norms
against the uncompiled copy's (same weights and inputs): the largest relative difference, flagged
above 0.1 (the compiled sp 4 step at 1.3B ran in 477 ms, an implied 889 TFLOP/s, while a profile
showed its cuDNN attention backward kernels taking 1.2 ms against the eager step's 58 ms).
Writes ``sp_timing.json`` and ``sp_timing.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEXT_TOKENS = 512
# Rounding separates a compiled bf16 step from an eager one; a kernel that skips work, far more.
GRAD_TOLERANCE = 0.1
PEAK_TFLOPS = 782.0  # bf16 dense, H200 (DESIGN.md): a row above it did not do the real work


def parse_layout(text: str) -> tuple[int, int]:
    """``"8"`` -> (8, 0: auto ulysses); ``"4u2"`` -> (4, 2)."""
    sp, _, u = text.partition("u")
    try:
        return int(sp), int(u or 0)
    except ValueError:
        raise ValueError(f"layout {text!r}: write SP or SPuU (e.g. 8 or 4u2)") from None


def build(model: str, sp: int, ulysses: int, device, compile_blocks: bool, checkpointing: str):
    """The transformer as the trainer shards it, on a fake world of ``sp`` ranks; returns (model, dims)."""
    import torch
    from diffusers import WanTransformer3DModel

    from bench.real_configs import model_spec
    from miles.parallel.checkpointing import checkpoint_modes
    from miles.parallel.topology import ParallelDims, build_parallel_mesh, resolve_ulysses_degree
    from miles.sequence_parallel.checks import default_attention_backend
    from miles.train.parallelize import parallelize_expert

    config = model_spec(model)["transformer"]
    torch.manual_seed(0)
    with torch.device(device):
        transformer = WanTransformer3DModel.from_config(config).train()
    heads = config["num_attention_heads"]
    dims = ParallelDims(
        world_size=sp,
        sequence_parallel_size=sp,
        ulysses_degree=resolve_ulysses_degree(sp, ulysses, heads),
    )
    mesh = build_parallel_mesh(dims, device.type)
    parallelize_expert(
        transformer,
        mesh,
        attention_backend=default_attention_backend(device),
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
        checkpoint_modes=checkpoint_modes(checkpointing, len(transformer.blocks)),
        compile_blocks=compile_blocks,
    )
    return transformer, dims


def make_step(transformer, latent: tuple[int, int, int, int], batch: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(batch, *latent, generator=g).to(device, dtype)
    t = torch.full((batch,), 500.0, device=device)
    text_dim = transformer.config.text_dim
    ctx = torch.randn(batch, TEXT_TOKENS, text_dim, generator=g).to(device, dtype)

    def step():
        out = transformer(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]
        out.float().pow(2).mean().backward()

    return step


def timed_ms(step, warmup: int, iters: int, device) -> list[float]:
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def latent_of(model: str, shape: tuple[int, int, int]) -> tuple[int, int, int, int]:
    from bench.real_configs import model_spec

    spec = model_spec(model)
    vae = spec["vae"]
    t, s = vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8)
    frames, height, width = shape
    return (spec["transformer"]["in_channels"], (frames - 1) // t + 1, height // s, width // s)


def grad_norms(model) -> dict[str, float]:
    """Norm of every parameter's gradient (this rank's shard, fp32)."""
    norms = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            norms[name] = g.float().norm().item()
    return norms


def compare_grads(ref: dict[str, float], got: dict[str, float]) -> dict:
    """The largest relative difference of per-parameter gradient norms (NaN if any is not finite)."""
    worst, where = 0.0, None
    for name in sorted(ref.keys() & got.keys()):
        diff = abs(got[name] - ref[name]) / max(abs(ref[name]), 1e-30)
        if math.isnan(diff) or diff > worst:
            worst, where = diff, name
            if math.isnan(diff):
                break
    return {"max_rel_diff": worst, "param": where, "missing": sorted(ref.keys() ^ got.keys())}


def run_layout(args, sp: int, ulysses: int) -> dict:
    """One layout in this process (fake world of sp ranks)."""
    import torch

    from bench.collective_bytes import count_collectives, summarize
    from bench.fake_rank import fake_collective_fixes, init_fake_world
    from bench.gpu_bench import model_flops
    from miles.parallel.compile import resolve_compile

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    init_fake_world(sp)
    latent = latent_of(args.model, tuple(args.shape))
    with fake_collective_fixes():
        counted, dims = build(args.model, sp, ulysses, device, False, args.checkpointing)
        with count_collectives() as counter:
            make_step(counted, latent, args.batch, device)()
        eager_grads = grad_norms(counted)
        num_layers = len(counted.blocks)
        sizes = {"ulysses": dims.ulysses, "ring": dims.ring, "sp_boundary": dims.sp, "fsdp": sp, "other": sp}
        collectives = summarize(counter, sizes, num_layers)
        del counted
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        compile_blocks = resolve_compile(args.compile, device)
        transformer, _ = build(args.model, sp, ulysses, device, compile_blocks, args.checkpointing)
        step = make_step(transformer, latent, args.batch, device)
        times = timed_ms(step, args.warmup, args.iters, device)
        transformer.zero_grad(set_to_none=True)
        step()  # one step from zero gradients, against the uncompiled copy's (same weights, inputs)
        grad_check = compare_grads(eager_grads, grad_norms(transformer))
    patch = transformer.config.patch_size
    tokens = (latent[1] // patch[0]) * (latent[2] // patch[1]) * (latent[3] // patch[2])
    step_ms = sorted(times)[len(times) // 2]
    flops = 3 * args.batch * model_flops(transformer.config, tokens) / sp  # one rank's share, no recompute
    return {
        "layout": f"{sp}u{dims.ulysses}",
        "sp": sp,
        "ulysses": dims.ulysses,
        "ring": dims.ring,
        "model": args.model,
        "latent": list(latent),
        "tokens": tokens,
        "tokens_per_rank": -(-tokens // sp),
        "batch": args.batch,
        "num_layers": num_layers,
        "compiled": compile_blocks,
        "checkpointing": args.checkpointing,
        "step_ms": step_ms,
        "model_tflops_per_rank": flops / 1e12,
        "tflops_per_s": flops / (step_ms / 1e3) / 1e12,
        "step_ms_all": times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "collectives": collectives,
        "grads_vs_eager": grad_check,
    }


def _grad_cell(row: dict, differ: list[str]) -> str:
    check = row.get("grads_vs_eager")
    if check is None:
        return "—"
    worst = check["max_rel_diff"]
    bad = math.isnan(worst) or worst > GRAD_TOLERANCE or bool(check["missing"])
    if bad:
        differ.append(f"sp{row['sp']} ({check['param']})")
    return f"{worst:.1e}{' (!)' if bad else ''}"


def markdown(rows: list[dict]) -> str:
    base = next((r["step_ms"] for r in rows if r["sp"] == 1), None)
    lines = [
        f"Model {rows[0]['model']}, latent {'x'.join(map(str, rows[0]['latent']))} ({rows[0]['tokens']} tokens), "
        f"batch {rows[0]['batch']}, {rows[0]['checkpointing']} checkpointing, "
        f"{'compiled' if rows[0]['compiled'] else 'eager'}, on {rows[0]['device']}",
        "",
        "| layout | ulysses x ring | tokens/rank | step ms | model TFLOP/s | speed-up vs sp1 | efficiency | peak GiB "
        "| grads vs eager |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    impossible, differ = [], []
    for r in rows:
        speed = base / r["step_ms"] if base else None
        eff = speed / r["sp"] if speed else None
        rate = r.get("tflops_per_s")
        flag = ""
        if rate is not None and r["device"] != "cpu" and rate > PEAK_TFLOPS:
            flag = " (!)"
            impossible.append(f"sp{r['sp']}")
        lines.append(
            f"| sp{r['sp']} | {r['ulysses']} x {r['ring']} | {r['tokens_per_rank']} | {r['step_ms']:.1f} | "
            f"{'—' if rate is None else f'{rate:.0f}'}{flag} | "
            f"{'—' if speed is None else f'{speed:.2f}'} | {'—' if eff is None else f'{eff:.0%}'} | "
            f"{'—' if r['peak_gib'] is None else format(r['peak_gib'], '.1f')} | {_grad_cell(r, differ)} |"
        )
    if impossible:
        lines += [
            "",
            f"(!) {', '.join(impossible)}: the model FLOPs of one rank's share (forward + backward, no "
            f"recompute) over the step time exceed the {PEAK_TFLOPS:.0f} TFLOP/s bf16 peak: that step did "
            "less work than the real rank does, so its time is not the real compute time.",
        ]
    if differ:
        lines += [
            "",
            f"(!) {', '.join(differ)}: the timed model's gradients differ from the uncompiled copy's (largest "
            f"relative difference of per-parameter gradient norms above {GRAD_TOLERANCE}, or not finite): "
            "the timed step did not compute what the eager one does.",
        ]
    lines += [
        "",
        "Bytes per layer per rank, one train step (forward + backward; buffer = the rank's input to the "
        "collective, wire = what leaves the rank):",
        "",
        "| layout | collective | group | calls | buffer MiB/layer | wire MiB/layer |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        for c in r["collectives"]:
            lines.append(
                f"| sp{r['sp']} ({r['ulysses']}x{r['ring']}) | {c['category']} {c['kind']} | {c['group_size']} | "
                f"{c['calls']} | {c['buffer_bytes_per_layer'] / 2**20:.2f} | {c['wire_bytes_per_layer'] / 2**20:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b", help="a bench/real_configs.py model (or tiny)")
    ap.add_argument("--shape", type=int, nargs=3, default=[81, 480, 832], metavar=("FRAMES", "H", "W"))
    ap.add_argument("--layouts", nargs="+", default=["1", "4", "8"], help="SP or SPuU, e.g. 1 4 8 8u8")
    ap.add_argument("--batch", type=int, default=2, help="samples per forward (a CFG micro-batch: 2)")
    ap.add_argument("--checkpointing", default="selective", help="activation checkpointing mode per block")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layout", help=argparse.SUPPRESS)  # internal: run this one layout in this process
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.layout:
        sp, u = parse_layout(args.layout)
        result = run_layout(args, sp, u)
        (args.out / f"layout_{args.layout}.json").write_text(json.dumps(result, indent=2) + "\n")
        return
    rows = []
    for layout in args.layouts:
        parse_layout(layout)
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--layout", layout]
        print(f"[sp-timing] {layout}", flush=True)
        subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=True)
        rows.append(json.loads((args.out / f"layout_{layout}.json").read_text()))
    (args.out / "sp_timing.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = markdown(rows)
    (args.out / "sp_timing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
