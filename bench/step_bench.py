"""End-to-end GRPO step on one GPU: ``Trainer.train`` at world 1, per-phase time, model FLOP/s, MFU.

    python bench/step_bench.py --out bench/results/step                   # jpeg, then pickscore
    python bench/step_bench.py --out runs/step --model tiny --shape 5 64 64 --num-steps 4 \\
        --rollouts 2 --budget-gib 1                                       # CPU, seconds

The Wan2.1-1.3B recipe (``configs/wan2_1_t2v_1_3b.yaml``) at 81x480x832 with random weights at the
real configs (``bench/real_configs.py``: the 1.3B transformer, UMT5-XXL, the Wan2.1 VAE;
``model.init: random``): 10 denoising steps, one prompt group of 2 samples, SDE window 2,
``activation_memory_budget_gib`` 100, UMT5-XXL resident (``text_encoder_offload`` off), 3
rollouts (the first is the warm-up: compile, cudnn plans). Rewards: ``jpeg_incompressibility``,
then ``pickscore`` with a PickScore-sized CLIP (ViT-H-14 vision tower, 1024-wide text tower,
random weights, built and saved under ``--work``, default ``OUT/work``). Each reward runs in its own process.

Phases are timed around the trainer's own methods (``bench/probes.py``): rollout, decode+reward
(``Trainer.score``), train (``Trainer.train_on``), with the peak GPU memory of each. Model FLOPs
(``bench/gpu_bench.py``'s ``model_flops``: matmuls and attention of one forward; recompute not
counted): rollout = samples x steps x CFG forwards; train = samples x SDE steps x CFG x 3 (forward
+ backward) + the KL reference's forwards. MFU = FLOPs / time / 782 TFLOP/s (bf16 dense, H200),
over each phase and over the whole step (decode and reward count as time, not FLOPs). Checkpoint
saving and export are switched off (they are the rehearsal's business). Writes ``<reward>.json``,
``<reward>.md`` and ``step_bench.md`` to ``--out``. ``--overlap-decode`` decodes each micro-batch
beside the next one's sampling (``rollout.overlap_decode``: the rollout phase then holds the hidden
decodes, and decode + reward what is left of them); ``--vae-dtype bfloat16`` decodes in bf16
(``model.vae_dtype``); ``--rollout-precision fp8`` samples the rollouts in float8
(``rollout.precision``; ``--attention-precision sage_int8`` their self-attention in INT8,
``rollout.attention_precision``; the train phase then includes the bf16 old log-probs' recompute for the
micro-batches of later optimizer steps, if any). ``--guidance``, ``--shift``, ``--text-tokens``,
``--micro-batch``, ``--lora-rank``/``--lora-alpha``/``--lora-targets`` replace the recipe's values
(``bench/peer_step.py`` sets each on both sides); ``MILES_BENCH_MEMORY_CAP_GIB`` caps the measuring
process's CUDA memory (``torch.cuda.set_per_process_memory_fraction``, as the peer's side is capped).
The JSON records every one of these settings and the trainable parameter count.

The training attention-backend sweep (issue 43): ``--attention-backend`` sets
``parallel.fsdp_attention_backend`` (one diffusers backend for rollout and training alike) and
``--checkpointing`` ``model.activation_checkpointing``; the JSON records the backend the trainer ran
(``attention_backend``: the given one, else the trainer's default for the device) and the compiled
canary's contract (``bench/canary_compile.py``): ``canary_per_rollout``, the trainer's
``train/log_prob_mean_abs_diff`` of each rollout's first optimizer step read from its
``metrics.jsonl``, and ``canary_exact`` (every one exactly 0: log-probs recomputed as rolled out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 782.0  # bf16 dense matmul, H200 (DESIGN.md)
STEP_PHASES = ("rollout", "decode+reward", "train")


def pickscore_sized_config(bos: int, eos: int):
    """The ``CLIPConfig`` of PickScore_v1 (laion CLIP-ViT-H-14): 986M parameters."""
    from transformers import CLIPConfig

    config = CLIPConfig(
        text_config=dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=24,
            num_attention_heads=16,
            vocab_size=49408,
            max_position_embeddings=77,
            hidden_act="gelu",
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=eos,
        ),
        vision_config=dict(
            hidden_size=1280,
            intermediate_size=5120,
            num_hidden_layers=32,
            num_attention_heads=16,
            image_size=224,
            patch_size=14,
            hidden_act="gelu",
        ),
        projection_dim=1024,
    )
    return config


def pickscore_sized_clip(path: Path, tiny: bool = False) -> Path:
    """A random CLIP of PickScore_v1's size (ViT-H-14: vision 1280 x 32 layers, patch 14 at 224;
    text 1024 x 24 layers; projection 1024) with a byte-level tokenizer, saved to ``path``;
    ``tiny``: ``miles.rewards.tiny_clip``'s stand-in."""
    import torch
    from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    from miles.rewards.tiny_clip import BOS, EOS, _byte_level_vocab, tiny_clip

    if tiny:
        return Path(tiny_clip(path))
    if (path / "config.json").is_file():
        return path
    vocab = _byte_level_vocab()
    tokenizer = CLIPTokenizer(
        vocab=vocab, merges=[], bos_token=BOS, eos_token=EOS, pad_token=EOS, unk_token=EOS
    )
    tokenizer.model_max_length = 77
    image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224})
    config = pickscore_sized_config(vocab[BOS], vocab[EOS])
    torch.manual_seed(0)
    model = CLIPModel(config).eval()
    model.save_pretrained(path)
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(path)
    return path


def build_config(args, reward: str, model_path: Path, clip_path: Path | None):
    from bench.memory_rehearsal import sde_window_fields, set_fields
    from miles.config import parse_args
    from miles.rewards.pickscore import PickScoreOptions

    cfg, _ = parse_args(["--config", str(ROOT / "configs" / "wan2_1_t2v_1_3b.yaml")])
    frames, height, width = args.shape
    fields = {
        "model.path": str(model_path),
        "model.init": "random",
        "model.activation_memory_budget_gib": args.budget_gib,
        "model.text_encoder_offload": False,
        "parallel.sequence_parallel_size": 1,
        "data.prompt_file": None,
        "data.prompts_per_rank": 1,
        "data.group_size": args.samples,
        "rollout.num_frames": frames,
        "rollout.height": height,
        "rollout.width": width,
        "rollout.num_steps": args.num_steps,
        **sde_window_fields(args.num_steps, args.sde_window, 0, args.num_steps // 2),
        "train.num_rollouts": args.rollouts,
        "train.checkpoint_every": 0,
        "train.resume": False,
        "train.overwrite": True,
        "train.export": False,
        "eval.prompt_file": None,
        "run.output_dir": str(args.work / "runs"),
        "run.name": reward,
        "run.wandb_mode": "disabled",
        "run.log_video_every": 0,
        "run.progress": False,
        "reward.weights": {reward if reward == "pickscore" else "jpeg_incompressibility": 1.0},
        "reward.pickscore": PickScoreOptions(model_path=str(clip_path) if clip_path else None),
        "rollout.precision": args.rollout_precision,
        "rollout.attention_precision": args.attention_precision,
        "rollout.overlap_decode": args.overlap_decode,
        "model.vae_dtype": args.vae_dtype,
        "parallel.deterministic_mode": args.deterministic_mode,
        **shared_fields(args),
        **attention_fields(args),
    }
    if args.model == "tiny":  # the tiny model's text encoder is not UMT5-XXL: shorter prompts
        fields.update({"model.dtype": "float32", "model.compile": "off"})
        fields.setdefault("data.max_sequence_length", 64)
    return set_fields(cfg, fields)


def shared_fields(args) -> dict:
    """The settings a side by side names on both sides (``bench/peer_step.py`` passes each): given
    ones replace the recipe's, absent ones (None) keep it."""
    given = {
        "rollout.guidance_scale": args.guidance,
        "rollout.shift": args.shift,
        "data.max_sequence_length": args.text_tokens,
        "train.micro_batch_size": args.micro_batch,
        "model.lora_rank": args.lora_rank,
        "model.lora_alpha": args.lora_alpha,
        "model.lora_target_modules": args.lora_targets,
    }
    return {k: v for k, v in given.items() if v is not None}


def attention_fields(args) -> dict:
    """``--attention-backend`` and ``--checkpointing`` (the training backend sweep, issue 43): given
    ones replace the recipe's (``parallel.fsdp_attention_backend``: rollout and training alike;
    ``model.activation_checkpointing``), absent ones keep it."""
    given = {
        "parallel.fsdp_attention_backend": getattr(args, "attention_backend", None),
        "model.activation_checkpointing": getattr(args, "checkpointing", None),
    }
    return {k: v for k, v in given.items() if v is not None}


def resolved_backend(cfg, device_type: str) -> str | None:
    """The attention backend the trainer runs with: the config's, else its default for the device."""
    import torch

    from miles.sequence_parallel.checks import default_attention_backend

    if cfg.parallel.fsdp_attention_backend:
        return cfg.parallel.fsdp_attention_backend
    device = torch.device(device_type)
    return default_attention_backend(device, cfg.model.dtype, cfg.parallel.deterministic_mode)


def read_canary(run_dir: Path) -> list[float]:
    """The trainer's canary per rollout (``train/log_prob_mean_abs_diff``, the first optimizer step of
    each: training's recomputed log-probs minus the rollout's, same weights), from ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    key = "train/log_prob_mean_abs_diff"
    return [float(r[key]) for r in rows if key in r]


def canary_record(values: list[float]) -> dict:
    """The compiled canary's contract (``bench/canary_compile.py``): log-probs recomputed as rolled
    out, i.e. every rollout's value exactly 0; else the largest gap, stated."""
    return {
        "canary_per_rollout": values,
        "canary_exact": bool(values) and all(v == 0.0 for v in values),
        "canary_max": max(values) if values else None,
    }


def cap_process_memory() -> float | None:
    """``MILES_BENCH_MEMORY_CAP_GIB``: cap this process's CUDA allocations there (both sides of a
    ``bench/peer_step.py --fit`` case are capped alike, before either allocates); the cap, or None."""
    cap = os.environ.get("MILES_BENCH_MEMORY_CAP_GIB")
    if not cap:
        return None
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(cap) / total))
    return float(cap)


def step_flops(cfg, transformer_config: dict, tokens: int, num_sde_steps: int) -> dict:
    """Model FLOPs of one GRPO step on this rank: rollout and train (see the module docstring)."""
    from bench.gpu_bench import model_flops

    forward = model_flops(transformer_config, tokens, text_tokens=cfg.data.max_sequence_length)
    samples = cfg.data.prompts_per_rank * cfg.data.group_size
    cfg_factor = 2 if cfg.rollout.guidance_scale > 1 else 1
    train_cfg = cfg_factor if cfg.grpo.train_cfg else 1
    reference = samples * num_sde_steps * train_cfg * forward if cfg.grpo.kl_beta > 0 else 0.0
    return {
        "forward_per_sample": forward,
        "rollout": samples * cfg.rollout.num_steps * cfg_factor * forward,
        "train": samples * num_sde_steps * train_cfg * 3 * forward + reference,
    }


def per_rollout(phases: list[dict]) -> list[dict]:
    """The probes' rows grouped into rollouts (each rollout: rollout, decode+reward, train)."""
    rollouts, current = [], {}
    for p in phases:
        if p["phase"] not in STEP_PHASES:
            continue
        if p["phase"] == "rollout" and current:
            rollouts.append(current)
            current = {}
        current[p["phase"]] = p
    if current:
        rollouts.append(current)
    return rollouts


def summarize(rollouts: list[dict], flops: dict, budget_gib: float, peak_tflops: float = PEAK_TFLOPS) -> dict:
    """Mean time per phase over the measured rollouts (all but the first when there are several),
    TFLOP/s and MFU per phase and for the whole step, peak GPU memory against the budget."""
    measured = rollouts[1:] if len(rollouts) > 1 else rollouts
    mean = {ph: sum(r[ph]["wall_s"] for r in measured) / len(measured) for ph in STEP_PHASES}
    total = sum(mean.values())
    step_flops_ = flops["rollout"] + flops["train"]
    rows = {}
    for ph in STEP_PHASES:
        f = flops.get(ph, 0.0)
        tflops = f / mean[ph] / 1e12 if mean[ph] > 0 else 0.0
        rows[ph] = {
            "wall_s": mean[ph],
            "model_tflop": f / 1e12,
            "tflops": tflops,
            "mfu": tflops / peak_tflops,
        }
    whole_tflops = step_flops_ / total / 1e12 if total > 0 else 0.0
    peaks = [p.get("gpu_peak_allocated_gib") for r in rollouts for p in r.values()]
    peak = max(peaks) if peaks and None not in peaks else None
    return {
        "measured_rollouts": len(measured),
        "phases": rows,
        "step": {
            "wall_s": total,
            "model_tflop": step_flops_ / 1e12,
            "tflops": whole_tflops,
            "mfu": whole_tflops / peak_tflops,
        },
        "peak_gib": peak,
        "budget_gib": budget_gib,
        "peak_within_budget": None if peak is None else peak <= budget_gib,
    }


def _keep_phases_after_each_step(trainer_cls, probes, path: Path) -> None:
    """Write the phases measured so far after every train phase, so a run stopped by a time limit
    (a device command's) keeps its measured rollouts (``<reward>.partial.json``)."""
    timed = trainer_cls.train_on

    def train_on(self, *args, **kwargs):
        out = timed(self, *args, **kwargs)
        path.write_text(json.dumps({"phases": probes.phases}, indent=1, default=float))
        return out

    trainer_cls.train_on = train_on


def run_one(args, reward: str, around=None) -> dict:
    """One reward's step in this process; ``around(Trainer)``, if given, wraps the trainer's phase
    methods further (around the probes)."""
    import torch

    import miles.train.trainer as trainer_mod
    from bench.probes import Probes
    from bench.real_configs import model_spec, write_config_folder

    model_path = write_config_folder(args.model, args.out / "models" / args.model)
    clip = (
        pickscore_sized_clip(args.out / "models" / "pickscore", tiny=args.model == "tiny")
        if reward == "pickscore"
        else None
    )
    cfg = build_config(args, reward, model_path, clip)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    probes = Probes(device)
    Trainer = trainer_mod.Trainer
    probes.wrap(Trainer, "rollout", "rollout")
    probes.wrap(Trainer, "score", "decode+reward")
    probes.wrap(Trainer, "train_on", "train")
    _keep_phases_after_each_step(Trainer, probes, args.out / f"{reward}.partial.json")
    Trainer.save = lambda self: None  # the step is measured, not the checkpoint
    with probes.phase("init"):
        trainer = Trainer(cfg)
    if around is not None:  # bench/profile_step.py's profiler ranges, inside the probes
        around(Trainer)
    trainer.train()
    trainable = sum(p.numel() for p in trainer.experts.parameters() if p.requires_grad)
    trainer.close()
    tokens = trainer.num_tokens
    from miles.rollout.sampler import sde_step_indices

    r = cfg.rollout
    num_sde = len(
        sde_step_indices(
            r.num_steps,
            sde_window_size=r.sde_window_size or None,
            sde_window_start_range=tuple(r.sde_window_range) if r.sde_window_size else None,
            timestep_fraction=r.timestep_fraction,
            generator=torch.Generator().manual_seed(0),
        )
    )
    flops = step_flops(cfg, model_spec(args.model)["transformer"], tokens, num_sde)
    return {
        "reward": reward,
        "model": args.model,
        "shape": args.shape,
        "tokens": tokens,
        "samples": cfg.data.prompts_per_rank * cfg.data.group_size,
        "num_steps": r.num_steps,
        "num_sde_steps": num_sde,
        "rollout_precision": cfg.rollout.precision,
        "attention_precision": cfg.rollout.attention_precision,
        "overlap_decode": cfg.rollout.overlap_decode,
        "guidance": cfg.rollout.guidance_scale,
        "shift": cfg.rollout.shift,
        "text_tokens": cfg.data.max_sequence_length,
        "micro_batch": cfg.train.micro_batch_size,
        "lora_rank": cfg.model.lora_rank,
        "lora_alpha": cfg.model.lora_alpha,
        "lora_targets": list(cfg.model.lora_target_modules),
        "trainable_params": trainable,
        "memory_cap_gib": args.memory_cap_gib,
        "vae_dtype": cfg.model.vae_dtype,
        "deterministic_mode": cfg.parallel.deterministic_mode,
        "attention_backend": resolved_backend(cfg, device.type),
        "attention_backend_requested": cfg.parallel.fsdp_attention_backend,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        **canary_record(read_canary(Path(cfg.run.output_dir) / cfg.run.name)),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "flops": flops,
        "phases": probes.phases,
        "summary": summarize(per_rollout(probes.phases), flops, args.budget_gib),
    }


def _canary_text(r: dict) -> str:
    if not r.get("canary_per_rollout"):
        return "not logged"
    return "0 (log-probs recomputed as rolled out)" if r["canary_exact"] else f"max {r['canary_max']:.2e}"


def markdown(results: list[dict]) -> str:
    lines = [
        "| reward | rollout s (TFLOP/s) | decode + reward s | train s (TFLOP/s) | step s | step TFLOP/s | MFU | peak GiB / budget |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        s = r["summary"]
        ph = s["phases"]
        peak = "—" if s["peak_gib"] is None else f"{s['peak_gib']:.1f} / {s['budget_gib']:g}"
        lines.append(
            f"| {r['reward']} | {ph['rollout']['wall_s']:.1f} ({ph['rollout']['tflops']:.0f}) | "
            f"{ph['decode+reward']['wall_s']:.1f} | {ph['train']['wall_s']:.1f} ({ph['train']['tflops']:.0f}) | "
            f"{s['step']['wall_s']:.1f} | {s['step']['tflops']:.0f} | {s['step']['mfu']:.0%} | {peak} |"
        )
    first = results[0]
    head = (
        f"{first['model']}, {'x'.join(map(str, first['shape']))} ({first['tokens']} tokens), {first['samples']} samples, "
        f"{first['num_steps']} steps, {first['num_sde_steps']} SDE steps, "
        f"{first.get('rollout_precision', 'bf16')} rollouts"
        f"{' with ' + first['attention_precision'] + ' self-attention' if first.get('attention_precision', 'bf16') != 'bf16' else ''}"
        f", VAE {first.get('vae_dtype', 'float32')}"
        f"{', decode overlapped' if first.get('overlap_decode') else ''}"
        f"{', deterministic mode' if first.get('deterministic_mode') else ''}, "
        f"attention {first.get('attention_backend') or 'default'}, checkpointing "
        f"{first.get('activation_checkpointing', 'budget')}, canary {_canary_text(first)}, on {first['device']} "
        f"(mean of the rollouts after the first)"
    )
    return head + "\n\n" + "\n".join(lines) + "\n"


def add_shared_args(ap: argparse.ArgumentParser) -> None:
    """The settings ``bench/peer_step.py`` sets on both sides; unset: the recipe's."""
    ap.add_argument("--guidance", type=float, default=None, help="rollout.guidance_scale")
    ap.add_argument("--shift", type=float, default=None, help="rollout.shift")
    ap.add_argument("--text-tokens", type=int, default=None, help="data.max_sequence_length")
    ap.add_argument("--micro-batch", type=int, default=None, help="train.micro_batch_size")
    ap.add_argument("--lora-rank", type=int, default=None, help="model.lora_rank (0: every weight trained)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="model.lora_alpha")
    ap.add_argument("--lora-targets", nargs="+", default=None, help="model.lora_target_modules")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=None, help="model folders and run dirs (default: OUT/work)")
    ap.add_argument("--model", default="wan2.1-t2v-1.3b", help="a bench/real_configs.py model (or tiny)")
    ap.add_argument("--shape", type=int, nargs=3, default=[81, 480, 832], metavar=("FRAMES", "H", "W"))
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--sde-window", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=100.0)
    ap.add_argument(
        "--rollout-precision",
        choices=["bf16", "fp8"],
        default="bf16",
        help="rollout.precision (fp8: CUDA sm >= 89 and torchao; docs/fp8_rollout.md)",
    )
    ap.add_argument(
        "--attention-precision",
        choices=["bf16", "sage_int8"],
        default="bf16",
        help="rollout.attention_precision (sage_int8: CUDA, pip install -e '.[attn-lowp]'; docs/fp8_rollout.md)",
    )
    ap.add_argument(
        "--overlap-decode",
        action="store_true",
        help="rollout.overlap_decode: decode beside the next micro-batch",
    )
    ap.add_argument("--deterministic-mode", action="store_true", help="parallel.deterministic_mode")
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="parallel.fsdp_attention_backend (a diffusers backend: _native_cudnn, _native_flash, "
        "_native_efficient, xformers, flash, _flash_3...; rollout and training alike; unset: the trainer's default)",
    )
    ap.add_argument(
        "--checkpointing",
        choices=["none", "selective", "attention", "full", "budget"],
        default=None,
        help="model.activation_checkpointing (unset: the recipe's, budget)",
    )
    ap.add_argument("--vae-dtype", choices=["float32", "bfloat16"], default="float32", help="model.vae_dtype")
    ap.add_argument("--rewards", nargs="+", default=["jpeg", "pickscore"], choices=["jpeg", "pickscore"])
    ap.add_argument("--reward", choices=["jpeg", "pickscore"], help=argparse.SUPPRESS)  # one, in this process
    add_shared_args(ap)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    # As the trainer sets it, but before CUDA starts: the probes touch CUDA before Trainer() does
    # (without it the 1.3B step reserved 101.6 GiB for 93.5 allocated).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args.memory_cap_gib = cap_process_memory() if args.reward else None  # the measuring child only
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or args.out / "work"
    if args.reward:
        result = run_one(args, args.reward)
        (args.out / f"{args.reward}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{args.reward}.md").write_text(markdown([result]))
        return
    results = []
    for reward in args.rewards:
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--reward", reward]
        print(f"[step-bench] {reward}", flush=True)
        rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if rc == 0:
            results.append(json.loads((args.out / f"{reward}.json").read_text()))
        else:
            print(f"[step-bench] {reward} failed with exit status {rc}", flush=True)
    if results:
        text = markdown(results)
        (args.out / "step_bench.md").write_text(text)
        print(text)
    if len(results) != len(args.rewards):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
