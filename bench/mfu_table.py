"""The MFU table (issue 43): per phase and for the whole step, model FLOPs, seconds, TFLOP/s and MFU of
every step measured, read from the benches' JSONs alone.

    python bench/mfu_table.py --out OUT                          # every JSON under docs/bench/
    python bench/mfu_table.py --out OUT --json A.json B.json     # given ones (a GPU session's OUT/*)

A JSON is read where it is one of:

- a ``bench/step_bench.py`` result (``<reward>.json``, ``bench/profile_step.py``'s ``profile.json``,
  each ``miles`` side of a ``peer_step.json``): its ``flops`` and its probed ``phases``;
- a folder of them in one file (``{"<label>": <result>, ...}``, e.g. ``docs/bench/step_variants_h200.json``);
- ``bench/peer_step.py``'s ``peer_step.json``: flow_grpo's side (its mean seconds per phase and the
  JSON's ``flops``) and miles' (a step bench result), per ``--train`` setting.

The FLOPs are the benches' own (``step_bench.step_flops``: rollout = samples x steps x CFG forwards,
train = samples x SDE steps x CFG x 3 + the KL reference's forwards; a forward's matmul and attention
FLOPs from ``bench/gpu_bench.py``'s ``model_flops``; recompute not counted). Seconds are
``step_bench.summarize``'s: the mean over the measured rollouts (all but the first, when there are
several; a single rollout includes its warm-up's compile and is marked so). MFU is TFLOP/s over
the peak: ``--peak`` (default 782 TFLOP/s, the bf16 dense matmul ceiling measured on this H200,
the project's MFU since issue 9: DESIGN.md, BENCHMARKS.md) and, beside it, the H200 SXM datasheet's
dense BF16 (989 TFLOP/s: NVIDIA's 1,979 with 2:4 sparsity, halved). Decode and reward carry no
model FLOPs: they count as time in the whole step. Writes ``mfu.json`` and ``mfu.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.step_bench import PEAK_TFLOPS, STEP_PHASES, per_rollout, summarize  # noqa: E402

PEAK_SOURCE = "bf16 dense matmul ceiling measured on one H200 (DESIGN.md; BENCHMARKS.md, issue 9)"
DATASHEET_TFLOPS = 989.0
DATASHEET_SOURCE = "NVIDIA H200 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity, halved for dense"


def is_step_result(d) -> bool:
    return isinstance(d, dict) and "flops" in d and "phases" in d and isinstance(d["phases"], list)


def step_row(label: str, r: dict, peak: float) -> dict:
    """One step bench result: its seconds as ``step_bench.summarize`` means them, its own FLOPs."""
    rollouts = per_rollout(r["phases"])
    s = summarize(rollouts, r["flops"], r.get("summary", {}).get("budget_gib", 0.0), peak)
    setting = [r.get("rollout_precision", "bf16") + " rollouts", f"VAE {r.get('vae_dtype', 'float32')}"]
    if r.get("attention_precision", "bf16") != "bf16":
        setting.append(f"{r['attention_precision']} self-attention in the rollout")
    if "attention_backend" in r:  # recorded since issue 43 (before: the trainer's default, cudnn)
        setting.append(f"attention {r['attention_backend'] or 'default'}")
    if "activation_checkpointing" in r:
        setting.append(f"checkpointing {r['activation_checkpointing']}")
    setting += [flag for flag in ("overlap_decode", "deterministic_mode") if r.get(flag)]
    if r.get("lora_rank"):
        setting.append(f"LoRA r {r['lora_rank']}")
    return {
        "label": label,
        "trainer": "miles",
        "shape": r["shape"],
        "tokens": r["tokens"],
        "samples": r["samples"],
        "setting": ", ".join(setting),
        "measured_rollouts": s["measured_rollouts"],
        "includes_warmup": len(rollouts) == 1,
        "phases": {
            ph: {"tflop": row["model_tflop"], **_rate(row["model_tflop"], row["wall_s"], peak)}
            for ph, row in s["phases"].items()
        },
        "step": {
            "tflop": s["step"]["model_tflop"],
            **_rate(s["step"]["model_tflop"], s["step"]["wall_s"], peak),
        },
    }


def _rate(tflop: float, seconds: float, peak: float) -> dict:
    tflops = tflop / seconds if seconds > 0 else 0.0
    return {"s": seconds, "tflops": tflops, "mfu": tflops / peak, "mfu_datasheet": tflops / DATASHEET_TFLOPS}


def peer_row(label: str, side: dict, flops: dict, args: dict, peak: float) -> dict:
    """flow_grpo's side of a ``peer_step.json``: its mean seconds (``summarize`` there), the JSON's FLOPs."""
    seconds = {"rollout": side["rollout_s"], "decode+reward": side["reward_s"], "train": side["train_s"]}
    tflop = {"rollout": flops["rollout"] / 1e12, "decode+reward": 0.0, "train": flops["train"] / 1e12}
    step_tflop = tflop["rollout"] + tflop["train"]
    return {
        "label": label,
        "trainer": "flow_grpo",
        "shape": args["shape"],
        "tokens": flops["tokens"],
        "samples": args["samples"],
        "setting": "eager, fp32 weights under bf16 autocast, gradient checkpointing"
        + ("" if args.get("full") else ", LoRA r 32"),
        "measured_rollouts": max(1, len(side.get("steps", [])) - 1),
        "includes_warmup": len(side.get("steps", [])) <= 1,
        "phases": {ph: {"tflop": tflop[ph], **_rate(tflop[ph], seconds[ph], peak)} for ph in STEP_PHASES},
        "step": {"tflop": step_tflop, **_rate(step_tflop, sum(seconds.values()), peak)},
    }


def rows_of(name: str, d: dict, peak: float) -> list[dict]:
    """The rows one JSON file holds (none when it is not a step's)."""
    if not isinstance(d, dict):
        return []
    if is_step_result(d):
        return [step_row(name, d, peak)]
    rows = []
    if "flow_grpo" in d and "flops" in d:  # peer_step.json before --train (issue 35)
        rows.append(peer_row(f"{name}:flow_grpo", d["flow_grpo"], d["flops"], d["args"], peak))
    for setting in ("lora", "full"):  # peer_step.json since issue 43
        side = d.get(setting)
        if isinstance(side, dict) and "flow_grpo" in side:
            args = {**d["args"], "full": setting == "full"}
            rows.append(peer_row(f"{name}:{setting}:flow_grpo", side["flow_grpo"], d["flops"], args, peak))
            if is_step_result(side.get("miles")):
                rows.append(step_row(f"{name}:{setting}:miles", side["miles"], peak))
    if not rows and isinstance(d, dict):  # a folder of step results in one file
        rows = [step_row(f"{name}:{k}", v, peak) for k, v in d.items() if is_step_result(v)]
    return rows


def collect(paths: list[Path], peak: float) -> list[dict]:
    rows = []
    for path in paths:
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        rows += rows_of(path.name, d, peak)
    return rows


def _cell(p: dict, warm: str) -> str:
    return f"{p['tflop']:.0f} / {p['s']:.2f}{warm} / {p['tflops']:.0f} / {p['mfu']:.1%}"


def markdown(rows: list[dict], peak: float) -> str:
    lines = [
        f"MFU against {peak:g} TFLOP/s ({PEAK_SOURCE if peak == PEAK_TFLOPS else 'given with --peak'}); "
        f"the last column against {DATASHEET_TFLOPS:g} ({DATASHEET_SOURCE}). TFLOP: model FLOPs of one step "
        "(the benches' own counts); s: mean over the measured rollouts (* a single rollout, its compile included).",
        "",
        "| run | trainer | setting | rollout TFLOP / s / TFLOP/s / MFU | decode + reward s | "
        "train TFLOP / s / TFLOP/s / MFU | step TFLOP / s / TFLOP/s | step MFU | step MFU (datasheet) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ph, st = r["phases"], r["step"]
        warm = "*" if r["includes_warmup"] else ""
        lines.append(
            f"| {r['label']} | {r['trainer']} | {'x'.join(map(str, r['shape']))} ({r['tokens']:,} tokens), "
            f"{r['samples']} samples, {r['setting']} | {_cell(ph['rollout'], warm)} | "
            f"{ph['decode+reward']['s']:.2f}{warm} | {_cell(ph['train'], warm)} | "
            f"{st['tflop']:.0f} / {st['s']:.2f}{warm} / {st['tflops']:.0f} | {st['mfu']:.1%} | {st['mfu_datasheet']:.1%} |"
        )
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--json", type=Path, nargs="+", default=None, help="default: docs/bench/*.json")
    ap.add_argument("--peak", type=float, default=PEAK_TFLOPS, help="TFLOP/s that MFU is taken against")
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    paths = args.json or sorted((ROOT / "docs" / "bench").glob("*.json"))
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"no such JSON: {', '.join(missing)}")
    rows = collect(paths, args.peak)
    peak_source = PEAK_SOURCE if args.peak == PEAK_TFLOPS else "given with --peak"
    result = {
        "peak_tflops": args.peak,
        "peak_source": peak_source,
        "datasheet_tflops": DATASHEET_TFLOPS,
        "datasheet_source": DATASHEET_SOURCE,
        "sources": [str(p) for p in paths],
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mfu.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "mfu.md").write_text(markdown(rows, args.peak))
    print(markdown(rows, args.peak))
    return result


if __name__ == "__main__":
    main()
