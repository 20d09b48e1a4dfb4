"""Export cost: the streaming export against the former gather-all export, and checkpoint bytes.

    python bench/export_stream.py --out bench/results/export_stream.json
    python bench/export_stream.py --out OUT.json --layers 6 --modes full lora

Builds a Wan folder of a few hundred MB (the embedded tiny single-expert pipeline with its
transformer replaced by a random 8 x 128-head, ffn 4096 one of ``--layers`` blocks, fp32), then for
each mode (``full``: full fine-tune; ``lora``: rank 16, adapters + merged) and each export path runs
one fresh process (world 1, gloo, CPU) that builds the real Trainer (FSDP2-sharded, model dtype
bf16), saves a checkpoint (lean, and the former way with every parameter), and exports. Reported
per run: the checkpoints' bytes, the export's wall
seconds and its peak extra host memory (RSS sampled every 2 ms during the export, minus the RSS
before it; file pages the export maps count, as they do for the process). The numbers go to
``--out`` (JSON) and a short table is printed. Wall times on a shared machine vary; the memory is
the number to read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(root: Path, layers: int) -> Path:
    """The tiny single-expert folder with a few-hundred-MB transformer (random, fixed seed)."""
    from diffusers import WanTransformer3DModel

    from miles.models.tiny import TINY_TRANSFORMER, build_tiny_models, tiny_model_path

    build_tiny_models(REPO / ".cache" / "tiny-wan")
    dst = root / "model"
    shutil.copytree(tiny_model_path(REPO / ".cache" / "tiny-wan", "single_expert"), dst)
    shutil.rmtree(dst / "transformer")
    torch.manual_seed(0)
    config = {**TINY_TRANSFORMER, "num_attention_heads": 8, "attention_head_dim": 128, "ffn_dim": 4096}
    WanTransformer3DModel(**{**config, "num_layers": layers}).save_pretrained(dst / "transformer")
    return dst


def _child(mode: str, path: str, model: str, root: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", HF_HUB_OFFLINE="1")
    import miles.train.trainer as T
    from miles.config import parse_args
    from miles.train.export import export_pipeline, export_pipeline_gathered

    flags = ["--model.lora-rank", "16"] if mode == "lora" else []
    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", root]
        + ["--run.name", f"{mode}_{path}", "--run.wandb-mode", "disabled", "--run.no-progress"]
        + ["--model.path", model, "--model.dtype", "bfloat16", "--train.no-export", *flags]
    )
    trainer = T.Trainer(cfg)
    ckpt_bytes = _checkpoint_bytes(trainer, lean=True)
    former_bytes = _checkpoint_bytes(trainer, lean=False)
    export = export_pipeline if path == "stream" else export_pipeline_gathered
    base, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    export(cfg, trainer.model.path, list(trainer.model.transformers), trainer.run_dir / "export")
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    params = sum(p.numel() for t in trainer.model.transformers for p in t.parameters())
    out = {"mode": mode, "path": path, "params": params, "checkpoint_bytes": ckpt_bytes}
    out["former_checkpoint_bytes"] = former_bytes
    out.update(export_seconds=seconds, export_peak_extra_rss_bytes=max(peak[0], _rss()) - base)
    Path(result).write_text(json.dumps(out))
    trainer.close()


def _checkpoint_bytes(trainer, lean: bool) -> int:
    """Bytes of a checkpoint saved now: lean, or the former way (every parameter)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    import miles.train.checkpoint as C

    options = C.STATE_OPTIONS
    C.STATE_OPTIONS = options if lean else StateDictOptions()
    try:
        trainer.step = 0 if lean else 1
        trainer.save()
    finally:
        C.STATE_OPTIONS, trainer.step = options, 0
    ckpt = trainer.run_dir / "checkpoints" / f"step_{0 if lean else 1:06d}"
    return sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())


def _spawned(rank: int, *args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(2)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        _child(*args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the numbers")
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks (~17M parameters each)")
    parser.add_argument("--modes", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    args = parser.parse_args()
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp), args.layers)
        model_bytes = sum(f.stat().st_size for f in (model / "transformer").iterdir())
        for mode in args.modes:
            for path in ("gathered", "stream"):
                result = Path(tmp) / f"{mode}_{path}.json"
                mp.spawn(_spawned, args=(mode, path, str(model), tmp, str(result)), nprocs=1, join=True)
                rows.append(json.loads(result.read_text()))
    report = {"transformer_file_bytes": model_bytes, "threads": 2, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"transformer {model_bytes / 2**20:.0f} MiB (fp32 file); model dtype bf16")
    print(f"{'mode':6} {'export':9} {'ckpt MiB (former)':>18} {'export s':>9} {'peak extra MiB':>15}")
    for r in rows:
        ckpt = f"{r['checkpoint_bytes'] / 2**20:.1f} ({r['former_checkpoint_bytes'] / 2**20:.1f})"
        print(
            f"{r['mode']:6} {r['path']:9} {ckpt:>18} {r['export_seconds']:9.2f} "
            f"{r['export_peak_extra_rss_bytes'] / 2**20:15.1f}"
        )


if __name__ == "__main__":
    main()
