"""Memory rehearsal: one rank of a world-N job on one GPU, through the trainer's own path.

    python bench/memory_rehearsal.py --out bench/results/rehearsal                 # every GPU case
    python bench/memory_rehearsal.py --out runs/rehearsal --cases tiny             # CPU, seconds
    python bench/memory_rehearsal.py --out bench/results/sp --sp-timing            # bench/sp_timing.py

Each case runs in its own process as rank 0 of a fake process group of the case's world size
(``bench/fake_rank.py``: collectives move nothing; tensors, shapes and allocations are real),
with random weights at the real configs (``bench/real_configs.py`` writes config-only folders;
``model.init: random``). ``miles.train.trainer.Trainer`` runs unchanged — load, shard, one rollout
(one prompt group of 2 samples, one micro-batch each), decode, reward, one optimizer step, and
again (AdamW allocates its moments after the first step's peak: only the second rollout and step
see the steady state of a long run), checkpoint, export — with probes around its phases
(``bench/probes.py``): wall time, peak GPU memory (``max_memory_allocated`` /
``max_memory_reserved``) and host RSS. Beside each phase: the dry run's estimate
(``miles/train/dry_run.py``) for the same config and world, and the ratio.

Rank 0 is the rank rehearsed: it does everything the others do, plus the export's gather and
writing. Cases (the recipes' shapes; ``--num-steps`` shortens the rollout, which changes time,
not memory):

- ``a14b-lora``: Wan2.2-T2V-A14B LoRA 64, 81x480x832, world 8 = sp 8, budget 76 GiB (80 GB cards);
- ``wan21-14b-full``: Wan2.1-T2V-14B full fine-tune with KL (a reference copy), world 16 = dp 2 x sp 8;
- ``ti2v-5b``: Wan2.2-TI2V-5B full fine-tune, 81x704x1280, world 8 = dp 2 x sp 4;
- ``ltx-2b``: LTX-Video 2B full fine-tune (the second model family), 161x512x704 (7,392 tokens),
  world 8 = dp 2 x sp 4, budget 60 GiB (``configs/ltx_video_2b.yaml``);
- ``tiny``: the tiny two-expert model with KL, world 4 = dp 2 x sp 2, on CPU in seconds (tests).

Writes ``<case>.json`` and ``<case>.md`` per case and ``rehearsal.md`` (all cases) to ``--out``;
the config-only model folders and the run directories (checkpoint, export) go to ``--work``
(default ``OUT/work``). ``--no-export`` skips the export phase; ``--export-to-null`` runs it whole
(every gather, cast and host copy, the files opened and written) but sends the transformers'
safetensors bytes to ``/dev/null`` — an A14B export is 57 GB, near a 64 GiB device disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # bench/real_configs.py name
    recipe: str  # configs/*.yaml the run starts from
    world: int
    sp: int
    fields: dict = dataclasses.field(default_factory=dict)  # dotted config fields set on top


CASES = {
    "a14b-lora": Case(
        "wan2.2-t2v-a14b",
        "configs/wan2_2_a14b.yaml",
        world=8,
        sp=8,
        fields={"model.activation_memory_budget_gib": 76.0},
    ),
    "wan21-14b-full": Case(
        "wan2.1-t2v-14b",
        "configs/wan2_1_t2v_1_3b.yaml",
        world=16,
        sp=8,
        fields={"model.lora_rank": 0, "grpo.kl_beta": 0.004, "model.activation_memory_budget_gib": 76.0},
    ),
    "ti2v-5b": Case("wan2.2-ti2v-5b", "configs/wan2_2_ti2v_5b.yaml", world=8, sp=4),
    # the second model family: LTX-Video 2B (T5-XXL), 161x512x704, world 8 = dp 2 x sp 4, budget 60 GiB
    "ltx-2b": Case("ltx-video-2b", "configs/ltx_video_2b.yaml", world=8, sp=4),
    "tiny": Case("tiny", "configs/tiny_cpu.yaml", world=4, sp=2, fields={"grpo.kl_beta": 0.01}),
}
GPU_CASES = ("a14b-lora", "wan21-14b-full", "ti2v-5b")


def set_fields(cfg, fields: dict):
    """``cfg`` with dotted fields (``"model.path"``) replaced; the config validates itself again."""
    sections: dict[str, dict] = {}
    for key, value in fields.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(
        cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()}
    )


def sde_window_fields(num_steps: int, size: int, lo: int, hi: int) -> dict:
    """An SDE window of at most ``size`` steps and a start range [lo, hi) clipped to ``num_steps``
    (the sampler's rule: hi - 1 + size <= num_steps - 1)."""
    size = min(size, num_steps - 1)
    hi = max(1, min(hi, num_steps - size))
    return {"rollout.sde_window_size": size, "rollout.sde_window_range": [min(lo, hi - 1), hi]}


def build_config(
    case: Case, model_path: Path, work: Path, name: str, num_steps: int | None = None, export: bool = True
):
    """The recipe with the rehearsal's settings: config-only model with random weights, one rollout of
    one prompt group (2 samples, micro-batch 1) and one optimizer step, twice (the second rollout
    and step hold AdamW's moments, which the first step allocates after its peak), checkpoint and
    export; no eval, no videos, no wandb; the jpeg reward (no reward weights to load)."""
    from miles.config import parse_args
    from miles.rewards.pickscore import PickScoreOptions

    cfg, _ = parse_args(["--config", str(ROOT / case.recipe)])
    fields = {
        "model.path": str(model_path),
        "model.init": "random",
        "parallel.sequence_parallel_size": case.sp,
        "data.prompt_file": None,
        "data.prompts_per_rank": 1,
        "data.group_size": 2,
        "train.micro_batch_size": 1,
        "train.num_rollouts": 2,  # the steady state: the second rollout and step have the moments
        "train.steps_per_rollout": 1,
        "train.checkpoint_every": 0,
        "train.resume": False,
        "train.overwrite": True,
        "train.export": export,
        "eval.prompt_file": None,
        "run.output_dir": str(work / "runs"),
        "run.name": name,
        "run.wandb_mode": "disabled",
        "run.log_video_every": 0,
        "run.progress": False,
        "reward.weights": {"jpeg_incompressibility": 1.0},
        "reward.pickscore": PickScoreOptions(),  # the recipe's PickScore folders: not read
        **case.fields,
    }
    if num_steps is not None:
        fields["rollout.num_steps"] = num_steps
        if cfg.rollout.sde_window_size:
            fields.update(
                sde_window_fields(num_steps, cfg.rollout.sde_window_size, *cfg.rollout.sde_window_range)
            )
    return set_fields(cfg, fields)


PHASES = ("load", "shard", "init", "rollout", "decode+reward", "train", "checkpoint", "export")
# The dry run's estimate each measured phase is held against (GiB per rank).
# The dry run's rollout peak covers sampling and the VAE decode (max of the two): both phases.
ESTIMATE_OF = {
    "rollout + decode": (("rollout", "decode+reward"), "rollout_peak"),
    "train": (("train",), "train_peak"),
}


def compare(phases: list[dict], memory_gib: dict) -> list[dict]:
    """Measured peak allocated GPU memory of the rollout with its decode, the train step and the
    whole run against the dry run's ``rollout_peak``, ``train_peak`` and their max (each the
    largest over the phase's calls); ratio = measured / estimate."""
    rows = []
    whole = max([p.get("gpu_peak_allocated_gib") or 0.0 for p in phases], default=0.0)
    for phase, (names, key) in [*ESTIMATE_OF.items(), ("whole run", ((), None))]:
        if key is None:
            measured = whole if any("gpu_peak_allocated_gib" in p for p in phases) else None
            estimate = max(memory_gib["rollout_peak"], memory_gib["train_peak"])
        else:
            values = [
                p["gpu_peak_allocated_gib"]
                for p in phases
                if p["phase"] in names and "gpu_peak_allocated_gib" in p
            ]
            measured = max(values) if values else None
            estimate = memory_gib[key]
        ratio = measured / estimate if measured is not None and estimate > 0 else None
        rows.append({"phase": phase, "measured_gib": measured, "estimate_gib": estimate, "ratio": ratio})
    return rows


def _install_probes(probes) -> None:
    import miles.train.trainer as trainer_mod
    from miles.models.family import FAMILIES

    Trainer = trainer_mod.Trainer
    for family in FAMILIES.values():  # the trainer loads through plan.family.load
        probes.wrap(type(family), "load", "load")
    probes.wrap(trainer_mod, "parallelize", "shard")
    probes.wrap(Trainer, "rollout", "rollout")
    probes.wrap(Trainer, "score", "decode+reward")
    probes.wrap(Trainer, "train_on", "train")
    probes.wrap(Trainer, "save", "checkpoint")
    probes.wrap(trainer_mod, "export_pipeline", "export", missing_ok=True)


def _export_to_null() -> None:
    """The export writes each transformer's safetensors bytes to /dev/null (headers and tensors
    produced and written as ever; the index, adapters and links still go to the run directory)."""
    import miles.train.export as export_mod

    write = export_mod.write_safetensors

    def to_null(path, entries, tensors, on_error=None):
        return write(Path(os.devnull), entries, tensors, on_error)

    export_mod.write_safetensors = to_null


def run_case(
    name: str, work: Path, num_steps: int | None = None, export: bool = True, export_to_null: bool = False
) -> dict:
    """Rehearse one case in this process (which must not have torch.distributed initialised)."""
    import torch

    from bench.fake_rank import fake_collective_fixes, init_fake_world, tolerate_nonfinite
    from bench.probes import Probes
    from bench.real_configs import write_config_folder
    from miles.train.dry_run import dry_run

    case = CASES[name]
    folder = write_config_folder(case.model, work / "models" / case.model)
    cfg = build_config(case, folder, work, name, num_steps, export)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    estimate = dry_run(
        cfg,
        world_size=case.world,
        local_world_size=min(case.world, 8),
        device_type=device.type,
        verbose=False,
    )
    init_fake_world(case.world)
    import miles.train.trainer as trainer_mod

    probes = Probes(device)
    _install_probes(probes)
    if export_to_null:
        _export_to_null()
    with fake_collective_fixes(), tolerate_nonfinite(trainer_mod.Trainer):
        with probes.phase("init"):
            trainer = trainer_mod.Trainer(cfg)
        trainer.train()
        trainer.close()
    result = {
        "case": name,
        "model": case.model,
        "world_size": case.world,
        "dp": case.world // case.sp,
        "sp": case.sp,
        "ulysses": trainer.dims.ulysses,
        "ring": trainer.dims.ring,
        "rehearsed_rank": 0,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": [cfg.rollout.num_frames, cfg.rollout.height, cfg.rollout.width],
        "tokens_per_sample": trainer.num_tokens,
        "optimizer_steps": trainer.step,
        "rollouts": trainer.rollout_index,
        "lora_rank": cfg.model.lora_rank,
        "kl_beta": cfg.grpo.kl_beta,
        "activation_memory_budget_gib": cfg.model.activation_memory_budget_gib,
        "export_to_null": export_to_null,
        "phases": probes.phases,
        "dry_run_memory_gib": estimate["memory_gib"],
        "comparison": compare(probes.phases, estimate["memory_gib"]),
    }
    return result


def _fmt(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def case_markdown(r: dict) -> str:
    lines = [
        f"### {r['case']}: {r['model']}, world {r['world_size']} = dp {r['dp']} x sp {r['sp']} "
        f"(ulysses {r['ulysses']} x ring {r['ring']}), {'x'.join(map(str, r['shape']))}, "
        f"{r['tokens_per_sample']} tokens, {'LoRA ' + str(r['lora_rank']) if r['lora_rank'] else 'full'}"
        f"{', KL' if r['kl_beta'] else ''} — rank 0 on {r['device']}",
        "",
        "| phase | wall s | GPU peak alloc GiB | GPU peak reserved GiB | GPU alloc after GiB | host RSS GiB | host RSS peak GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    order = {p: i for i, p in enumerate(PHASES)}
    calls: dict[str, int] = {}
    for p in sorted(r["phases"], key=lambda p: order.get(p["phase"], 99)):
        calls[p["phase"]] = calls.get(p["phase"], 0) + 1
        name = p["phase"] + (f" ({calls[p['phase']]})" if calls[p["phase"]] > 1 else "")
        lines.append(
            f"| {name} | {p['wall_s']:.1f} | {_fmt(p.get('gpu_peak_allocated_gib'))} | "
            f"{_fmt(p.get('gpu_peak_reserved_gib'))} | {_fmt(p.get('gpu_allocated_end_gib'))} | "
            f"{p['host_rss_gib']:.1f} | {p['host_rss_peak_gib']:.1f} |"
        )
    lines += [
        "",
        "| vs dry run | measured GiB | estimate GiB | measured / estimate |",
        "| --- | ---: | ---: | ---: |",
    ]
    for c in r["comparison"]:
        lines.append(
            f"| {c['phase']} | {_fmt(c['measured_gib'])} | {_fmt(c['estimate_gib'])} | {_fmt(c['ratio'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def run_cases_in_subprocesses(names: list[str], out: Path, argv: list[str]) -> list[dict]:
    """Each case in its own process (one fake world per process); a failed case is reported, not fatal."""
    results = []
    for name in names:
        cmd = [sys.executable, __file__, *argv, "--case", name]
        print(f"[rehearsal] {name}: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        path = out / f"{name}.json"
        if rc == 0 and path.is_file():
            results.append(json.loads(path.read_text()))
        else:
            results.append({"case": name, "error": f"exit status {rc}"})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", nargs="+", default=list(GPU_CASES), choices=sorted(CASES))
    ap.add_argument("--case", choices=sorted(CASES), help="run this one case in this process")
    ap.add_argument("--work", type=Path, default=None, help="model folders and run dirs (default: OUT/work)")
    ap.add_argument("--no-export", action="store_true", help="skip the export phase")
    ap.add_argument(
        "--export-to-null", action="store_true", help="export whole, the transformers' bytes to /dev/null"
    )
    ap.add_argument(
        "--num-steps", type=int, default=None, help="rollout denoising steps (default: the recipe's)"
    )
    ap.add_argument(
        "--sp-timing", action="store_true", help="run bench/sp_timing.py instead (its own flags follow)"
    )
    args, rest = ap.parse_known_args()
    if args.sp_timing:
        from bench import sp_timing

        sp_timing.main(["--out", str(args.out), *rest])
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    if args.case:
        result = run_case(args.case, work, args.num_steps, not args.no_export, args.export_to_null)
        (args.out / f"{args.case}.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / f"{args.case}.md").write_text(case_markdown(result))
        print(case_markdown(result), flush=True)
        return
    argv = ["--out", str(args.out), "--work", str(work)]
    argv += (
        (["--num-steps", str(args.num_steps)] if args.num_steps else [])
        + (["--no-export"] if args.no_export else [])
        + (["--export-to-null"] if args.export_to_null else [])
    )
    results = run_cases_in_subprocesses(args.cases, args.out, argv)
    text = "\n".join(
        case_markdown(r) if "error" not in r else f"### {r['case']}: failed ({r['error']})\n" for r in results
    )
    (args.out / "rehearsal.md").write_text(text)
    print(text)
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
