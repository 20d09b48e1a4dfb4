"""Low-precision rollout attention on one GPU: the self-attention kernel in bf16 vs INT8 at Wan's
shapes, the rollout with and without FP8 Linears, and the log-prob gap against the bf16 recompute.

    python bench/attention_precision.py --out DIR            # one H200: 1.3B + 14B kernels, 1.3B rollouts
    python bench/attention_precision.py --out DIR --tiny     # CPU smoke: tiny shapes, the float reference

Kernel (``kernel`` in the JSON): at 81x480x832 (21 x 30 x 52 = 32,760 tokens) with the 1.3B's 12
heads and the 14B's 40 heads of 128, one sequence, random bf16 Q/K/V (K with 4 offset channels, the
outliers SageAttention's smoothing is for): the milliseconds of the rollout's bf16 attention
(diffusers' ``_native_cudnn``, what the trainer runs on CUDA) and of ``rollout.attention_precision``'s
kernel (``sage_int8``: smoothing, INT8 quantization and the Triton attention, everything the rollout
pays), their TFLOP/s at 4·S²·H·D, and on the first 1,024 queries the mean error of each against
float32 attention (relative to its mean magnitude) and of the kernel against its float formula
(:func:`miles.rollout.attention.sage_int8_reference`). Beside them, exploratory, cuDNN's FP8 SDPA
through ``nvidia-cudnn-frontend`` (1.16.0, a 2 MB wheel, when importable): ``cudnn_fp8_ms`` and its
error, or ``cudnn_fp8_error`` with the reason it did not run; it is not a rollout setting.

Rollout (``rollout``): the 1.3B transformer with random weights wrapped as the trainer wraps it
(``bench/fp8_rollout.py``'s ``build_expert``: FSDP2, bf16 compute, blocks compiled unless
``--eager``), 2 samples, 10 steps, batched CFG 5, every non-final step an SDE step, sampled as the
trainer samples (``unsharded_for_rollout``, ``rollout.precision``'s and ``rollout.attention_precision``'s
contexts) for each of Linears {bf16, fp8} x attention {bf16, sage_int8} that this machine can run
(a warm-up, then ``--repeats`` each, from the same noise); then each low-precision rollout's SDE
steps rescored by the bf16 policy (what the trainer's correction does): per step the mean and max
|logp_bf16 − logp_rollout| and the truncated importance weights min(exp(Δ), 2). ``speedup``: the
bf16 rollout's seconds over the case's (the float8 copy's once-per-rollout cost apart, as
``quantize_s``).

``--tiny`` (CPU): the tiny model and tiny shapes, the kernel replaced by its float reference
(``kernel_impl`` says so): it checks the bench end to end, its times are not a speed-up. FP8 Linears
need CUDA sm >= 89 and torchao: elsewhere their cases are listed in ``unavailable`` with the reason.
Writes ``attention_precision.json`` (after every section) and ``attention_precision.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fp8_rollout import CAP, GUIDANCE, NOISE_LEVEL, SHIFT, TEXT_TOKENS, build_expert, gap_rows, rescore  # noqa: E402
from bench.gpu_bench import model_flops  # noqa: E402

TOKENS_81 = 21 * 30 * 52  # 81 x 480 x 832 after the VAE (4 x 8 x 8) and the 1 x 2 x 2 patch
KERNEL_SHAPES = {"1.3b": dict(heads=12, tokens=TOKENS_81), "14b": dict(heads=40, tokens=TOKENS_81)}
TINY_KERNEL_SHAPES = {"tiny": dict(heads=2, tokens=384)}
HEAD_DIM, ACCURACY_QUERIES = 128, 1024
CASES = [("bf16", "bf16"), ("fp8", "bf16"), ("bf16", "sage_int8"), ("fp8", "sage_int8")]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU, the wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def _kernel(device: torch.device):
    """(the INT8 kernel, what it is): the package's on CUDA, else the float reference."""
    from miles.rollout.attention import KERNELS, sage_int8_reference

    if device.type == "cuda":
        return KERNELS["sage_int8"].load(), "sageattention (Triton INT8 QK, fp16 PV)"
    return sage_int8_reference, "float reference on CPU (an emulation: not a speed)"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().mean() / b.float().abs().mean())


def _fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in float8 e4m3 with one power-of-two scale (amax to at most 448), and its descale (1,1,1,1)."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    mult = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    return (x.float() * mult).to(torch.float8_e4m3fn).contiguous(), (1.0 / mult).reshape(1, 1, 1, 1)


def cudnn_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """cuDNN's FP8 SDPA forward (``nvidia-cudnn-frontend``'s ``sdpa_fp8``) for (B, S, H, D) bf16 at
    this shape, as a callable that pays what a rollout would: K smoothed (as SageAttention does:
    softmax ignores it, and it narrows K's range), Q, K, V to e4m3 with per-tensor power-of-two
    scales, P at a fixed scale of 256 (P <= 1), the FP8 output (Hopper writes e4m3) back to bf16.
    Exploratory: not a ``rollout.attention_precision`` value (docs/fp8_rollout.md says why)."""
    import cudnn

    b, s, h, d = q.shape
    e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    dims, strides = (b, h, s, d), (s * h * d, d, h * d, 1)  # (B, H, S, D) views of contiguous (B, S, H, D)
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=e4m3) for n in ("q", "k", "v"))
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    scalars = {n: graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32) for n in names}
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, **scalars, is_inference=True, attn_scale=d**-0.5, use_causal_mask=False
    )
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
    p_scale = torch.full((1, 1, 1, 1), 256.0, device=q.device)
    amaxes = [torch.empty(1, 1, 1, 1, device=q.device) for _ in range(2)]

    def attention(q, k, v):
        (q8, dq), (k8, dk), (v8, dv) = (_fp8_per_tensor(t) for t in (q, k - k.mean(dim=1, keepdim=True), v))
        o_scale = 0.5 / dv  # |O| <= max|V|: half of V's own range
        out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
        pack = {tq: q8, tk: k8, tv: v8, o: out, amax_s: amaxes[0], amax_o: amaxes[1]}
        pack.update(dict(zip((scalars[n] for n in names), (dq, dk, dv, 1.0 / p_scale, p_scale, o_scale))))
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        # raw pointers (the tensors live through the call): no DLPack export of float8 needed
        graph.execute({t: x.data_ptr() for t, x in pack.items()}, workspace.data_ptr(), handle=handle)
        return (out.float() / o_scale).to(q.dtype)

    return attention


def cudnn_fp8_row(q, k, v, exact: torch.Tensor, bf16_ms: float, device, args) -> dict:
    """The exploratory cuDNN FP8 kernel's time and error at this shape, or why it could not run."""
    if device.type != "cuda":
        return dict(cudnn_fp8_error="CUDA only")
    try:
        fn = cudnn_fp8_attention(q, k, v)
        ms = _ms(lambda: fn(q, k, v), device, args.warmup, args.iters)
        with torch.no_grad():
            out = fn(q, k, v)[:, : exact.shape[1]]
        return dict(cudnn_fp8_ms=ms, cudnn_fp8_speedup=bf16_ms / ms, err_cudnn_fp8_vs_exact=_rel(out, exact))
    except Exception as e:  # not installed, no FP8 engine for this shape, ...: recorded, the others go on
        return dict(cudnn_fp8_error=f"{type(e).__name__}: {e}"[:500])


def bench_kernel(name: str, heads: int, tokens: int, device: torch.device, args) -> dict:
    """bf16 SDPA (the rollout's backend) vs the INT8 kernel at one shape; errors on a query slice."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from miles.rollout.attention import sage_int8_reference
    from miles.sequence_parallel.checks import default_attention_backend

    kernel, impl = _kernel(device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, HEAD_DIM, device=device, generator=g) for _ in range(3))
    k[..., :4] += 6.0
    q, k, v = (t.bfloat16() for t in (q, k, v))
    backend = default_attention_backend(device)
    bf16_ms = _ms(lambda: dispatch_attention_fn(q, k, v, backend=backend), device, args.warmup, args.iters)
    lowp_ms = _ms(lambda: kernel(q, k, v, None), device, args.warmup, args.iters)
    flops = 4 * tokens * tokens * heads * HEAD_DIM
    n = min(ACCURACY_QUERIES, tokens)  # a multiple of 128: the slice keeps Q's quantization blocks
    with torch.no_grad():
        lowp = kernel(q, k, v, None)[:, :n]
        bf16 = dispatch_attention_fn(q, k, v, backend=backend)[:, :n]
        exact, ref = [], []
        for h in range(0, heads, 4):  # the float32 score matrix a few heads at a time
            sl = slice(h, h + 4)
            qs, ks, vs = (t[:, :, sl] for t in (q[:, :n], k, v))
            exact.append(
                F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (qs, ks, vs))).transpose(
                    1, 2
                )
            )
            ref.append(sage_int8_reference(qs, ks, vs).float())
        exact, ref = torch.cat(exact, dim=2), torch.cat(ref, dim=2)
    return dict(
        shape=name,
        tokens=tokens,
        heads=heads,
        head_dim=HEAD_DIM,
        bf16_backend=backend or "diffusers default (native SDPA)",
        kernel_impl=impl,
        bf16_ms=bf16_ms,
        lowp_ms=lowp_ms,
        speedup=bf16_ms / lowp_ms,
        bf16_tflops=flops / bf16_ms / 1e9,
        lowp_tflops=flops / lowp_ms / 1e9,
        err_lowp_vs_exact=_rel(lowp, exact),
        err_bf16_vs_exact=_rel(bf16, exact),
        err_lowp_vs_reference=_rel(lowp, ref),
        err_reference_vs_exact=_rel(ref, exact),
        **cudnn_fp8_row(q, k, v, exact, bf16_ms, device, args),
    )


def _unavailable(linears: str, attention: str, device: torch.device) -> str | None:
    """Why this machine cannot run the case (None: it can)."""
    if linears == "fp8":
        if device.type != "cuda" or torch.cuda.get_device_capability() < (8, 9):
            return "FP8 Linears need CUDA sm >= 89"
        if importlib.util.find_spec("torchao") is None:
            return "FP8 Linears need torchao (pip install -e '.[fp8]')"
    if attention != "bf16" and device.type == "cuda":
        if importlib.util.find_spec("sageattention") is None or importlib.util.find_spec("triton") is None:
            return "sage_int8 needs sageattention and triton (pip install -e '.[attn-lowp]')"
    return None


def _rollout(model, linears: str, attention: str, inputs: dict, args, device, kernel):
    """One rollout: (Rollout, seconds sampling, seconds making the float8 copy)."""
    from miles.parallel.fsdp import unsharded_for_rollout
    from miles.rollout.attention import rollout_attention
    from miles.rollout.precision import rollout_precision
    from miles.rollout.sampler import sample_with_logprob

    generator = torch.Generator(device=device).manual_seed(1)
    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(unsharded_for_rollout([model]))
        _sync(device)
        t0 = time.perf_counter()
        stack.enter_context(rollout_precision([model], linears))
        _sync(device)
        t1 = time.perf_counter()
        stack.enter_context(rollout_attention([model], attention, kernel=kernel))
        ro = sample_with_logprob(
            [model],
            inputs["pos"],
            inputs["neg"],
            inputs["init"].shape[1:],
            num_steps=args.num_steps,
            shift=SHIFT,
            guidance_scales=[GUIDANCE],
            noise_level=NOISE_LEVEL,
            generator=generator,
            latents=inputs["init"],
            sde_steps=list(range(args.num_steps - 1)),
        )
        _sync(device)
        t2 = time.perf_counter()
    return ro, t2 - t1, t1 - t0


def bench_rollout(model_name: str, frames: int, args, device, case: dict, save: Callable[[], None]) -> None:
    """Every runnable (Linears, attention) case of one model: seconds, speed-up, log-prob gap, filled
    into ``case`` with ``save()`` after every rollout (a time limit keeps what was measured)."""
    model, spec = build_expert(model_name, device, device.type == "cuda" and not args.eager)
    kernel = None if device.type == "cuda" else _kernel(device)[0]
    t = spec["transformer"]
    h, w = args.size
    latent = (t["in_channels"], (frames - 1) // 4 + 1, h // 8, w // 8)
    tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        pos=torch.randn(args.samples, TEXT_TOKENS, t["text_dim"], generator=g).to(device, torch.bfloat16),
        neg=torch.randn(1, TEXT_TOKENS, t["text_dim"], generator=g).to(device, torch.bfloat16),
        init=torch.randn(args.samples, *latent, generator=g).to(device),
    )
    flops = args.samples * args.num_steps * 2 * model_flops(t, tokens, text_tokens=TEXT_TOKENS)
    runnable = [c for c in CASES if _unavailable(*c, device) is None]
    case.update(
        size=[h, w],
        tokens=tokens,
        model_tflop=flops / 1e12,
        kernel_impl="sageattention (Triton INT8 QK, fp16 PV)" if kernel is None else _kernel(device)[1],
        unavailable={f"{a}/{b}": _unavailable(a, b, device) for a, b in CASES if (a, b) not in runnable},
        runs={},
    )
    last = {}
    for rep in range(args.repeats + 1):
        for linears, attention in runnable:
            key = f"{linears}/{attention}"
            ro, secs, quant = _rollout(model, linears, attention, inputs, args, device, kernel)
            case["runs"].setdefault(key, []).append(dict(rollout_s=secs, quantize_s=quant, warmup=rep == 0))
            last[key] = ro
            print(json.dumps(dict(model=model_name, case=key, **case["runs"][key][-1])), flush=True)
            save()
    for key, rows in case["runs"].items():
        measured = [r["rollout_s"] for r in rows if not r["warmup"]] or [rows[-1]["rollout_s"]]
        secs = sum(measured) / len(measured)
        case[key] = dict(rollout_s=secs, tflops=flops / secs / 1e12, quantize_s=rows[-1]["quantize_s"])
    save()
    _gaps(model, case, last, inputs, save)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _gaps(model, case: dict, last: dict, inputs: dict, save: Callable[[], None]) -> None:
    """Each low-precision rollout rescored by the bf16 policy: the gap per SDE step, the TIS weights,
    its speed-up and final latents against bf16/bf16's; the bf16 rollout's own rescoring (the canary)."""
    base = last.get("bf16/bf16")
    if base is not None:
        canary = rescore(model, base, inputs["pos"], inputs["neg"]) - base.log_probs.float()
        case["bf16/bf16"]["rescore_abs_gap_max"] = float(canary.abs().max())
    for key in [k for k in last if k != "bf16/bf16"]:
        ro = last[key]
        rows = gap_rows(rescore(model, ro, inputs["pos"], inputs["neg"]), ro.log_probs, ro.step_indices)
        entry = case[key]
        entry["logp_gap"] = rows
        entry["logp_abs_gap_mean"] = sum(r["logp_abs_gap_mean"] for r in rows) / len(rows)
        entry["logp_abs_gap_max"] = max(r["logp_abs_gap_max"] for r in rows)
        entry["tis_weight_mean"] = sum(r["tis_weight_mean"] for r in rows) / len(rows)
        if base is not None:
            entry["speedup"] = case["bf16/bf16"]["rollout_s"] / entry["rollout_s"]
            a, b = ro.final_latents.float(), base.final_latents.float()
            entry["final_latent_rel_l2"] = float((a - b).norm() / b.norm())
        save()


def markdown(result: dict) -> str:
    m = result["meta"]
    lines = [f"on {m['device']} (torch {m['torch']}, sageattention {m['sageattention']}); {m['command']}", ""]
    lines += [
        "| shape | tokens | heads | bf16 ms (TFLOP/s) | INT8 ms (TFLOP/s) | speed-up | err INT8 | err bf16 "
        "| INT8 vs formula |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["kernel"]:
        if "error" in r:
            lines.append(
                f"| {r['shape']} | error: {r['error'].strip().splitlines()[-1][:80]} | | | | | | | |"
            )
            continue
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['heads']} | {r['bf16_ms']:.2f} ({r['bf16_tflops']:.0f}) | "
            f"{r['lowp_ms']:.2f} ({r['lowp_tflops']:.0f}) | {r['speedup']:.2f}x | {r['err_lowp_vs_exact']:.2e} | "
            f"{r['err_bf16_vs_exact']:.2e} | {r['err_lowp_vs_reference']:.2e} |"
        )
    for r in result["kernel"]:
        if "cudnn_fp8_ms" in r:
            lines.append(
                f"cuDNN FP8 SDPA (exploratory), {r['shape']}: {r['cudnn_fp8_ms']:.2f} ms, "
                f"{r['cudnn_fp8_speedup']:.2f}x bf16, err {r['err_cudnn_fp8_vs_exact']:.2e}"
            )
        elif "cudnn_fp8_error" in r:
            lines.append(f"cuDNN FP8 SDPA (exploratory), {r['shape']}: not run: {r['cudnn_fp8_error'][:120]}")
    if m["tiny"]:
        lines += [
            "",
            "CPU smoke (--tiny): the INT8 kernel is its float reference; no time here is a speed-up.",
        ]
    lines += [
        "",
        "| model | frames | Linears/attention | rollout s (TFLOP/s) | speed-up | logp gap mean (max) | TIS w mean |",
    ]
    lines += ["| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for c in result["rollout"]:
        if "error" in c:
            lines.append(
                f"| {c['model']} | {c['frames']} | error: {c['error'].strip().splitlines()[-1][:80]} | | | | |"
            )
            continue
        for key in [k for k in c.get("runs", {}) if k in c]:  # a case cut short has runs only
            r = c[key]
            speed = f"{r['speedup']:.2f}x" if "speedup" in r else "—"
            gap = f"{r['logp_abs_gap_mean']:.2e} ({r['logp_abs_gap_max']:.2e})" if "logp_gap" in r else "—"
            w = f"{r['tis_weight_mean']:.4f}" if "logp_gap" in r else "—"
            lines.append(
                f"| {c['model']} | {c['frames']} | {key} | {r['rollout_s']:.2f} ({r['tflops']:.0f}) | {speed} | {gap} | {w} |"
            )
        for key, why in c.get("unavailable", {}).items():
            lines.append(f"| {c['model']} | {c['frames']} | {key} | not run: {why} | | | |")
    return "\n".join(lines) + "\n"


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--tiny", action="store_true", help="CPU smoke: tiny shapes and model, the float reference"
    )
    ap.add_argument("--kernel-shapes", nargs="*", default=None, help="of 1.3b 14b (default both; none: skip)")
    ap.add_argument(
        "--rollout-models", nargs="*", default=None, help="default wan2.1-t2v-1.3b (wan2.1-t2v-14b: minutes)"
    )
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--size", type=int, nargs=2, default=[480, 832], metavar=("H", "W"))
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="measured rollouts per case (after a warm-up)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--eager", action="store_true", help="do not compile the blocks (the trainer compiles on CUDA)"
    )
    args = ap.parse_args(argv)
    if args.tiny:
        args.frames, args.size, args.num_steps, args.iters, args.warmup = 5, [64, 64], 3, 2, 1
    if args.kernel_shapes is None:
        args.kernel_shapes = list(TINY_KERNEL_SHAPES if args.tiny else KERNEL_SHAPES)
    if args.rollout_models is None:
        args.rollout_models = ["tiny" if args.tiny else "wan2.1-t2v-1.3b"]
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    owns_group = not dist.is_initialized()  # a test may call main() inside its own world
    if owns_group:  # a world of one on an in-memory store: no port, nothing left in os.environ
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from importlib.metadata import version

        sage = version("sageattention")
    except Exception:
        sage = None
    command = "python bench/attention_precision.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = dict(
        meta=dict(
            device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            torch=torch.__version__,
            sageattention=sage,
            tiny=args.tiny,
            samples=args.samples,
            num_steps=args.num_steps,
            guidance=GUIDANCE,
            tis_cap=CAP,
            compiled=device.type == "cuda" and not args.eager,
            command=command,
        ),
        kernel=[],
        rollout=[],
    )
    out = args.out / "attention_precision.json"

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    shapes = {**KERNEL_SHAPES, **TINY_KERNEL_SHAPES}
    try:
        for name in args.kernel_shapes:
            try:
                result["kernel"].append(bench_kernel(name, **shapes[name], device=device, args=args))
            except Exception:  # one failed shape (OOM, the kernel) must not lose the others
                result["kernel"].append(dict(shape=name, error=traceback.format_exc()))
            print(json.dumps(result["kernel"][-1]), flush=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
        for model_name in args.rollout_models:
            case = dict(model=model_name, frames=args.frames)
            result["rollout"].append(case)
            try:
                bench_rollout(model_name, args.frames, args, device, case, save)
            except Exception:
                case["error"] = traceback.format_exc()
                print(case["error"], flush=True)
            save()
    finally:
        out.write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "attention_precision.md").write_text(markdown(result))
        print(markdown(result), flush=True)
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
