"""The 81-frame world's GPU plan (issue 42): each stage's estimated H200 seconds and the sessions
(30 device-minutes each, commands of <= 570 s) that run them, headline first.

    python bench/world81_plan.py                     # what `bash bench/world81_gpu.sh plan` prints
    python bench/world81_plan.py --prior-blocks 1    # the 1-block prior (make world-model-81's --prior-blocks)
    python bench/world81_plan.py --json OUT.json     # the same as JSON
    python bench/world81_plan.py --count             # recount the world VAE's FLOPs (meta tensors, ~1 CPU-min)
    python bench/world81_plan.py --carry WORK DEST   # copy what resumes the stages (world81_gpu.sh does)

Every number is an **estimate**, not a measurement: FLOPs counted from the code (the prior's
forward by ``miles.pretrain_world_81.forward_flops``, within 0.3% of ``torch.utils.flop_counter``;
the world VAE's encode and decode counted by ``torch.utils.flop_counter`` on meta tensors; the
forwards a recipe runs by ``bench/world81_recipes._forwards``) at the H200 rates measured for
Wan2.1-1.3B and its VAE at 81 x 480 x 832 (``miles.pretrain_world_81.RATES``), plus the assumed
costs below (``START_S``, ``VAE_STEP_FLOOR_S``, ``RENDER_S``, ``SESSION_OVERHEAD_S``), which no
run has measured. Curves side by side share the GPU: their seconds add (no gain assumed from
overlap). A GPU session that runs the plan writes the measured times beside these.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

COMMAND_S = 570
"""Seconds a stage's command may run (the device tool's 600 s limit per command, less a margin)."""
SESSION_S = 1800
"""Device seconds a GPU session has."""
SESSION_OVERHEAD_S = 180
"""Assumed: the machine's start, the transfers and the idle gaps between commands of one session."""
START_S = 60
"""Assumed: a launch's imports, model load and compile (BENCHMARKS.md: the 1.3B model's first,
compiling steps took 28-77 s longer than the later ones)."""
VAE_STEP_FLOOR_S = 0.05
"""Assumed: the least a VAE training step on small crops takes (kernel launches, not FLOPs)."""
RENDER_S = 0.005
"""Assumed: one 81 x 480 x 832 render on the GPU."""
VAE16_ENCODE_FLOPS = 2_505_859_399_680
"""FLOPs of one encode of ``VAE_16`` at 81 x 480 x 832 (``--count``)."""
PEER_FP32_TFLOPS = 40.0
"""Assumed: flow_grpo's LoRA path runs fp32 (no autocast); fp32 attention has no tensor-core kernel."""


def count_vae_flops() -> dict:
    """``VAE_16``'s encode and decode FLOPs at 81 x 480 x 832, by ``torch.utils.flop_counter`` on meta."""
    import torch
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from miles.pretrain_world_81 import VAE_16

    with torch.device("meta"):
        vae = AutoencoderKLWan(**VAE_16)
        x, z = torch.empty(1, 3, 81, 480, 832), torch.empty(1, 16, 21, 60, 104)
        with FlopCounterMode(display=False) as enc:
            vae.encode(x)
        with FlopCounterMode(display=False) as dec:
            vae.decode(z)
    return {"encode_flops": enc.get_total_flops(), "decode_flops": dec.get_total_flops()}


def pretrain_parts(blocks: int) -> dict:
    """``make world-model-81``'s seconds by part (``Pretrain81Config``'s defaults at ``blocks``)."""
    from world81_recipes import VAE16_DECODE_FLOPS

    from miles.pretrain_world_81 import PRIOR, RATES, Pretrain81Config, estimate

    cfg = Pretrain81Config(prior=dict(PRIOR, num_layers=blocks))
    est = estimate(cfg)
    f, h, w = cfg.shape
    per_voxel = (VAE16_ENCODE_FLOPS + VAE16_DECODE_FLOPS) / (f * h * w)
    rate = RATES["vae_fp32"] * 1e12
    vae_s = 0.0
    for steps, frames in zip((cfg.vae_short_steps, cfg.vae_long_steps), cfg.vae_clip_frames):
        flops = 3 * per_voxel * cfg.vae_batch * frames * cfg.crop**2
        vae_s += steps * (max(flops / rate, VAE_STEP_FLOOR_S) + cfg.vae_batch * RENDER_S)
    videos = 24 * cfg.videos_per_prompt
    return {
        "start_s": START_S,
        "vae_s": round(vae_s),
        "encode_s": round(videos * (VAE16_ENCODE_FLOPS / rate + RENDER_S)),
        "prior_s": est["prior_train_s"],
        "eval_s": round(est["eval_transformer_s"] + est["eval_samples"] * VAE16_DECODE_FLOPS / rate),
    }


def pretrain_state_mb(blocks: int) -> dict:
    """The largest paused pretraining state (MB): the VAE with its AdamW moments while it trains;
    the trained VAE plus the prior and its moments while the prior trains."""
    import torch
    from diffusers import AutoencoderKLWan

    from miles.pretrain_world_81 import PRIOR, VAE_16, prior_megabytes

    with torch.device("meta"):
        vae = sum(p.numel() for p in AutoencoderKLWan(**VAE_16).parameters())
    prior = prior_megabytes(dict(PRIOR, num_layers=blocks)) * 1e6 / 4
    return {
        "vae_params": vae,
        "prior_params": round(prior),
        "max_mb": round(max(12 * vae, 4 * vae + 12 * prior) / 1e6, 1),
    }


def curve_seconds(recipe: str, blocks: int, eval_every: int) -> dict:
    """One 300-step curve of a shipped recipe on the 81-frame world, alone (``world81_recipes.estimate``)."""
    import world81_recipes as w81

    with tempfile.TemporaryDirectory() as tmp:
        path = w81.write_recipes(Path(tmp), [recipe], eval_every=eval_every)[recipe]
        return w81.estimate(path, blocks)


def peer_seconds(blocks: int) -> int:
    """flow_grpo's own Wan recipe (``bench/peer_learning.py --recipe own``) for 150 rollouts of 2 x 8
    samples: 20 steps with CFG, 19 trained steps through CFG, the KL reference through CFG, fp32."""
    from miles.pretrain_world_81 import PRIOR, forward_flops
    from miles.world.world import SHAPE_81

    shape = (SHAPE_81.num_frames, SHAPE_81.height, SHAPE_81.width)
    forwards = 20 * 2 + 19 * (3 * 2 + 2)
    flops = 150 * 16 * forwards * forward_flops(shape, dict(PRIOR, num_layers=blocks))
    return round(flops / (PEER_FP32_TFLOPS * 1e12))


def _stage(name: str, work_s: float, what: str, start_s: float = START_S) -> dict:
    """A stage of ``work_s`` seconds of GPU work split into commands of ``COMMAND_S``, each paying
    ``start_s`` once (its runs start side by side)."""
    commands = max(1, math.ceil(work_s / (COMMAND_S - start_s)))
    return {
        "stage": name,
        "what": what,
        "work_s": round(work_s),
        "commands": commands,
        "device_s": round(work_s + commands * start_s),
    }


def pack(stages: list[dict], first: int = 0) -> list[dict]:
    """Commands in stage order into sessions of ``SESSION_S`` (each paying ``SESSION_OVERHEAD_S``);
    a new session starts at stage index ``first`` of a new group (the headline's end) or when full.
    A stage whose commands land in two sessions carries its state across machines (noted)."""
    sessions: list[dict] = []
    for i, stage in enumerate(stages):
        per_command = stage["device_s"] / stage["commands"]
        for _ in range(stage["commands"]):
            full = sessions and sessions[-1]["device_s"] + per_command > SESSION_S
            if not sessions or full or (i == first and stage["stage"] not in sessions[-1]["stages"]):
                sessions.append({"stages": [], "device_s": SESSION_OVERHEAD_S})
            if stage["stage"] not in sessions[-1]["stages"]:
                sessions[-1]["stages"].append(stage["stage"])
            sessions[-1]["device_s"] += per_command
    for s in sessions:
        s["device_s"] = round(s["device_s"])
    return sessions


def plan(blocks: int = 2, eval_every: int = 15) -> dict:
    """Every stage's estimate and the sessions: the headline first (the prior, then the best recipe
    at three seeds and its twin, then the report), then the rest in order in later sessions."""
    from world81_recipes import RECIPES, VAE16_DECODE_FLOPS

    from miles.pretrain_world_81 import RATES

    parts = pretrain_parts(blocks)
    nft = curve_seconds("nft", blocks, eval_every)
    headline = [
        _stage("pretrain", sum(parts.values()) - START_S, "make world-model-81 (resumes: --max-minutes)"),
        _stage(
            "curves", 4 * nft["curve_s_alone"], "nft at seeds 0 1 2 + its negated twin at 0, side by side"
        ),
        _stage("report", 0, "world81.{json,md,png} from the runs (CPU work)", start_s=10),
    ]
    vae_check = 8 * (VAE16_ENCODE_FLOPS + VAE16_DECODE_FLOPS) / (RATES["vae_fp32"] * 1e12)
    rest = [_stage("vae", vae_check, "the trained VAE's reconstructions scored against the renders")]
    for name in RECIPES:
        if name != "nft":
            est = curve_seconds(name, blocks, eval_every)
            rest.append(_stage(f"recipes:{name}", 2 * est["curve_s_alone"], f"{name} + its twin, seed 0"))
    rest.append(_stage("peer", peer_seconds(blocks), "flow_grpo's own recipe, seed 0 (fp32 path)"))
    sessions = pack(headline + rest, first=len(headline))
    spans = [st["stage"] for st in headline + rest if sum(st["stage"] in s["stages"] for s in sessions) > 1]
    return {
        "prior_blocks": blocks,
        "eval_every": eval_every,
        "pretrain_parts_s": parts,
        "pretrain_state": pretrain_state_mb(blocks),
        "nft_curve": nft,
        "stages": headline + rest,
        "sessions": sessions,
        "stages_spanning_sessions": spans,
        "headline_fits_one_session": {"pretrain", "curves", "report"} <= set(sessions[0]["stages"])
        and "curves" not in spans,
        "assumed": {
            "START_S": START_S,
            "VAE_STEP_FLOOR_S": VAE_STEP_FLOOR_S,
            "RENDER_S": RENDER_S,
            "SESSION_OVERHEAD_S": SESSION_OVERHEAD_S,
            "PEER_FP32_TFLOPS": PEER_FP32_TFLOPS,
        },
    }


CARRY_SKIP_BYTES = 2 * 2**20
"""``carry`` leaves out files above this (videos, exports) outside the newest checkpoint."""


def carry(work: Path, dest: Path) -> dict:
    """Copy of ``work`` with what resumes every stage on another machine: the prior's folder, a
    paused pretraining's state, each run's newest complete checkpoint and its logs; older
    checkpoints and files over ``CARRY_SKIP_BYTES`` elsewhere (videos, exports) are left out. Meant
    to come back in the device's OUT and travel again as ``carry`` (64 MiB)."""
    import shutil

    from miles.train.checkpoint import checkpoint_dir, latest_checkpoint

    work, dest = Path(work), Path(dest)
    keep_ckpt = {}
    for run_dir in {c.parent.parent for c in work.glob("**/checkpoints/step_*")}:
        keep_ckpt[checkpoint_dir(run_dir)] = latest_checkpoint(run_dir)
    copied, skipped = 0, []
    for path in sorted(p for p in work.rglob("*") if p.is_file()):
        ckpts = next((c for c in keep_ckpt if c in path.parents), None)
        if ckpts is not None:
            if keep_ckpt[ckpts] is None or keep_ckpt[ckpts] not in path.parents:
                continue  # an older or incomplete checkpoint
        elif path.stat().st_size > CARRY_SKIP_BYTES and "pipeline_81" not in path.parts:
            skipped.append(str(path.relative_to(work)))
            continue
        target = dest / path.relative_to(work)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        copied += path.stat().st_size
    return {"bytes": copied, "mib": round(copied / 2**20, 1), "skipped": skipped}


def show(p: dict) -> str:
    lines = [
        f"81-frame world, prior of {p['prior_blocks']} block(s), eval every {p['eval_every']} rollouts "
        f"(estimates, not measurements; bench/world81_plan.py)",
        f"pretraining parts (s): {p['pretrain_parts_s']}",
        "one nft curve alone (s): "
        + ", ".join(f"{k} {v}" for k, v in p["nft_curve"].items() if k.endswith("_s") or k.endswith("alone")),
        "",
        f"{'stage':24s} {'device s':>8s} {'commands':>8s}  what",
    ]
    for s in p["stages"]:
        lines.append(f"{s['stage']:24s} {s['device_s']:8d} {s['commands']:8d}  {s['what']}")
    lines.append("")
    for i, s in enumerate(p["sessions"], 1):
        lines.append(
            f"session {i}: {' -> '.join(s['stages'])}  ({s['device_s']} s with {SESSION_OVERHEAD_S} s overhead)"
        )
    if p["stages_spanning_sessions"]:
        lines.append(
            f"spanning sessions (state carried between machines): {', '.join(p['stages_spanning_sessions'])}"
        )
    lines.append(f"headline (prior, nft x 3 seeds + twin) in one session: {p['headline_fits_one_session']}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prior-blocks", type=int, choices=(1, 2), default=2)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--count", action="store_true", help="recount the world VAE's FLOPs and print them")
    ap.add_argument("--carry", nargs=2, type=Path, metavar=("WORK", "DEST"), help="copy the resumable state")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.carry:
        done = carry(*args.carry)
        print(f"carried {done['mib']} MiB into {args.carry[1]} (limit 64 MiB); left out: {done['skipped']}")
        return 0
    if args.count:
        print(json.dumps(count_vae_flops(), indent=1))
        return 0
    p = plan(args.prior_blocks, args.eval_every)
    if args.json:
        args.json.write_text(json.dumps(p, indent=1) + "\n")
    print(show(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
